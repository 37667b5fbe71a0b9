"""Tensor parallel (tp=2, dp2 x tp2, sequence parallel) and pipeline parallel (GPipe, 1F1B,
interleaved 1F1B; with accumulation) on real gloo ranks vs one process: losses within 1e-5,
step-0 gradients within 1e-6 (the issue asks 1e-5 for forward/backward)."""

from __future__ import annotations

import functools

import pytest

from tests.dist_utils import run_ranks
from tests.sharding_models import max_diff, train_pp, train_toy


@functools.lru_cache(maxsize=None)
def _reference(clip: float = 0.0) -> dict:
    return run_ranks(1, train_toy, {}, 10, 4, 1e-2, clip)[0]


def _check(result: dict, ref: dict, tol: float = 1e-5) -> None:
    assert len(result["losses"]) == 10
    assert max(abs(a - b) for a, b in zip(result["losses"], ref["losses"])) <= tol
    assert ref["losses"][-1] < ref["losses"][0]


def test_tp2_matches_one_process():
    ranks = run_ranks(2, train_toy, {"tp": 2})
    _check(ranks[0], _reference())
    assert max_diff(ranks[0]["grads0"], _reference()["grads0"]) <= 1e-6


def test_tp2_sequence_parallel_matches_one_process():
    ranks = run_ranks(2, train_toy, {"tp": 2, "sequence_parallel": True})
    _check(ranks[0], _reference())
    assert max_diff(ranks[0]["grads0"], _reference()["grads0"]) <= 1e-6


def test_dp2_x_tp2_with_clipping_matches_one_process():
    """2D mesh: TP on mesh['tp'], then FSDP on mesh['dp']; the clip helper's global norm spans
    DTensor gradients on two meshes (TP weights on (dp, tp), the rest on dp)."""
    ref = _reference(0.5)
    ranks = run_ranks(4, train_toy, {"strategy": "fsdp", "tp": 2}, 10, 4, 1e-2, 0.5)
    _check(ranks[0], ref)
    assert max_diff(ranks[0]["grads0"], ref["grads0"]) <= 1e-6
    assert max(abs(a - b) for a, b in zip(ranks[0]["norms"], ref["norms"])) <= 1e-5
    assert min(ref["norms"]) > 0.5  # the clip really acted


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_pp2_matches_one_process(schedule):
    ranks = run_ranks(2, train_pp, {"pp": 2, "pp_schedule": schedule, "microbatches": 4})
    ref = _reference()
    for rank in ranks:
        _check(rank, ref)
    grads = {**ranks[0]["grads0"], **ranks[1]["grads0"]}
    assert max_diff(grads, ref["grads0"]) <= 1e-6


def test_pp_accumulation_gives_the_same_gradients():
    whole = run_ranks(2, train_pp, {"pp": 2, "microbatches": 2}, 3, 1)
    accumulated = run_ranks(2, train_pp, {"pp": 2, "microbatches": 2}, 3, 2)
    for a, b in zip(whole, accumulated):
        assert max_diff(a["grads0"], b["grads0"]) <= 1e-6
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= 1e-5


def test_dp2_x_pp2_with_fsdp_stages_matches_one_process():
    """2D (pp, dp): each stage module sharded with FSDP over its dp pair; the schedule drives FSDP's
    gradient sync on the last micro-batch."""
    ranks = run_ranks(4, train_pp, {"strategy": "fsdp", "pp": 2, "microbatches": 2})
    ref = _reference()
    for rank in ranks:
        _check(rank, ref)
    grads = {**ranks[0]["grads0"], **ranks[3]["grads0"]}  # mesh (pp, dp, tp): ranks 0-1 stage 0, 2-3 stage 1
    assert max_diff(grads, ref["grads0"]) <= 1e-6


def test_pp2_x_tp2_matches_one_process():
    """TP inside each pipeline stage (mesh (pp, dp=1, tp))."""
    ranks = run_ranks(4, train_pp, {"pp": 2, "tp": 2, "microbatches": 2})
    ref = _reference()
    _check(ranks[3], ref)
    assert max_diff({**ranks[0]["grads0"], **ranks[3]["grads0"]}, ref["grads0"]) <= 1e-6


def test_3d_pp2_x_dp2_x_tp2_matches_one_process():
    """8 ranks, mesh (pp 2, dp 2, tp 2): TP in each stage, FSDP over dp, the pipeline across; 3 steps."""
    ref = run_ranks(1, train_toy, {}, 3)[0]
    ranks = run_ranks(8, train_pp, {"strategy": "fsdp", "pp": 2, "tp": 2, "microbatches": 2}, 3)
    assert max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref["losses"])) <= 1e-5
    grads = {name: grad for rank in ranks for name, grad in rank["grads0"].items()}
    assert max_diff(grads, ref["grads0"]) <= 1e-6
