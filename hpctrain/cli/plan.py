"""``hpctrain plan``: the choice ``parallel.strategy=auto`` makes for a world of ``-n`` ranks on
``--nodes`` nodes (:mod:`hpctrain.planning.auto`), printed as a table or JSON, without training."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from hpctrain.config import config_from_args
from hpctrain.config.parallel import AUTO
from hpctrain.core.env import ClusterEnv
from hpctrain.core.section import ConfigError
from hpctrain.planning.auto import candidate_rows, choose, overrides, render


def cmd_plan(args: argparse.Namespace) -> int:
    if args.nproc < 1 or args.nodes < 1:
        raise ConfigError(f"hpctrain plan: -n {args.nproc} and --nodes {args.nodes} must be positive")
    cfg = config_from_args(args.config_args)
    cfg = replace(cfg, parallel=replace(cfg.parallel, strategy=AUTO))
    world = args.nproc * args.nodes
    env = ClusterEnv(world_size=world, local_world_size=args.nproc, num_nodes=args.nodes)
    choice = choose(cfg, env)
    if args.json:
        print(json.dumps({"chosen": overrides(choice.chosen, choice.config), "rejected": choice.rejected,
                          "budget_bytes": choice.machine.budget, "usable_bytes": choice.machine.usable,
                          "machine": asdict(choice.machine), "world": world, "ranks_per_node": args.nproc,
                          "nodes": args.nodes, "global_batch": choice.global_batch,
                          "candidates": candidate_rows(choice)}, indent=2))
    else:
        print(render(choice))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose strategy, tp, pp, activation checkpointing and micro-batch "
                                    "(parallel.strategy=auto) and print why, without training")
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("-n", "--nproc", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--json", action="store_true", help="print the candidates as JSON")
    p.set_defaults(func=cmd_plan)
