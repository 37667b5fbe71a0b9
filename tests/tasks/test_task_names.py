"""train.task's names live in the config (core, no task imported); the classes in the tasks' registry."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpctrain.config import ConfigError
from hpctrain.config.train import TASK_NAMES, TrainConfig
from hpctrain.tasks import registry


def test_the_config_knows_every_built_in_task_by_name() -> None:
    assert set(registry.task_names()) <= set(TASK_NAMES)
    assert TrainConfig(task="multilabel").task == "multilabel"
    with pytest.raises(ConfigError, match=r"train.task='nope' is not allowed; choose one of: auto, classification"):
        TrainConfig(task="nope")


def test_a_registered_task_passes_the_config_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_TASKS", dict(registry._TASKS))
    monkeypatch.setattr("hpctrain.config.train.TASK_NAMES", list(TASK_NAMES))
    registry.register_task("my_task", "mypkg.tasks:MyTask")
    assert TrainConfig(task="my_task").task == "my_task"


def test_checking_the_task_name_imports_no_task() -> None:
    code = ("import sys; from hpctrain.config.train import TrainConfig; TrainConfig(task='regression'); "
            "print(sorted(m for m in sys.modules if m.startswith('hpctrain.tasks') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip() == "[]"
