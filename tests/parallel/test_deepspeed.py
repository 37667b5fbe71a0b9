"""DeepSpeed ZeRO 1-3 on real gloo ranks (CPU accelerator) vs one process: 10-step losses within
1e-5, step-0 gradients within 1e-6; without DeepSpeed, a UserError with the install hint.

DeepSpeed JIT-builds C++ ops on first use (~60 s alone, ~3 min on 2 busy cores); TORCH_EXTENSIONS_DIR keeps them in
~/.cache/hpctrain/torch_extensions so later runs (and CI with that cache) take seconds."""

from __future__ import annotations

import importlib.util

import pytest

from tests.dist_utils import run_ranks
from tests.sharding_models import max_diff, train_toy

# find_spec, not importorskip: importing DeepSpeed here would pick its accelerator in the test process.
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="the deepspeed extra is not installed"),
              pytest.mark.slow]  # ~10 s for the three stages with built ops; the very first run builds them (~3 min)


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_ranks(1, train_toy, {})[0]


@pytest.fixture(scope="module")
def stages() -> dict[int, list[dict]]:
    """Every stage on one forked pair of ranks, in turn: DeepSpeed is imported once per rank
    (~5 s of CPU each), not once per stage."""
    from tests.sharding_models import train_deepspeed_stages

    ranks = run_ranks(2, train_deepspeed_stages, (1, 2, 3), timeout=300)
    return {stage: [rank[stage] for rank in ranks] for stage in (1, 2, 3)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_matches_one_process(reference: dict, stages: dict[int, list[dict]], stage: int) -> None:
    for rank in stages[stage]:
        assert max(abs(a - b) for a, b in zip(rank["losses"], reference["losses"])) <= 1e-5
        assert max_diff(rank["grads0"], reference["grads0"]) <= 1e-6
    assert reference["losses"][-1] < reference["losses"][0]
