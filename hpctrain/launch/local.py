"""``hpctrain run -n N``: N local ranks through PyTorch's own torchrun machinery."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run


def torchrun_args(nproc: int, subcommand: list[str], *, max_restarts: int = 0, nnodes: str = "1",
                  rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                  monitor_interval: float = 0.5) -> list[str]:
    """The torchrun command line that runs ``python -m hpctrain SUBCOMMAND...`` on each rank."""
    args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}",
            f"--monitor-interval={monitor_interval}"]
    if rdzv_endpoint:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id or 'hpctrain'}"]
    else:
        args.append("--standalone")  # single node: a free port, no fixed endpoint to collide on
    return args + ["-m", "hpctrain", *subcommand]


def launch(nproc: int, subcommand: list[str], **options: object) -> int:
    """Run and wait; returns the exit code (non-zero if any rank failed after all restarts)."""
    argv = torchrun_args(nproc, subcommand, **options)  # type: ignore[arg-type]
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as err:
        failures = err.failures
        first = failures[min(failures)] if failures else None
        code = first.exitcode if first is not None and first.exitcode else 1
        print(f"hpctrain run: {err.name} failed (rank exit code {code}); see the rank logs above", file=sys.stderr)
        return code if code > 0 else 1
    return 0
