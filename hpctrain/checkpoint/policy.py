"""When to save: every N steps, every T seconds (or the Young-Daly interval), at the end.

The step schedule is the same on every rank by construction. The wall-clock one is not
(clocks and speeds differ), so the trainer folds "my timer is due" into the same small
all-reduce that agrees on preemption signals (see preempt.py).
"""

from __future__ import annotations

import math
import time
from typing import Any

# Before the first save is measured, assume this write speed to estimate its cost.
_ASSUMED_BYTES_PER_S = 500e6


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
