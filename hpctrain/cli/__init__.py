"""``hpctrain`` command line: parse, then call one function per subcommand."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import textwrap
import traceback
from pathlib import Path

from hpctrain.checkpoint.preempt import keep_signals, start_up_signals
from hpctrain.config import Config, config_from_args, key_names, reference_markdown, to_yaml
from hpctrain.core.env import detect, started_a_group
from hpctrain.core.errors import EXIT_RUN_FAILED, IO_ERRNOS, HpctrainError, UserError, io_error, user_code_error
from hpctrain.core.protocol import exit_code
from hpctrain.launch.rank import start_rank
from hpctrain.telemetry.loggers import configure_logging

# Every subcommand in `hpctrain --help` order: the module whose add_parser(sub) registers it,
# and its line in that list. Only the invoked command's module is imported (a module may
# register several: launch.cli has run, slurm and doctor), so `hpctrain slurm --dry-run` or
# `hpctrain --help` on a login node never pays for the torch import that `hpctrain bench`
# needs. The lines must equal the modules' own help (tests/test_cli.py compares them).
COMMANDS: dict[str, tuple[str, str]] = {
    "train": (__name__, "train a model (reference trainer)"),
    "eval": (__name__, "evaluate saved weights on the validation split, exactly, at any world size"),
    "run": ("hpctrain.cli.launch", "N local ranks via torchrun: hpctrain run -n 2 [train|eval] [CONFIG] [k=v]"),
    "slurm": ("hpctrain.cli.launch", "write (and submit) an sbatch script; `slurm status|cancel RUN_DIR`"),
    "k8s": ("hpctrain.cli.launch", "write (and apply) a Kubernetes PyTorchJob or JobSet for the same job"),
    "doctor": ("hpctrain.cli.launch", "what a job sees on this node (or every node) and common mistakes"),
    "config": (__name__, "show the resolved config, or the config reference"),
    "models": (__name__, "list registered models with parameter counts"),
    "ckpt": ("hpctrain.cli.ckpt", "list, verify or export checkpoints"),
    "data": ("hpctrain.cli.data", "pack data into tar shards (WebDataset layout), verify, inspect"),
    "estimate": ("hpctrain.cli.estimate", "size a training run: FLOPs and time, memory per GPU by strategy, "
                                          "checkpoint cost, Young-Daly interval"),
    "plan": ("hpctrain.cli.plan", "choose strategy, tp, pp, offload, activation checkpointing and micro-batch "
                                  "for a machine (parallel.strategy=auto) and print why, without training"),
    "report": ("hpctrain.cli.report", "summary table and plots of one or more runs (--html: one page)"),
    "bench": ("hpctrain.cli.bench", "the workshop's benchmarks, one command each: table, JSON and PNG"),
}


def _config(args: argparse.Namespace) -> Config:
    return config_from_args(args.config_args)


def _passive_omp() -> None:
    """OpenMP's threads sleep when idle instead of spinning, unless the user chose (set before torch
    loads it): on cores shared with other processes (loader workers, other ranks, a busy node) the
    spinning threads of one process made a tiny LoRA step 2.35 s instead of 0.05 s (issue 38)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cmd_train(args: argparse.Namespace) -> int:
    _passive_omp()
    cfg = _config(args)  # no torch yet: during its import (seconds) a preemption signal would end the rank
    keep_signals(start_up_signals(cfg.checkpoint))  # kept instead, and honoured after the first step
    from hpctrain.train import train  # torch: after keep_signals, and never for a login node's commands

    start_rank()  # a rank of torchrun / `hpctrain run` ends with its launcher and beats for its watchdog

    try:
        summary = train(cfg)
    except Exception as err:
        # the user's forward or loss failing on a batch is bad input (exit 2, naming the key), not our bug
        known = user_code_error(err, cfg.model.name, cfg.train.loss)
        if known is None:
            raise
        raise known from err
    return exit_code(summary.get("outcome"))  # 3 = preempted: requeue


def cmd_eval(args: argparse.Namespace) -> int:
    _passive_omp()
    from hpctrain.evaluation.job import run_eval  # torch: only the eval command loads it
    from hpctrain.parallel import checkpoint_formats  # noqa: F401  # torch: with eval; every format's view, by path

    start_rank()

    run_eval(_config(args), Path(args.weights), Path(args.out) if args.out else None, args.predictions)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.action == "doc":
        if len(args.config_args) > 1:
            raise UserError(f"config doc takes at most one SECTION, got {' '.join(args.config_args)}; "
                            "hint: hpctrain config doc optim")
        sys.stdout.write(reference_markdown(args.config_args[0] if args.config_args else None))
    else:
        sys.stdout.write(to_yaml(_config(args)))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from hpctrain.models import REGISTRY, build_model, count_parameters  # torch: only this command builds models

    print(f"{'name':<12} {'parameters':>12}  {'input':<12} description")
    for name, spec in REGISTRY.items():
        params = count_parameters(build_model(name))
        print(f"{name:<12} {params:>12,}  {'x'.join(map(str, spec.input_shape)):<12} {spec.description}")
    print("\nany other model: model.name=package.module:NAME, a factory or an nn.Module class; it gets "
          "num_classes and in_channels if its signature takes them, and may return logits or log_softmax")
    return 0


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value]")
    p.set_defaults(func=cmd_train)


def _keys_epilog() -> str:
    """``train --help``'s list of keys (imports every config section: only for that command)."""
    lines = ["config keys (a YAML file, then key=value overrides; the command line wins):"]
    for section, keys in key_names().items():
        text = f"{section or 'top level'}: " + ", ".join(f"{section}.{k}" if section else k for k in keys)
        lines.append(textwrap.fill(text, 100, initial_indent="  ", subsequent_indent="      "))
    lines.append("types, defaults and meanings: hpctrain config doc [SECTION], e.g. hpctrain config doc optim")
    return "\n".join(lines)


def _add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("--weights", required=True,
                   help="a run directory (its model.pt, else its newest intact checkpoint), its checkpoints/ "
                        "folder, one checkpoint (RUN/checkpoints/step-N), or a weights file (model.pt, a state dict)")
    p.add_argument("--out", help="directory for eval.json (default: the run directory; next to a weights file)")
    p.add_argument("--predictions", action="store_true", help="also write predictions.jsonl (keys, predictions)")
    p.set_defaults(func=cmd_eval)


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show", "doc"])
    p.add_argument("config_args", nargs="*", metavar="[CONFIG] [key=value] | SECTION",
                   help="show: a YAML file and overrides; doc: one section (model, data, optim, ...) or all")
    p.set_defaults(func=cmd_config)


def _add_models(p: argparse.ArgumentParser) -> None:
    p.set_defaults(func=cmd_models)


_OWN = {"train": _add_train, "eval": _add_eval, "config": _add_config, "models": _add_models}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with ``command``'s arguments (importing its module only), every other command
    listed by name and help; without a command, the list alone (``hpctrain --help``)."""
    parser = argparse.ArgumentParser(prog="hpctrain", description=__doc__)
    parser.set_defaults(parse_command=parse_args)  # launch.cli's `run` checks the ranks' command with it
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = COMMANDS[command][0] if command in COMMANDS else None
    for name, (module, line) in COMMANDS.items():
        if name in sub.choices:
            continue  # registered along with an earlier command of its module
        if module == __name__ and name == "train" == command:  # only then: the key list imports every section
            _OWN[name](sub.add_parser(name, help=line, epilog=_keys_epilog(),
                                      formatter_class=argparse.RawDescriptionHelpFormatter))
        elif module == __name__:
            _OWN[name](sub.add_parser(name, help=line))
        elif module == wanted:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=line)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``hpctrain ARGV``: a command comes first (the only option before it is -h)."""
    command = argv[0] if argv and not argv[0].startswith("-") else None
    return build_parser(command).parse_args(argv)


def _setup_logging() -> None:
    try:
        is_main = detect().is_main
    except RuntimeError:
        is_main = True
    configure_logging(is_main)  # hpctrain's lines, not other libraries' import noise


EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell reports when a command's reader left (`yes | head -1`)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 ok, 1 failed run, 2 bad input, 3 preempted (requeue), 130 interrupted,
    141 stdout's reader went away (`hpctrain estimate ... | head -1`: quiet, as a shell's own tools).

    Every deliberate error is an :class:`HpctrainError`: one line naming the culprit, no
    traceback. Anything else is a bug (in hpctrain, or in user code it called): a first line
    that says so, then the traceback, because that is what a bug report needs."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        _setup_logging()  # inside: a malformed launcher variable is an input error too
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit: a reader that left is then seen below, not as a bug
        return code
    except BrokenPipeError:  # before OSError: the reader closed the pipe, nothing is wrong with the command
        return _reader_gone(whole_process=argv is None)
    except HpctrainError as err:  # every deliberate error: a message and its exit code
        _say(f"hpctrain {args.command}: error: {err}")
        return _leave(err.exit_code, whole_process=argv is None)
    except KeyboardInterrupt:
        _say(f"hpctrain {args.command}: interrupted")
        return 130
    except OSError as err:  # disk full, read-only, permission denied: the machine's state, not a bug
        if err.errno not in IO_ERRNOS:
            return _internal_error(args.command, err, whole_process=argv is None)
        known = _io_error(err)
        _say(f"hpctrain {args.command}: error: {known}")
        return _leave(known.exit_code, whole_process=argv is None)
    except Exception as err:  # noqa: BLE001 - a bug: say so first, then show where
        return _internal_error(args.command, err, whole_process=argv is None)


def _reader_gone(whole_process: bool) -> int:
    """Stop quietly. For the whole process, stdout is pointed at /dev/null first: Python flushes it
    again on the way out, and that write would print 'Exception ignored ... BrokenPipeError'."""
    if whole_process:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # no file descriptor behind sys.stdout: nothing will be flushed to one
            pass
    return EXIT_PIPE


def _say(line: str) -> None:
    """One line to stderr in one write: under `python -u` print() writes the text and its newline
    apart, and two ranks failing alike ran their lines together ("...run.dirhpctrain train: error")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _internal_error(command: str, err: Exception, whole_process: bool) -> int:
    """A bug: a first line that says so, then the traceback of the error being handled."""
    print(f"hpctrain {command}: internal error: {type(err).__name__}: {err}\n"
          "This is a bug in hpctrain (or in user code it called), not a problem with the input; "
          "please report it with the traceback below.", file=sys.stderr)
    traceback.print_exc()
    return _leave(EXIT_RUN_FAILED, whole_process)


def _io_error(err: OSError) -> HpctrainError:
    """An I/O error no module turned into an :class:`HpctrainError`: one line naming its path."""
    path = err.filename if err.filename2 is None else f"{err.filename} -> {err.filename2}"
    return io_error("read or write", "a file" if path is None else path, err)


def _leave(code: int, whole_process: bool) -> int:
    """After an error, the traceback keeps the run's objects alive (a DDP model, and through
    it the gloo process group) until the error is dropped. torch's gloo group can deadlock in
    its destructor then: the destroying thread holds the GIL while a gloo worker thread,
    ending the failed collective's work, waits for the GIL to free a tensor (seen as a rank
    that printed its error and never exited). A rank that ran a process group therefore ends
    here, its output flushed, without running destructors. Only when this call is the whole
    process (`hpctrain ...`), never when a test or a program calls ``main([...])``."""
    if whole_process and started_a_group():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
