"""``telemetry.loggers=[jsonl, tensorboard, mlflow, wandb]``: metric rows to any subset at once.

- JSONL (``RUN_DIR/metrics.jsonl``) is always on: it is the run's record, read by
  ``hpctrain report`` and trimmed on resume, so a failure to write it is not hidden.
- The others go through their real libraries: TensorBoard's ``SummaryWriter``
  (``RUN_DIR/tensorboard/``), MLflow's ``MlflowClient`` (``telemetry.mlflow_uri``, or
  ``$MLFLOW_TRACKING_URI``, or a local ``./mlruns/`` store), W&B's ``wandb.init`` (offline
  by default, files under ``RUN_DIR/wandb/``).
- Rank 0 writes; the other ranks get an empty set. Per-rank series (the straggler rows)
  reach rank 0 through the straggler all-gather and are logged there, one series per rank.
- A missing package is a UserError with the install hint, before training starts; a
  backend that fails later (server down, disk quota) warns once, is dropped, and training
  goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from hpctrain.core.errors import UserError, io_error

log = logging.getLogger("hpctrain")

BACKENDS = ("jsonl", "tensorboard", "mlflow", "wandb")
LOG_FORMAT = "%(asctime)s %(source)s %(levelname)s %(message)s"  # source: hpctrain, or the other library's logger


def _ours(record: logging.LogRecord) -> bool:
    return record.name == "hpctrain" or record.name.startswith("hpctrain.")


class _Named(logging.Formatter):
    """hpctrain's lines as ``hpctrain LEVEL``; another library's under its own logger's name."""

    def format(self, record: logging.LogRecord) -> str:
        record.source = "hpctrain" if _ours(record) else record.name
        return super().format(record)


def _keep(record: logging.LogRecord) -> bool:
    """Other libraries' warnings are mostly import noise of optional parts (torchao's missing
    CUDA kernels, "no triton" on a CPU host): their errors pass, their warnings and info do not."""
    return _ours(record) or record.levelno >= logging.ERROR


def log_handler() -> logging.Handler:
    """The console handler of the CLI's log (stderr)."""
    handler = logging.StreamHandler()
    handler.setFormatter(_Named(LOG_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_keep)
    return handler


def configure_logging(is_main: bool) -> None:
    """The CLI's log: INFO on the main rank (WARNING elsewhere), hpctrain's lines only, plus other
    libraries' errors under their own names. Like ``logging.basicConfig``, a no-op when the root
    logger has handlers already (a caller's own set-up stays)."""
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, handlers=[log_handler()])
METRICS_FILE = "metrics.jsonl"


class Backend(Protocol):
    def log(self, row: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LoggerOptions:
    run_name: str
    experiment: str = "hpctrain"          # MLflow experiment and W&B project
    mlflow_uri: str | None = None         # None: $MLFLOW_TRACKING_URI, else ./mlruns/
    wandb_mode: str = "offline"           # offline | online | disabled
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config, logged as params


class LoggerError(UserError):
    """A logger is unknown or its package is missing; the message gives the install hint."""


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row, flat: a straggler row's per-rank entries become
    ``straggler/rank{R}/{field}`` series."""
    out = {k: float(v) for k, v in row.items()
           if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if row.get("kind") == "straggler":
        out = {f"straggler/{k}": v for k, v in out.items()}
        for rank in row.get("ranks", []):
            out |= {f"straggler/rank{rank['rank']}/{k}": float(v) for k, v in rank.items()
                    if k not in ("rank", "node") and isinstance(v, (int, float))}
    return out


class Loggers:
    """The fan-out the loop holds: ``log(row)`` after each interval, ``close()`` at the end."""

    def __init__(self, backends: list[tuple[str, Backend]]) -> None:
        self.backends = backends

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.backends]

    def log(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        for name, backend in list(self.backends):
            if name == "jsonl":
                backend.log(row, step)
            else:
                self._guarded(name, backend, lambda b=backend: b.log(row, step))

    def close(self) -> None:
        for name, backend in list(self.backends):
            self._guarded(name, backend, backend.close)
        self.backends = []

    def _guarded(self, name: str, backend: Backend, call: Any) -> None:
        try:
            call()
        except Exception as err:  # noqa: BLE001 - a metrics sink must never stop training
            log.warning("logger %s failed (%s: %s); it is switched off, training goes on",
                        name, type(err).__name__, err)
            self.backends = [(n, b) for n, b in self.backends if b is not backend]


def build_loggers(names: list[str], run_dir: Path, options: LoggerOptions, *, is_main: bool = True) -> Loggers:
    """Check every name and package first (on every rank, so all fail alike), then open
    the backends on rank 0 only."""
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise LoggerError(f"telemetry.loggers: unknown {unknown}; choose from {', '.join(BACKENDS)}")
    wanted = ["jsonl", *dict.fromkeys(n for n in names if n != "jsonl")]
    for name in wanted:
        _check_installed(name, options)
    if not is_main:
        return Loggers([])
    backends: list[tuple[str, Backend]] = []
    for name in wanted:
        try:
            backends.append((name, _OPENERS[name](run_dir, options)))
        except Exception as err:  # noqa: BLE001 - e.g. the MLflow server is down: go on without it
            if name == "jsonl":
                raise
            log.warning("logger %s could not start (%s: %s); training goes on without it",
                        name, type(err).__name__, err)
    return Loggers(backends)


_PACKAGES = {"tensorboard": ["tensorboard"], "mlflow": ["mlflow"], "wandb": ["wandb"]}


def _check_installed(name: str, options: LoggerOptions) -> None:
    modules = list(_PACKAGES.get(name, []))
    if name == "mlflow" and not _mlflow_uri(options):
        modules += ["sqlalchemy", "alembic"]  # the local SQLite store (mlflow-skinny lacks them)
    for module in modules:
        try:
            __import__(module)
        except ImportError as err:
            raise LoggerError(f"telemetry.loggers includes {name!r} but {module} is not installed ({err}); "
                              f"hint: pip install 'hpctrain[{name}]'") from None


# ---------------------------------------------------------------- backends


class JsonlLogger:
    """Append-only, one flushed line per row, so a crash keeps every row written so far. A row
    that cannot be written (disk full, quota) ends the run with an error naming the file
    (:func:`hpctrain.core.errors.io_error`): this is the run's record, never silently incomplete."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fh: IO[str] | None = open(path, "a")
        except OSError as err:
            raise io_error("open", path, err) from err

    def log(self, row: dict[str, Any], step: int) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(json.dumps(row) + "\n")
            self._fh.flush()
        except OSError as err:
            self._drop()
            raise io_error("append a row to", self.path, err) from err

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _drop(self) -> None:
        """Close after a failed write: the bytes still buffered cannot be written either."""
        fh, self._fh = self._fh, None
        with contextlib.suppress(OSError):
            if fh is not None:
                fh.close()


class TensorBoardLogger:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, row: dict[str, Any], step: int) -> None:
        for key, value in scalars(row).items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class MlflowLogger:
    def __init__(self, uri: str, options: LoggerOptions, artifacts: Path | None) -> None:
        from mlflow import MlflowClient

        self._client = MlflowClient(uri)
        found = self._client.get_experiment_by_name(options.experiment)
        experiment = found.experiment_id if found is not None else self._client.create_experiment(
            options.experiment, artifact_location=artifacts.as_uri() if artifacts else None)
        self._run_id = self._client.create_run(experiment, run_name=options.run_name).info.run_id
        params = _flatten(options.config)
        if params:
            from mlflow.entities import Param

            self._client.log_batch(self._run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])

    def log(self, row: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = _now_ms()
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in scalars(row).items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


class WandbLogger:
    def __init__(self, run_dir: Path, options: LoggerOptions) -> None:
        import wandb

        self._run = wandb.init(project=options.experiment, name=options.run_name, dir=str(run_dir),
                               mode=options.wandb_mode, config=options.config,  # type: ignore[arg-type]
                               settings=wandb.Settings(console="off", silent=True))

    def log(self, row: dict[str, Any], step: int) -> None:
        self._run.log(scalars(row), step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() alone returned here, in about 1 run in 3 (wandb 0.31 offline), before the
        # transaction log held more than its header; teardown waits for the service to exit.
        wandb.teardown()


def _open_jsonl(run_dir: Path, options: LoggerOptions) -> Backend:
    return JsonlLogger(run_dir / METRICS_FILE)


def _open_tensorboard(run_dir: Path, options: LoggerOptions) -> Backend:
    return TensorBoardLogger(run_dir / "tensorboard")


def _open_mlflow(run_dir: Path, options: LoggerOptions) -> Backend:
    uri = _mlflow_uri(options)
    if uri:
        return MlflowLogger(uri, options, None)
    # MLflow 3 refuses a plain-folder store by default; a SQLite file inside ./mlruns/ keeps
    # the classic place and lets one `mlflow ui` compare every run started from here.
    root = Path("mlruns").resolve()
    root.mkdir(parents=True, exist_ok=True)
    return MlflowLogger(f"sqlite:///{root / 'mlflow.db'}", options, root / "artifacts")


def _mlflow_uri(options: LoggerOptions) -> str | None:
    return options.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or None


def _open_wandb(run_dir: Path, options: LoggerOptions) -> Backend:
    return WandbLogger(run_dir, options)


_OPENERS = {"jsonl": _open_jsonl, "tensorboard": _open_tensorboard, "mlflow": _open_mlflow, "wandb": _open_wandb}


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _mlflow_key(key: str) -> str:
    # MLflow keys allow letters, digits, _ - . / and space: anything else becomes _
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def _now_ms() -> int:
    return int(time.time() * 1000)
