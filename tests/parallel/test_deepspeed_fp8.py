"""precision=fp8 with DeepSpeed is the strategy's refusal (its check), not the config's: the
config layer names no strategy. Same message, same exit code (a ConfigError: 2), before any
process group; DeepSpeed need not be installed to be refused."""

from __future__ import annotations

import pytest

from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.planning.layout import make_layout

MESSAGE = ("precision=fp8 is not available with parallel.strategy=deepspeed (its engine sets its own precision); "
           "hint: parallel.strategy=fsdp, or precision=bf16")


def test_the_deepspeed_strategy_refuses_fp8_before_the_process_group() -> None:
    cfg = load_config(None, ["precision=fp8", "parallel.strategy=deepspeed"])  # the config alone names no strategy
    with pytest.raises(ConfigError) as refused:
        make_layout(cfg, ClusterEnv())
    assert str(refused.value) == MESSAGE and refused.value.exit_code == 2
