"""Which rank is slow: per-rank times gathered in one small collective, then scored.

Every rank passes its own mean seconds per step over the last interval: the whole step,
the wait for data, and the compute it owns. In synchronous data parallel training every
rank waits for the slowest one inside the gradient all-reduce, so whole step times look
alike; ranks are therefore scored on their *own work* = data wait + compute, where compute
should exclude waiting for other ranks (time the forward pass, or forward + backward of the
micro-steps that do not synchronise).

- imbalance = slowest work / median work (1.0 = balanced);
- relative score per rank = fastest rank's work / this rank's work (best rank = 1.0);
- individual score per rank = its own best work so far / its work now (1.0 = as fast as
  it has ever been; a rank that slows down over time drops below 1 even when all do);
- stragglers: ranks whose work exceeds ``threshold`` x the median, slowest first.
"""

from __future__ import annotations

import logging
import socket
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.core.env import collective_device
from hpctrain.core.errors import UserError

log = logging.getLogger("hpctrain")

FIELDS = ("step_s", "data_wait_s", "compute_s")
# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(frozen=True)
class RankScore:
    rank: int
    node: str
    step_s: float
    data_wait_s: float
    compute_s: float
    relative: float
    individual: float

    @property
    def work_s(self) -> float:
        return self.data_wait_s + self.compute_s


@dataclass(frozen=True)
class StragglerReport:
    step: int
    imbalance: float
    threshold: float
    ranks: list[RankScore]
    stragglers: list[int] = field(default_factory=list)  # slowest first

    def to_row(self) -> dict[str, Any]:
        """The metrics.jsonl row (``kind: straggler``) that ``hpctrain report`` plots per rank."""
        return {"step": self.step, "kind": "straggler", "imbalance": self.imbalance,
                "stragglers": self.stragglers, "ranks": [{**vars(r), "work_s": r.work_s} for r in self.ranks]}

    def scalars(self) -> dict[str, float]:
        """Flat per-rank series for TensorBoard/MLflow/W&B: ``straggler/rank3/relative`` etc."""
        out = {"straggler/imbalance": self.imbalance}
        for r in self.ranks:
            out |= {f"straggler/rank{r.rank}/work_s": r.work_s, f"straggler/rank{r.rank}/step_s": r.step_s,
                    f"straggler/rank{r.rank}/relative": r.relative, f"straggler/rank{r.rank}/individual": r.individual}
        return out

    def message(self) -> str:
        median = statistics.median(r.work_s for r in self.ranks)
        named = ", ".join(f"rank {r.rank} on {r.node} ({r.work_s:.3f} s/step)"
                          for i in self.stragglers for r in self.ranks if r.rank == i)
        return (f"step {self.step}: stragglers {named}: slowest / median work = {self.imbalance:.2f} "
                f"(median {median:.3f} s/step, threshold {self.threshold:.2f})")


class StragglerDetector:
    """Create on every rank (it gathers the host names once); call :meth:`gather` on every
    rank at the same steps. Outside a process group it scores the one local rank."""

    def __init__(self, threshold: float = 1.2) -> None:
        if threshold < 1.0:
            raise UserError(f"telemetry.straggler_threshold={threshold} must be >= 1.0 (it compares slowest / median); "
                            "hint: 1.2 warns when a rank needs 20% longer than the median")
        self.threshold = threshold
        self.nodes = _gather_nodes()
        self._best: list[float] = [float("inf")] * len(self.nodes)

    def gather(self, step: int, step_s: float, data_wait_s: float, compute_s: float) -> StragglerReport:
        """One all-gather of three floats per rank; every rank gets the same report."""
        table = _gather_times([step_s, data_wait_s, compute_s])
        work = [max(d + c, 1e-12) for _, d, c in table]
        self._best = [min(b, w) for b, w in zip(self._best, work)]
        fastest, median = min(work), statistics.median(work)
        ranks = [RankScore(i, self.nodes[i], s, d, c, fastest / work[i], self._best[i] / work[i])
                 for i, (s, d, c) in enumerate(table)]
        slow = sorted((i for i, w in enumerate(work) if w > self.threshold * median), key=lambda i: -work[i])
        report = StragglerReport(step, max(work) / median, self.threshold, ranks, slow)
        if slow and _is_main():
            log.warning("%s", report.message())
        return report


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _gather_nodes() -> list[str]:
    host = socket.gethostname()
    if not dist.is_initialized():
        return [host]
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, host)  # once, at set-up: object collectives pickle
    return [str(n) for n in nodes]


def _gather_times(values: list[float]) -> list[tuple[float, float, float]]:
    local = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        local = local.to(collective_device())
        out = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=local.device)
        _ALL_GATHER(out, local)
        local = out.cpu()
    rows = local.view(-1, len(FIELDS)).tolist()
    return [(float(s), float(d), float(c)) for s, d, c in rows]


AUTO_INTERVAL_S = 60.0  # the default cadence: about one gather a minute


class StragglerSchedule:
    """At which optimizer steps every rank gathers (the same on every rank, without a
    collective of its own).

    ``every`` > 0: at multiples of ``every``. None (auto): first at ``first_step +
    first_after``, then every ``60 s / slowest step time`` steps, computed from the gathered
    report that every rank holds identically, so all ranks agree by construction. 0: never."""

    def __init__(self, every: int | None, first_step: int, first_after: int) -> None:
        self.every = every
        if every == 0:
            self.next: int | None = None
        elif every is None:
            self.next = first_step + max(1, first_after)
        else:
            self.next = (first_step // every + 1) * every

    def due(self, step: int) -> bool:
        return self.next is not None and step >= self.next

    def done(self, step: int, report: StragglerReport) -> None:
        if self.every:
            self.next = (step // self.every + 1) * self.every
            return
        slowest = max((r.step_s for r in report.ranks), default=0.0)
        self.next = step + max(1, round(AUTO_INTERVAL_S / slowest) if slowest > 0 else 1)
