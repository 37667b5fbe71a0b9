"""Straggler detection on real gloo ranks: an injected sleep is named, a balanced run names none."""

from __future__ import annotations

import time

import pytest

from hpctrain.core.errors import UserError
from hpctrain.telemetry.stragglers import StragglerDetector
from tests.dist_utils import run_ranks


def _timed_intervals(env, slow_rank: int, balanced: int, slowed: int):
    """``balanced`` intervals on equal ranks, then ``slowed`` ones with ``slow_rank`` 3x slower."""
    detector = StragglerDetector(threshold=1.25)
    reports = []
    for interval in range(balanced + slowed):
        t0 = time.perf_counter()
        time.sleep(0.01)  # "data"
        t1 = time.perf_counter()
        slow = env.rank == slow_rank and interval >= balanced
        time.sleep(0.3 if slow else 0.1)  # "compute": sleeps, so CPU load barely matters
        t2 = time.perf_counter()
        reports.append(detector.gather(interval, t2 - t0, t1 - t0, t2 - t1))
    return [(r.stragglers, r.imbalance, [(s.rank, s.node, s.relative, s.individual) for s in r.ranks])
            for r in reports]


def test_balanced_ranks_name_none_then_a_slowed_rank_is_named():
    results = run_ranks(3, _timed_intervals, 1, 2, 2)
    assert all(res == results[0] for res in results)  # every rank gets the same report
    balanced, slowed = results[0][:2], results[0][2:]
    for stragglers, imbalance, ranks in balanced:
        assert stragglers == [] and imbalance < 1.25
        assert all(node for _, node, _, _ in ranks)
    for stragglers, imbalance, ranks in slowed:
        assert stragglers == [1]
        assert imbalance > 2.0
        relative = {rank: rel for rank, _, rel, _ in ranks}
        individual = {rank: ind for rank, _, _, ind in ranks}
        assert max(relative.values()) == 1.0 and relative[1] < 0.5
        assert individual[1] < 0.5 and individual[0] > 0.7  # rank 1 is slower than its own best


def test_single_process_and_bad_threshold():
    report = StragglerDetector().gather(5, 0.2, 0.05, 0.1)
    assert report.stragglers == [] and report.imbalance == 1.0 and report.ranks[0].relative == 1.0
    row = report.to_row()
    assert row["kind"] == "straggler" and row["ranks"][0]["work_s"] == pytest.approx(0.15)
    assert "straggler/rank0/relative" in report.scalars()
    with pytest.raises(UserError, match="straggler_threshold"):
        StragglerDetector(threshold=0.5)
