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
from pathlib import Path
from typing import Any

from hpctrain.cli.estimate import one_line_errors
from hpctrain.config import Config, _read_yaml, config_from_args, split_config_args
from hpctrain.config.parallel import AUTO
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import HpctrainError
from hpctrain.core.section import ConfigError
from hpctrain.estimate import bounds
from hpctrain.planning.auto import Choice, NoPlanFits, candidate_rows, choose, overrides, render, size
from hpctrain.planning.profile import builtin_shape

# what a language model's plan takes when the config leaves them at their defaults (fp32 and SGD:
# the trainer's, for the MNIST CNN); a plan in fp32 + SGD shards far less than the bf16 + AdamW job
# it is meant for (Llama 3 8B on 8 H100: fsdp dp2 x tp4 against fsdp dp8)
LLM_DEFAULTS = {"precision": "bf16", "optim.name": "adamw"}


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        env = _world(args)
        cfg, assumed = _with_llm_defaults(args.config_args)
        cfg = _with_machine(cfg, args)
        if args.network_gbps is not None:  # NaN or a negative rate: refused before the search
            bounds.check_number("--network-gbps", args.network_gbps, 1e6)
        choice = choose(cfg, env, network_gbps=args.network_gbps)
    except HpctrainError as err:
        if args.json:  # --json always prints one object, the error's too; the error line still goes to stderr
            print(json.dumps(_error_json(err), indent=2))
        raise
    if args.json:
        print(json.dumps(_as_json(choice, env, assumed), indent=2))
    else:
        print(render(choice, assumed))
    return 0


def _error_json(err: HpctrainError) -> dict[str, Any]:
    """What ``--json`` prints when no plan comes out: ``fits: false``, the error, and where no plan
    fits, the smallest need (bytes per rank) and what it is made of."""
    out: dict[str, Any] = {"fits": False, "error": str(err), "exit_code": err.exit_code}
    if isinstance(err, NoPlanFits):
        out |= err.as_json()
    return out


def _given_keys(config_args: list[str]) -> set[str]:
    """The dotted keys the command line's overrides and its YAML file set (the file was read and
    checked by config_from_args already)."""
    path, items = split_config_args(config_args)
    keys = {item.partition("=")[0].strip() for item in items}
    raw = _read_yaml(Path(path)) if path is not None else {}
    keys |= {key for key in raw if not isinstance(raw[key], dict)}
    keys |= {f"{section}.{key}" for section, values in raw.items() if isinstance(values, dict) for key in values}
    return keys


def _with_llm_defaults(config_args: list[str]) -> tuple[Config, list[str]]:
    """The config, and for a built-in language model (gpt, llama) that leaves ``precision`` or
    ``optim.name`` unset, the config with bf16 and AdamW (what such a model trains with) and the
    keys so assumed: the plan says so in its first lines and its config line carries them."""
    cfg = config_from_args(config_args)
    if builtin_shape(cfg.model) is None:
        return cfg, []
    given = _given_keys(config_args)
    assumed = [f"{key}={value}" for key, value in LLM_DEFAULTS.items() if key not in given]
    return (config_from_args([*config_args, *assumed]) if assumed else cfg), assumed


def _world(args: argparse.Namespace) -> ClusterEnv:
    """The world: ``-n`` ranks per node on ``--nodes`` nodes, or with ``--gpus-per-node`` ``-n``
    GPUs in all (``--gpus-per-node 8 -n 64``: 8 nodes); no more than a machine has."""
    for flag, value in (("-n", args.nproc), ("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    if args.gpus_per_node is None:
        bounds.check_world(args.nproc * args.nodes, args.nproc, f"-n {args.nproc} x --nodes {args.nodes}")
        return ClusterEnv(world_size=args.nproc * args.nodes, local_world_size=args.nproc, num_nodes=args.nodes)
    per_node = args.gpus_per_node
    bounds.check_world(args.nproc, per_node, f"-n {args.nproc} with --gpus-per-node {per_node}")
    if args.nproc % per_node:
        raise ConfigError(f"-n {args.nproc} GPUs must be a multiple of --gpus-per-node {per_node}; "
                          f"hint: -n {max(per_node, args.nproc // per_node * per_node)}")
    if args.nodes != 1:
        raise ConfigError("give --gpus-per-node with -n (all GPUs), or -n (per node) with --nodes, not both")
    return ClusterEnv(world_size=args.nproc, local_world_size=per_node, num_nodes=args.nproc // per_node)


def _with_machine(cfg: Config, args: argparse.Namespace) -> Config:
    """``parallel.strategy=auto`` and the machine flags as the config keys a job would carry."""
    keys: dict[str, Any] = {"strategy": AUTO}
    for flag, value, most in (("--gpu-memory-gb", args.gpu_memory_gb, bounds.MAX_MEMORY_GB),
                              ("--peak-tflops", args.peak_tflops, bounds.MAX_TFLOPS)):
        if value is not None:  # NaN: "no plan fits nan GB", after a search of every layout
            bounds.check_number(flag, value, most)
    for flag, key, value in (("--gpu", "target_gpu", args.gpu), ("--gpu-memory-gb", "memory_budget_gb",
                                                                  args.gpu_memory_gb),
                             ("--peak-tflops", "target_peak_tflops", args.peak_tflops)):
        if value is None:
            continue
        given = getattr(cfg.parallel, key)
        if given is not None and given != value:
            raise ConfigError(f"{flag} {value} contradicts parallel.{key}={given}; hint: give one")
        keys[key] = value
    if args.peak_tflops is not None and args.gpu is None and cfg.parallel.target_gpu is None:
        raise ConfigError("--peak-tflops describes the --gpu it plans for; hint: add --gpu NAME")
    return replace(cfg, parallel=replace(cfg.parallel, **keys))


def _as_json(choice: Choice, env: ClusterEnv, assumed: list[str]) -> dict[str, Any]:
    m, c = choice.machine, choice.chosen
    machine = {**asdict(m), "budget": round(m.budget), "usable": round(m.usable), "flops": round(m.flops),
               "budget_text": size(m.budget), "usable_text": size(m.usable), "attention": m.attention}
    host = {"host_bytes_per_rank": round(c.host),
            "host_bytes_per_node": round(c.host * max(1, min(m.local, env.world_size)))} if c.cpu_offload else {}
    return {"fits": True, "chosen": [*overrides(c, choice.config, m), *assumed], "label": c.label,
            "memory": size(c.total), "machine": machine, "world": env.world_size,
            "ranks_per_node": env.local_world_size, "nodes": env.num_nodes, "global_batch": choice.global_batch,
            "tokens_per_sample": choice.tokens_per_sample, "budget_bytes": round(m.budget),
            "usable_bytes": round(m.usable), "rejected": choice.rejected, "candidates": candidate_rows(choice),
            "assumptions": choice.assumptions(), "assumed": assumed, **host}


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
    one_line_errors(p, "plan")
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
    p.add_argument("--network-gbps", type=float, default=None, metavar="GBPS",
                   help="the network between nodes, Gb/s per GPU (default: the GPU family's usual build, e.g. 400 "
                        "for H100 SXM, 100 for L40S; docs/estimate.md)")
    p.add_argument("--json", action="store_true", help="print the machine, world and candidates as JSON")
    p.set_defaults(func=cmd_plan)
