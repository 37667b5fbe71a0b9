"""``hpctrain`` command line: parse, then call one function per subcommand."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from hpctrain.checkpoint import cli as ckpt_cli
from hpctrain.config import ConfigError, load_config, reference_markdown, to_yaml
from hpctrain.data.cli import add_parser as add_data_parser
from hpctrain.errors import HpctrainError


def _split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]``: the one argument without '=' is the YAML file."""
    paths = [a for a in args if "=" not in a]
    if len(paths) > 1:
        raise ConfigError(f"expected at most one config file, got {paths}; overrides look like key=value")
    return (paths[0] if paths else None), [a for a in args if "=" in a]


def _config(args: argparse.Namespace):  # noqa: ANN202 - returns Config
    path, overrides = _split_config_args(args.config_args)
    return load_config(path, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    from hpctrain.checkpoint.preempt import exit_code
    from hpctrain.train import train

    return exit_code(train(_config(args)).get("outcome"))  # 3 = preempted: requeue


def cmd_eval(args: argparse.Namespace) -> int:
    from hpctrain.eval_job import run_eval

    run_eval(_config(args), Path(args.weights), Path(args.out) if args.out else None, args.predictions)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from hpctrain.launch.local import launch

    rest = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not rest or rest[0] not in ("train", "eval"):
        rest = ["train", *rest]
    import time

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from hpctrain.checkpoint.preempt import launcher_exit_code

    cfg = _config(build_parser().parse_args(rest))  # fail here, once, not in N ranks
    started = time.time()
    try:
        code = launch(args.nproc, rest, max_restarts=args.max_restarts, nnodes=args.nnodes,
                      rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
    except SignalException as err:  # torchrun got SIGTERM and forwarded it to the ranks
        print(f"hpctrain run: stopped by {err.sigval.name}", file=sys.stderr)
        code = 128 + int(err.sigval)
    return launcher_exit_code(cfg, code, started) if rest[0] == "train" else code


def cmd_config(args: argparse.Namespace) -> int:
    if args.action == "doc":
        sys.stdout.write(reference_markdown())
    else:
        sys.stdout.write(to_yaml(_config(args)))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from hpctrain.models import REGISTRY, build_model, count_parameters

    print(f"{'name':<12} {'parameters':>12}  {'input':<12} description")
    for name, spec in REGISTRY.items():
        params = count_parameters(build_model(name))
        print(f"{name:<12} {params:>12,}  {'x'.join(map(str, spec.input_shape)):<12} {spec.description}")
    print("\nany other model: model.name=package.module:factory (called as factory(num_classes=N))")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpctrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (reference trainer)")
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value]")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate saved weights on the validation split, exactly, at any world size")
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("--weights", required=True, help="model.pt of a run (or a state dict file)")
    p.add_argument("--out", help="directory for eval.json (default: next to the weights)")
    p.add_argument("--predictions", action="store_true", help="also write predictions.jsonl (keys, predictions)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("run", help="N local ranks via torchrun: hpctrain run -n 2 [train|eval] [CONFIG] [k=v]")
    p.add_argument("-n", "--nproc", type=int, required=True, help="processes (ranks) on this node")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun elastic restarts after a failure")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for elastic jobs")
    p.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous (multi-node)")
    p.add_argument("--rdzv-id", help="job id shared by all nodes of the rendezvous")
    p.add_argument("command", nargs=argparse.REMAINDER, help="[train|eval] [CONFIG] [key=value ...] [--weights PATH]")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("config", help="show the resolved config, or the config reference")
    p.add_argument("action", choices=["show", "doc"])
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value]")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("models", help="list registered models with parameter counts")
    p.set_defaults(func=cmd_models)

    ckpt_cli.add_parser(sub)

    add_data_parser(sub)
    return parser


def _setup_logging() -> None:
    from hpctrain.env import detect

    try:
        is_main = detect().is_main
    except RuntimeError:
        is_main = True
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s hpctrain %(levelname)s %(message)s", datefmt="%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging()
    try:
        return int(args.func(args) or 0)
    except HpctrainError as err:  # every deliberate error: a message and its exit code
        print(f"hpctrain {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
