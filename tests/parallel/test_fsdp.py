"""FSDP2 (ZeRO-3 / ZeRO-2), HSDP, ZeRO-1 and DDP on real gloo ranks vs one process with the
global batch: 10-step losses within 1e-5, step-0 gradients within 1e-6; FSDP's per-rank
bytes are ~1/N of DDP's; meta-device init equals a one-process init bitwise."""

from __future__ import annotations

import functools

import pytest

from tests.dist_utils import run_ranks
from tests.sharding_models import MODELS, max_diff, train_toy


@functools.lru_cache(maxsize=None)
def _reference(steps: int = 10) -> dict:
    return run_ranks(1, train_toy, {}, steps)[0]


def _check_parity(result: dict, loss_tol: float = 1e-5, grad_tol: float = 1e-6) -> None:
    ref = _reference()
    assert len(result["losses"]) == len(ref["losses"]) == 10
    assert max(abs(a - b) for a, b in zip(result["losses"], ref["losses"])) <= loss_tol
    assert max_diff(result["grads0"], ref["grads0"]) <= grad_tol
    assert ref["losses"][-1] < ref["losses"][0]  # it really trained


@pytest.mark.parametrize("options", [{"reshard_after_forward": True}, {"reshard_after_forward": False},
                                     {"cpu_offload": True, "meta_init": True}], ids=["zero3", "zero2", "offload"])
def test_fsdp_matches_one_process(options):
    ranks = run_ranks(2, train_toy, {"strategy": "fsdp", **options})
    for result in ranks:
        _check_parity(result)


def test_fsdp_bf16_params_fp32_reduce_runs_close_to_one_process():
    """MixedPrecisionPolicy(bf16 params, fp32 reduce): bf16 rounding only (~1e-3 on the loss)."""
    result = run_ranks(2, train_toy, {"strategy": "fsdp", "param_dtype": "bf16"}, 3)[0]
    diffs = [abs(a - b) for a, b in zip(result["losses"], _reference()["losses"])]
    assert 0 < max(diffs) <= 5e-3  # > 0: the bf16 policy really applied


def test_zero1_matches_one_process_and_shards_optimizer_state():
    ranks = run_ranks(2, train_toy, {"strategy": "zero1"})
    _check_parity(ranks[0])
    full = _reference()["bytes"]["optimizer"]
    shards = [r["bytes"]["optimizer"] for r in ranks]
    assert sum(shards) == full and max(shards) < full  # each rank holds its share only


def test_hsdp_on_a_2x2_mesh_matches_one_process():
    ranks = run_ranks(4, train_toy, {"strategy": "hsdp", "dp_replicate": 2})
    _check_parity(ranks[0])


def test_fsdp_per_rank_bytes_are_half_of_ddp():
    ddp = run_ranks(2, train_toy, {"strategy": "ddp"}, 1)[0]["bytes"]
    fsdp = run_ranks(2, train_toy, {"strategy": "fsdp"}, 1)
    total_ddp = sum(ddp.values())
    # Allowance: FSDP2 pads each parameter's dim 0 to a multiple of N, and AdamW's `step`
    # counter (one 4-byte scalar per parameter) is not sharded.
    n_params = 4 * 16 + 5
    allowance = n_params * 4 + 2 * 4 * (4 * 256)
    for rank in fsdp:
        total = sum(rank["bytes"].values())
        assert total <= total_ddp / 2 * 1.10 + allowance, (total, total_ddp)
        assert total >= total_ddp / 2 * 0.90 - allowance
    print(f"per-rank bytes at world 2: ddp {ddp}, fsdp {[r['bytes'] for r in fsdp]}")
    _check_estimate(ddp, "ddp")
    for rank in fsdp:
        _check_estimate(rank["bytes"], "zero3")


def _check_estimate(measured: dict, strategy: str) -> None:
    """`hpctrain estimate`'s per-rank prediction (fp32 AdamW: 4 + 4 + 8 bytes per parameter,
    divided as the strategy divides them) agrees with what the rank really holds, within 15%
    for each of parameters, gradients and optimizer state (issue 11's check against a real
    DDP / FSDP run; activations are compared on a GPU in tests/estimate/test_estimate.py)."""
    from hpctrain.estimate import predict_rank_bytes

    predicted = predict_rank_bytes(MODELS["toy"](4), strategy, 2, precision="fp32")
    for key, value in (("params", predicted.weights), ("grads", predicted.grads), ("optimizer", predicted.optimizer)):
        assert abs(value - measured[key]) <= 0.15 * measured[key], (strategy, key, value, measured[key])


def test_meta_init_equals_one_process_init_bitwise():
    ranks = run_ranks(2, train_toy, {"strategy": "fsdp", "meta_init": True}, 0)
    reference = run_ranks(1, train_toy, {}, 0)[0]
    assert max_diff(ranks[0]["weights"], reference["weights"]) == 0.0
    assert max_diff(ranks[1]["weights"], reference["weights"]) == 0.0


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_fsdp_with_activation_checkpointing_matches_one_process(mode):
    _check_parity(run_ranks(2, train_toy, {"strategy": "fsdp", "activation_checkpointing": mode})[0])


def test_fsdp_accumulation_without_sync_matches_one_process():
    """2 micro-batches per rank through the strategy's no_sync(), which by default reduce-scatters
    both (parallel.reduce_every_microstep; the skipping variant equals it: test_fsdp_accum_grads.py)."""
    _check_parity(run_ranks(2, train_toy, {"strategy": "fsdp"}, 10, 4, 1e-2, 0.0, "toy", 2)[0])


def test_sharded_grad_scaler_steps_together_and_skips_together():
    from tests.sharding_models import scaler_step

    fine = run_ranks(2, scaler_step, None)
    assert all(r["changed"] for r in fine) and fine[0]["scale"][1] == fine[0]["scale"][0]
    assert max_diff(fine[0]["weights"], fine[1]["weights"]) == 0.0
    overflow = run_ranks(2, scaler_step, 1)  # only rank 1's shard overflows
    for rank in overflow:
        assert not rank["changed"]  # both ranks skipped the step
        assert rank["scale"][1] == rank["scale"][0] / 2


@pytest.mark.slow  # torch.compile: ~40 s per process on a cold inductor cache, ~17 s warm
def test_compile_with_checkpointing_under_fsdp_matches_one_process():
    """The documented order TP -> checkpointing -> compile (per block) -> FSDP, on real ranks."""
    from tests.sharding_models import compiled_grads

    grads = run_ranks(2, compiled_grads, {"strategy": "fsdp", "activation_checkpointing": "block"}, timeout=300)
    assert max_diff(grads[0], _reference()["grads0"]) <= 1e-6
