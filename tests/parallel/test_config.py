"""parallel.* validation: bad degrees and combinations fail before start, naming the numbers."""

from __future__ import annotations

import sys

import pytest

from hpctrain.config import load_config
from hpctrain.config.parallel import ParallelConfig, check_topology
from hpctrain.core.errors import UserError
from hpctrain.core.section import ConfigError


def test_world_must_equal_dp_x_tp_x_pp():
    with pytest.raises(ConfigError, match=r"parallel\.dp \(3 -> 3\) x parallel\.tp \(2\) x parallel\.pp \(1\) = 6 "
                                          r"!= world size 4"):
        check_topology(ParallelConfig(strategy="fsdp", dp=3, tp=2), 4)
    with pytest.raises(ConfigError, match=r"= 4 != world size 6"):
        check_topology(ParallelConfig(strategy="fsdp", tp=4), 6)  # auto dp = 6 // 4 = 1


def test_auto_dp_fills_the_world():
    topo = check_topology(ParallelConfig(strategy="fsdp", tp=2, pp=2), 8)
    assert (topo.dp, topo.tp, topo.pp) == (2, 2, 2)
    hsdp = check_topology(ParallelConfig(strategy="hsdp"), 8, num_nodes=2)
    assert (hsdp.dp_replicate, hsdp.dp_shard) == (2, 4)


def test_1f1b_needs_at_least_as_many_microbatches_as_stages():
    with pytest.raises(ConfigError, match=r"parallel\.microbatches \(2\) < pipeline stages parallel\.pp \(4\)"):
        check_topology(ParallelConfig(pp=4, microbatches=2, pp_schedule="1f1b"), 4)
    check_topology(ParallelConfig(pp=4, microbatches=2, pp_schedule="gpipe"), 4)  # GPipe fills it anyway


def test_interleaved_microbatches_in_whole_rounds():
    with pytest.raises(ConfigError, match=r"parallel\.microbatches \(5\) .* 2 rounds of parallel\.pp \(2\)"):
        check_topology(ParallelConfig(pp=2, microbatches=5, pp_schedule="interleaved_1f1b"), 2)


@pytest.mark.parametrize("kwargs, text", [
    ({"strategy": "zero1", "tp": 2}, "strategy=zero1 does not combine with tp=2"),
    ({"strategy": "deepspeed", "pp": 2}, "strategy=deepspeed does not combine with tp=1 / pp=2"),
    ({"strategy": "ddp", "meta_init": True}, "meta_init=true needs parallel.strategy=fsdp or hsdp"),
    ({"strategy": "fsdp", "dp_replicate": 2}, "dp_replicate=2 applies to strategy=hsdp only"),
    ({"sequence_parallel": True}, "sequence_parallel=true needs parallel.tp > 1"),
    ({"deepspeed_stage": 4}, "deepspeed_stage=4 must be 1, 2 or 3"),
    ({"microbatches": 0}, "microbatches=0 must be > 0"),
])
def test_bad_combinations_are_named(kwargs, text):
    with pytest.raises(ConfigError, match=text.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(**kwargs)


def test_ddp_with_dp_and_tp_is_refused_with_a_hint():
    with pytest.raises(ConfigError, match=r"strategy=ddp with dp=2 x tp=2 x pp=1 is not supported; hint: .*fsdp"):
        check_topology(ParallelConfig(tp=2), 4)


def test_hsdp_replicas_must_divide_dp():
    with pytest.raises(ConfigError, match=r"dp_replicate \(3\) must divide dp \(4\)"):
        check_topology(ParallelConfig(strategy="hsdp", dp_replicate=3), 4)


def test_keys_load_from_the_command_line():
    cfg = load_config(None, ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.reshard_after_forward=false",
                             "parallel.pp_schedule=interleaved_1f1b", "parallel.activation_checkpointing=selective"])
    assert (cfg.parallel.strategy, cfg.parallel.tp, cfg.parallel.reshard_after_forward) == ("fsdp", 2, False)
    with pytest.raises(UserError, match="strategy"):
        load_config(None, ["parallel.strategy=zero4"])


def test_deepspeed_missing_is_a_user_error_with_the_install_hint(monkeypatch):
    from hpctrain.parallel import deepspeed as ds

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # import_deepspeed sets these when unset: keep them test-local
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ds.extensions_cache()))
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what `import deepspeed` sees when it is absent
    with pytest.raises(ds.DeepSpeedMissing, match=r"pip install .*hpctrain\[deepspeed\]") as err:
        ds.import_deepspeed()
    assert err.value.exit_code == 2


def test_the_config_accepts_exactly_the_registered_strategies() -> None:
    """parallel.strategy is checked against a name list that imports no strategy module; it must
    stay the registry's, also after a registration (a user's own strategy)."""
    from hpctrain.config.parallel import STRATEGY_NAMES
    from hpctrain.parallel import registry

    assert set(STRATEGY_NAMES) == set(registry.strategy_names())
    registry.register_strategy("mine", "hpctrain.parallel.ddp:DDP")
    try:
        assert ParallelConfig(strategy="mine").strategy == "mine"
        assert registry.strategy_class("mine").name == "ddp"
    finally:
        del registry._USER["mine"]
        STRATEGY_NAMES.remove("mine")
    with pytest.raises(ConfigError, match="choose one of: ddp, zero1, fsdp, hsdp, deepspeed"):
        ParallelConfig(strategy="mine")
