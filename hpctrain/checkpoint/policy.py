"""When to save: every N steps, every T seconds (or the Young-Daly interval), at the end.

The step schedule is the same on every rank by construction. The wall-clock one is not
(clocks and speeds differ), so the trainer folds "my timer is due" into the same small
all-reduce that agrees on preemption signals (see preempt.py).
"""

from __future__ import annotations

import math
import signal
import time
from typing import Any

from hpctrain.config import ConfigError

SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT")
# Before the first save is measured, assume this write speed to estimate its cost.
_ASSUMED_BYTES_PER_S = 500e6


def validate_checkpoint_config(c: Any) -> None:
    """Called by CheckpointConfig; every message names the key and the value."""
    if isinstance(c.every_seconds, str) and c.every_seconds.lower() in ("none", "null", "off"):
        c.every_seconds = None  # `key=None` on the command line arrives as a string
    if c.every_steps is not None and c.every_steps <= 0:
        raise ConfigError(f"checkpoint.every_steps={c.every_steps} must be > 0 (or None to disable)")
    if c.every_seconds is not None and c.every_seconds != "auto":
        try:
            seconds = float(c.every_seconds)
        except ValueError:
            raise ConfigError(f"checkpoint.every_seconds={c.every_seconds!r} must be a number of seconds, "
                              "auto (Young-Daly) or None") from None
        if seconds <= 0:
            raise ConfigError(f"checkpoint.every_seconds={c.every_seconds} must be > 0")
    if c.mtbf_hours <= 0:
        raise ConfigError(f"checkpoint.mtbf_hours={c.mtbf_hours} must be > 0")
    if c.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={c.keep_last} must be >= 1: "
                          "the newest good checkpoint is never deleted")
    if c.keep_every is not None and c.keep_every <= 0:
        raise ConfigError(f"checkpoint.keep_every={c.keep_every} must be > 0 (or None)")
    if c.signal_check_every < 1:
        raise ConfigError(f"checkpoint.signal_check_every={c.signal_check_every} must be >= 1")
    if c.stagger_seconds < 0:
        raise ConfigError(f"checkpoint.stagger_seconds={c.stagger_seconds} must be >= 0")
    for name in c.signals:
        if name not in SIGNALS or not hasattr(signal, name):
            raise ConfigError(f"checkpoint.signals: {name!r} is not one of {', '.join(SIGNALS)}")


def young_daly_seconds(save_cost_s: float, mtbf_hours: float) -> float:
    """The optimal checkpoint interval to first order: sqrt(2 * C * MTBF)."""
    return math.sqrt(2.0 * max(save_cost_s, 1e-3) * mtbf_hours * 3600.0)


class Schedule:
    """Decides, at a step boundary, whether this rank wants a save."""

    def __init__(self, every_steps: int | None, every_seconds: str | None, mtbf_hours: float,
                 state_bytes: int = 0, clock: Any = time.monotonic) -> None:
        self.every_steps, self.mtbf_hours, self.clock = every_steps, mtbf_hours, clock
        self.auto = every_seconds == "auto"
        self.interval: float | None = None if every_seconds is None or self.auto else float(every_seconds)
        if self.auto:
            self.interval = young_daly_seconds(state_bytes / _ASSUMED_BYTES_PER_S, mtbf_hours)
        self.last_save = clock()

    def step_due(self, step: int) -> bool:
        return self.every_steps is not None and step % self.every_steps == 0

    def time_due(self) -> bool:
        return self.interval is not None and self.clock() - self.last_save >= self.interval

    def saved(self, stall_s: float, total_s: float) -> None:
        """After a save: restart the timer; in auto mode re-derive the interval from its cost.
        The cost is the loop's stall; never save faster than a write completes (one in flight)."""
        self.last_save = self.clock()
        if self.auto:
            self.interval = max(young_daly_seconds(stall_s, self.mtbf_hours), total_s)
