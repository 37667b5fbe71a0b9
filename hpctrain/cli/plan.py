"""``hpctrain plan``: the choice ``parallel.strategy=auto`` makes (:mod:`hpctrain.planning.auto`) for a
machine described on the command line, printed as a table or JSON, without training.

``--gpu NAME`` plans for that GPU of the accelerator table wherever the command runs (a login node
without a GPU, a laptop): it sets ``parallel.target_gpu`` (and ``--gpu-memory-gb`` /
``--peak-tflops`` set ``parallel.memory_budget_gb`` / ``parallel.target_peak_tflops``), and the
printed ``config:`` line carries it, so a job given those keys chooses exactly this plan. For the
built-in transformers (gpt, llama) nothing here imports torch; other models are measured on the
meta device, which does.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from typing import Any

from hpctrain.config import Config, config_from_args
from hpctrain.config.parallel import AUTO
from hpctrain.core.env import ClusterEnv
from hpctrain.core.section import ConfigError
from hpctrain.planning.auto import Choice, candidate_rows, choose, overrides, render, size


def cmd_plan(args: argparse.Namespace) -> int:
    env = _world(args)
    cfg = _with_machine(config_from_args(args.config_args), args)
    choice = choose(cfg, env)
    print(json.dumps(_as_json(choice, env), indent=2) if args.json else render(choice))
    return 0


def _world(args: argparse.Namespace) -> ClusterEnv:
    """The world: ``-n`` ranks per node on ``--nodes`` nodes, or with ``--gpus-per-node`` ``-n``
    GPUs in all (``--gpus-per-node 8 -n 64``: 8 nodes)."""
    if args.nproc < 1 or args.nodes < 1:
        raise ConfigError(f"hpctrain plan: -n {args.nproc} and --nodes {args.nodes} must be positive")
    if args.gpus_per_node is None:
        return ClusterEnv(world_size=args.nproc * args.nodes, local_world_size=args.nproc, num_nodes=args.nodes)
    per_node = args.gpus_per_node
    if per_node < 1 or args.nproc % per_node:
        raise ConfigError(f"hpctrain plan: -n {args.nproc} GPUs must be a multiple of --gpus-per-node {per_node}; "
                          f"hint: -n {max(per_node, args.nproc // max(per_node, 1) * per_node)}")
    if args.nodes != 1:
        raise ConfigError("hpctrain plan: give --gpus-per-node with -n (all GPUs), or -n (per node) with --nodes, "
                          "not both")
    return ClusterEnv(world_size=args.nproc, local_world_size=per_node, num_nodes=args.nproc // per_node)


def _with_machine(cfg: Config, args: argparse.Namespace) -> Config:
    """``parallel.strategy=auto`` and the machine flags as the config keys a job would carry."""
    keys: dict[str, Any] = {"strategy": AUTO}
    for flag, key, value in (("--gpu", "target_gpu", args.gpu), ("--gpu-memory-gb", "memory_budget_gb",
                                                                  args.gpu_memory_gb),
                             ("--peak-tflops", "target_peak_tflops", args.peak_tflops)):
        if value is None:
            continue
        given = getattr(cfg.parallel, key)
        if given is not None and given != value:
            raise ConfigError(f"hpctrain plan {flag} {value} contradicts parallel.{key}={given}; hint: give one")
        keys[key] = value
    if args.peak_tflops is not None and args.gpu is None and cfg.parallel.target_gpu is None:
        raise ConfigError("hpctrain plan --peak-tflops describes the --gpu it plans for; hint: add --gpu NAME")
    return replace(cfg, parallel=replace(cfg.parallel, **keys))


def _as_json(choice: Choice, env: ClusterEnv) -> dict[str, Any]:
    m = choice.machine
    machine = {**asdict(m), "budget": round(m.budget), "usable": round(m.usable), "flops": round(m.flops),
               "budget_text": size(m.budget), "usable_text": size(m.usable), "attention": m.attention}
    return {"chosen": overrides(choice.chosen, choice.config, m), "label": choice.chosen.label,
            "memory": size(choice.chosen.total), "machine": machine, "world": env.world_size,
            "ranks_per_node": env.local_world_size, "nodes": env.num_nodes, "global_batch": choice.global_batch,
            "tokens_per_sample": choice.tokens_per_sample, "budget_bytes": round(m.budget),
            "usable_bytes": round(m.usable), "rejected": choice.rejected, "candidates": candidate_rows(choice)}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="choose strategy, tp, pp, offload, activation checkpointing and micro-batch for a machine "
                     "(parallel.strategy=auto) and print why, without training",
        description="Print the plan parallel.strategy=auto chooses for a world of GPUs. With --gpu it plans for "
                    "that GPU wherever it runs (a login node needs no GPU and, for gpt and llama, no torch); "
                    "give the printed config line's parallel.target_gpu to the job and auto there chooses the "
                    "same plan. Without --gpu: this machine's device (on CPU, parallel.memory_budget_gb).",
        epilog="example: hpctrain plan --gpu h100-sxm --gpus-per-node 8 -n 64 model.name=llama model.n_layers=80 "
               "model.hidden=8192 model.heads=64 model.kv_heads=8 model.ffn_hidden=28672 model.vocab=128256 "
               "model.seq_len=8192 model.tie_weights=false precision=bf16 optim.name=adamw "
               "data.global_batch_size=64")
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("-n", "--nproc", type=int, default=1,
                   help="ranks per node (default 1); with --gpus-per-node: GPUs in all")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node; -n is then the total (e.g. --gpus-per-node 8 -n 64: 8 nodes)")
    p.add_argument("--gpu", default=None, help="the target GPU by its accelerator-table name (h100-sxm, a100-40gb, "
                                               "h200, b200, mi300x, ...; as hpctrain estimate --gpu): sets "
                                               "parallel.target_gpu")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory per GPU in GB, over the table's (sets parallel.memory_budget_gb)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense peak TFLOP/s at the run's precision, over the table's, or for a --gpu the table "
                        "lacks (with --gpu-memory-gb; sets parallel.target_peak_tflops)")
    p.add_argument("--json", action="store_true", help="print the machine, world and candidates as JSON")
    p.set_defaults(func=cmd_plan)
