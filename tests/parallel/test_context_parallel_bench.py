"""Issue 28, point 5: ``hpctrain bench long-context`` (benchmarks/bench/long_context.py) states a
memory budget per rank that its sequence does not fit at cp1 and fits at cp4, by the estimator
(state + activations with cp); the measured run is in docs/benchmarks.md (a run takes ~35 s: not
repeated here). No runs: arithmetic only."""

from __future__ import annotations

import sys

import pytest

from hpctrain.cli.bench import CASES, find_bench_dir
from hpctrain.models.llama import LlamaShape

sys.path.insert(0, str(find_bench_dir()))
from bench.context import Context  # noqa: E402
from bench.long_context import CPS, Size, _predicted_mb  # noqa: E402


@pytest.mark.parametrize("quick", [True, False])
def test_the_budget_is_too_small_for_one_rank_and_enough_for_four(quick: bool, tmp_path) -> None:
    size = Size.of(Context(quick=quick, work=tmp_path, procs=None, repeats=None))
    shape = LlamaShape(vocab=256, seq_len=size.seq_len, n_layers=size.layers, hidden=size.hidden, heads=size.heads,
                       kv_heads=size.kv_heads)
    state_mb = shape.params * 16 / 1e6  # fp32 weights, gradients, AdamW's two moments
    totals = {cp: state_mb + _predicted_mb(size, cp) for cp in CPS}
    assert totals[1] > size.budget_mb >= totals[4]
    assert totals[1] > totals[2] > totals[4]  # activations fall with cp
    assert size.seq_len % (2 * max(CPS)) == 0
    assert "long-context" in CASES
