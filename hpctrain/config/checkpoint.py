"""The ``checkpoint`` config section and its checks (every message names the key and the value)."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any, Literal

from hpctrain.core.section import ConfigError, at_least, opt, positive
from hpctrain.core.storage import check_storage_options, parse_url

# What checkpoint.signals may name. SIGHUP too: NCCL and other libraries may install their own SIGUSR1
# handlers (why submitit moved to SIGHUP), and some sites reserve SIGUSR1 (docs/cluster.md).
SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGTERM", "SIGINT")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    enabled: bool = opt(True, "Write checkpoints to RUN_DIR/checkpoints/ (committed: files, then manifest, then rename).")
    every_steps: int | None = opt(None, "Save every N optimizer steps (None = no step schedule).")
    every_seconds: str | None = opt("3600", "Save every T seconds of wall clock; `auto` = Young-Daly sqrt(2 x measured save cost x mtbf_hours); None = off.", none_text=("none", "null", "off"))
    mtbf_hours: float = opt(2.0, "Mean time between failures of the whole job, for every_seconds=auto.")
    at_end: bool = opt(True, "Save when training ends (so a finished run can be exported or extended).")
    on_best: bool = opt(False, "Also save whenever the tracked validation metric improves (its checkpoint is named in checkpoints/best.json).")
    mode: Literal["sync", "async"] = opt("sync", "sync: the loop waits for the write; async: a background thread copies the state (before the next optimizer.step) and writes it; one save in flight.")
    hash: Literal["xxh3", "crc32", "sha256"] = opt("xxh3", "Checksum of every checkpoint file, checked on resume and by `hpctrain ckpt verify`: xxh3 (~10 GB/s a core, the xxhash package; crc32 without it), crc32 (stdlib zlib, ~3.6 GB/s), sha256 (~1.5 GB/s, for provenance). Checkpoints of any of them resume.")
    format: Literal["torch", "dcp"] = opt("torch", "torch: rank 0 writes replicated state as one file; dcp: torch.distributed.checkpoint, every rank its shard (reshardable).")
    local_dir: str | None = opt(None, "Two-tier: write to this node-local directory first, then copy to the run directory in the background.")
    stagger_seconds: float = opt(0.0, "Two-tier: node k waits k x this before copying to the shared file system.")
    keep_last: int = opt(3, "Keep the newest K committed checkpoints (>= 1).")
    keep_every: int | None = opt(None, "Also keep every checkpoint whose step is a multiple of M.")
    signals: list[str] = opt(["SIGUSR1", "SIGTERM"], "Signals that request save-and-exit (preemption): any of SIGUSR1, SIGUSR2, SIGHUP, SIGTERM, SIGINT (`hpctrain slurm --signal` sets it to match).")
    remote: str | None = opt(None, "Object-storage tier: s3://BUCKET/PREFIX. Each committed checkpoint is uploaded there in the background (files first, manifest last); resume=auto takes the newest intact checkpoint of either tier (docs/checkpointing.md).", none_text=("none", "null", "off"))
    storage_options: dict[str, Any] = opt({}, "For checkpoint.remote: endpoint_url, addressing_style, region, profile, anon, retries (e.g. checkpoint.storage_options.endpoint_url=http://minio:9000). Never credentials: they come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or an instance role.")
    remote_keep_last: int | None = opt(None, "Keep the newest K checkpoints on the remote tier (None = keep_last); keep_every applies there too.")
    remote_queue: int = opt(2, "Committed checkpoints that may wait while one uploads; a newer one replaces the oldest waiting one (logged), so training never waits on the upload.")
    remote_wait_s: float = opt(300.0, "At the end of training: wait at most this long for the uploads in flight (what is left is logged; the next run uploads the newest).")
    signal_check_every: int = opt(1, "Steps between the all-reduce that agrees on a signal / wall-clock save (multi-rank only).")

    def __post_init__(self) -> None:
        validate_checkpoint_config(self)


def validate_checkpoint_config(c: CheckpointConfig) -> None:
    """Raises ConfigError on the first bad value; changes nothing."""
    if c.every_steps is not None and c.every_steps <= 0:
        raise ConfigError(f"checkpoint.every_steps={c.every_steps} must be > 0 (or None to disable)")
    _check_every_seconds(c.every_seconds)
    positive("checkpoint", c, "mtbf_hours")
    if c.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={c.keep_last} must be >= 1: "
                          "the newest good checkpoint is never deleted")
    if c.keep_every is not None and c.keep_every <= 0:
        raise ConfigError(f"checkpoint.keep_every={c.keep_every} must be > 0 (or None)")
    at_least("checkpoint", c, "signal_check_every", 1)
    _check_remote(c)
    at_least("checkpoint", c, "stagger_seconds", 0)
    for name in c.signals:
        if name not in SIGNALS or not hasattr(signal, name):
            raise ConfigError(f"checkpoint.signals: {name!r} is not one of {', '.join(SIGNALS)}")


def _check_remote(c: CheckpointConfig) -> None:
    if c.remote is not None:
        if not re.match(r"s3://[^/]+", c.remote):
            raise ConfigError(f"checkpoint.remote={c.remote!r} is not an s3://BUCKET/PREFIX URL; hint: "
                              "checkpoint.remote=s3://my-bucket/runs/my-run (endpoint: AWS_ENDPOINT_URL or "
                              "checkpoint.storage_options.endpoint_url)")
        parse_url(c.remote, "checkpoint.remote")  # bucket and key as the client takes them ('..', '//', ...)
    if c.remote_keep_last is not None and c.remote_keep_last < 1:
        raise ConfigError(f"checkpoint.remote_keep_last={c.remote_keep_last} must be >= 1 (or None = keep_last)")
    check_storage_options("checkpoint.storage_options", c.storage_options)
    at_least("checkpoint", c, "remote_queue", 1)
    at_least("checkpoint", c, "remote_wait_s", 0)


def _check_every_seconds(value: str | None) -> None:
    if value is None or value == "auto":
        return
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"checkpoint.every_seconds={value!r} must be a number of seconds, "
                          "auto (Young-Daly) or None") from None
    if seconds <= 0:
        raise ConfigError(f"checkpoint.every_seconds={value} must be > 0")
