"""``hpctrain`` command line: parse, then call one function per subcommand."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path

from hpctrain.bench import cli as bench_cli
from hpctrain.checkpoint import cli as ckpt_cli
from hpctrain.config import ConfigError, load_config, reference_markdown, to_yaml
from hpctrain.data.cli import add_parser as add_data_parser
from hpctrain.errors import EXIT_RUN_FAILED, HpctrainError
from hpctrain.estimate import cli as estimate_cli
from hpctrain.launch import cli as launch_cli
from hpctrain.telemetry import report as report_cli


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
    print("\nany other model: model.name=package.module:NAME, a factory or an nn.Module class; it gets "
          "num_classes and in_channels if its signature takes them, and may return logits or log_softmax")
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

    launch_cli.add_parser(sub)  # run, slurm (status, cancel), doctor

    p = sub.add_parser("config", help="show the resolved config, or the config reference")
    p.add_argument("action", choices=["show", "doc"])
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value]")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("models", help="list registered models with parameter counts")
    p.set_defaults(func=cmd_models)

    ckpt_cli.add_parser(sub)

    add_data_parser(sub)
    estimate_cli.add_parser(sub)
    report_cli.add_parser(sub)
    bench_cli.add_parser(sub)
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
    """Exit codes: 0 ok, 1 failed run, 2 bad input, 3 preempted (requeue), 130 interrupted.

    Every deliberate error is an :class:`HpctrainError`: one line naming the culprit, no
    traceback. Anything else is a bug (in hpctrain, or in user code it called): a first line
    that says so, then the traceback, because that is what a bug report needs."""
    args = build_parser().parse_args(argv)
    try:
        _setup_logging()  # inside: a malformed launcher variable is an input error too
        return int(args.func(args) or 0)
    except HpctrainError as err:  # every deliberate error: a message and its exit code
        print(f"hpctrain {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"hpctrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - a bug: say so first, then show where
        print(f"hpctrain {args.command}: internal error: {type(err).__name__}: {err}\n"
              "This is a bug in hpctrain (or in user code it called), not a problem with the input; "
              "please report it with the traceback below.", file=sys.stderr)
        traceback.print_exc()
        return EXIT_RUN_FAILED
