"""Optimizers, schedules and losses by import path (optim.name / optim.schedule / train.loss):
Adadelta + StepLR per epoch equal a hand-written torch loop bit for bit; at 2 ranks under ddp,
zero1, fsdp and deepspeed (when installed) the lr steps once per epoch and a resume from a
mid-run checkpoint (mid-epoch, and at an epoch's end) ends on the uninterrupted run's exact
weights; a user loss replaces only the training loss; bad paths and arguments are a
ConfigError (exit 2) naming key and value."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.cli import main
from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.optim import build_optimizer, build_scheduler
from hpctrain.parallel import unwrap
from hpctrain.train import build_components, fit, load_data, seed_everything
from hpctrain.weights.digest import params_sha256
from tests.dist_utils import train_cases
from tests.user_models import tiny_mlp

CPU = torch.device("cpu")
ADADELTA_STEPLR = ["optim.name=torch.optim:Adadelta", "optim.lr=1.0", "optim.kwargs.rho=0.8",
                   "optim.schedule=torch.optim.lr_scheduler:StepLR", "optim.schedule_kwargs.step_size=1",
                   "optim.schedule_kwargs.gamma=0.5", "optim.schedule_interval=epoch"]
# 256 samples, 16 a rank-batch: 16 steps an epoch at world 1, 8 at world 2
TINY = ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=256",
        "data.batch_size=16", "train.progress=false", "train.eval_each_epoch=false", "seed=4"]
CALLS: list[int] = []


def counted_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A user loss (train.loss=tests.test_optim_user:counted_cross_entropy)."""
    CALLS.append(int(target.shape[0]))
    return F.cross_entropy(output, target)


def per_sample_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="none")  # not a scalar: refused


def _fit(*keys: str) -> Any:
    cfg = load_config(None, [*TINY, *keys])
    env = ClusterEnv()
    parts = build_components(cfg, env, CPU, load_data(cfg, env, CPU, with_val=False))
    seed_everything(cfg.seed)
    fit(cfg, env, CPU, parts)
    return parts


def test_adadelta_and_steplr_per_epoch_equal_a_plain_torch_loop():
    parts = _fit(*ADADELTA_STEPLR, "train.epochs=3")
    cfg = load_config(None, [*TINY, "train.epochs=3"])
    loader = load_data(cfg, ClusterEnv(), CPU, with_val=False).train_loader  # the same order, batch by batch
    torch.manual_seed(cfg.seed)  # as the strategy builds the model
    model = tiny_mlp(10)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0, rho=0.8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:
            F.cross_entropy(model(batch.inputs), batch.targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    assert parts.counters.step == 48 and parts.optimizer.param_groups[0]["lr"] == 0.125
    ours = unwrap(parts.model).state_dict()
    assert all(torch.equal(ours[k], v) for k, v in model.state_dict().items())
    assert parts.optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


def test_step_interval_steps_the_user_schedule_every_optimizer_step():
    parts = _fit(*ADADELTA_STEPLR[:-1], "optim.schedule_kwargs.step_size=4", "train.max_steps=8")
    assert parts.optimizer.param_groups[0]["lr"] == 0.25  # 8 steps = 2 decays of 0.5


def test_user_loss_replaces_only_the_training_loss():
    CALLS.clear()
    with_user = _fit("train.loss=tests.test_optim_user:counted_cross_entropy", "train.max_steps=5")
    assert CALLS == [16] * 5
    plain = _fit("train.max_steps=5")  # the task's loss is F.cross_entropy too: the same weights
    assert params_sha256(unwrap(with_user.model)) == params_sha256(unwrap(plain.model))
    assert with_user.task.name == "classification"  # validation keeps the task's metrics


def test_a_user_loss_must_return_a_scalar():
    with pytest.raises(ConfigError, match=r"train.loss=tests.test_optim_user:per_sample_loss returned \(16,\), "
                                          "not a scalar tensor"):
        _fit("train.loss=tests.test_optim_user:per_sample_loss", "train.max_steps=1")


@pytest.mark.parametrize(("keys", "message"), [
    (["optim.name=no.such:Thing"], "optim.name='no.such:Thing': cannot import 'no.such'"),
    (["optim.name=torch.optim:NoSuch"], "optim.name='torch.optim:NoSuch': module 'torch.optim' has no 'NoSuch'"),
    (["optim.name=math:pi"], "optim.name='math:pi' is a float, not a torch.optim.Optimizer subclass"),
    (["optim.name=torch.nn:Linear"], "optim.name='torch.nn:Linear' is a class Linear, not a torch.optim.Optimizer"),
    (["optim.name=torch.optim:Adadelta", "optim.kwargs.rhoo=0.9"],
     "optim.kwargs.rhoo: optim.name=torch.optim:Adadelta takes no argument 'rhoo'; it accepts: lr, rho, eps"),
    (["optim.name=torch.optim:Adadelta", "optim.kwargs.rho=2.0"], "raised ValueError: Invalid rho value: 2.0"),
    (["optim.schedule=torch.optim.lr_scheduler:StepLR"],
     "optim.schedule=torch.optim.lr_scheduler:StepLR with optim.schedule_kwargs={}: missing a required argument: "
     "'step_size'; it accepts: step_size, gamma, last_epoch"),
    (["optim.schedule=torch.optim:SGD"], "optim.schedule='torch.optim:SGD' is a class SGD, not a torch.optim.lr_"),
    (["optim.schedule=torch.optim.lr_scheduler:ReduceLROnPlateau"], "ReduceLROnPlateau steps on a validation metric"),
])
def test_bad_optimizer_and_schedule_name_the_key(keys: list[str], message: str):
    cfg = load_config(None, keys).optim
    with pytest.raises(ConfigError) as err:
        build_scheduler(build_optimizer(nn.Linear(2, 2), cfg, 0.1), cfg, 10, lambda: False)
    assert message in str(err.value)


@pytest.mark.parametrize(("keys", "message"), [
    (["optim.name=Adadelta"], "optim.name='Adadelta' is neither one of sgd, adamw nor an import path"),
    (["optim.schedule=steplr"], "optim.schedule='steplr' is neither one of constant, cosine, step nor an import path"),
    (["optim.name=torch.optim:Adadelta", "optim.kwargs.lr=2"], "optim.kwargs.lr=2: the learning rate is optim.lr"),
    (["optim.kwargs.rho=0.9"], "optim.kwargs={'rho': 0.9} applies to an optimizer given by import path"),
    (["optim.schedule=torch.optim.lr_scheduler:StepLR", "optim.warmup_steps=5"],
     "optim.warmup_steps=5 cannot be combined with optim.schedule=torch.optim.lr_scheduler:StepLR"),
    (["optim.schedule_interval=epoch"], "apply to a schedule given by import path, not optim.schedule=cosine"),
    (["optim.kwargs=3"], "optim.kwargs=3 must be a mapping"),
    (["train.loss=cross_entropy"], "train.loss='cross_entropy' is not an import path package.module:NAME"),
])
def test_bad_config_values_fail_while_reading_the_config(keys: list[str], message: str):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, keys)
    assert message in str(err.value)


def test_bad_loss_path_exits_2_naming_key_and_value(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    code = main(["train", *TINY, "train.max_steps=1", f"run.dir={tmp_path / 'run'}", "train.loss=no.such:loss"])
    assert code == 2
    assert "train.loss='no.such:loss': cannot import 'no.such'" in capsys.readouterr().err
    code = main(["train", *TINY, "train.max_steps=1", f"run.dir={tmp_path / 'run'}", "train.loss=torch.nn:MSELoss"])
    assert code == 2
    assert "train.loss='torch.nn:MSELoss' is a class MSELoss, not a loss function" in capsys.readouterr().err


def test_config_with_import_paths_reads_without_torch():
    code = ("import sys; from hpctrain.config import load_config; "
            "load_config(None, ['optim.name=no.such:Opt', 'optim.schedule=no.such:Sched', 'train.loss=no.such:f']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------- 2 ranks: ddp, zero1, fsdp, resumed

# 128 samples: 4 steps an epoch at 2 ranks; StepLR halves the lr every 2nd epoch, so a resume that
# lost the schedule's own state (its epoch count; the lr itself comes back with the optimizer's
# param groups) would halve it at the wrong epoch. Checkpoints: mid-epoch 2 / end of epoch 1.
RESUMED = {"ddp": 6, "zero1": 4, "fsdp": 6}
if importlib.util.find_spec("deepspeed") is not None:  # find_spec: importing it here would pick its accelerator
    RESUMED["deepspeed"] = 6  # ZeRO-2 (parallel.deepspeed_stage's default), the engine stepping the schedule
DIST = [*TINY, *ADADELTA_STEPLR, "data.synthetic_size=128", "optim.schedule_kwargs.step_size=2", "train.epochs=4",
        "train.log_every=2", "train.threads=1", "checkpoint.every_steps=2", "checkpoint.keep_last=10",
        "checkpoint.every_seconds=off", "telemetry.straggler_every_steps=0"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("optim_user")
    cases = []
    for strategy, step in RESUMED.items():
        keys = [*DIST, f"parallel.strategy={strategy}"]
        cases += [(strategy, keys),
                  (f"{strategy}-resumed", [*keys, f"resume={root / strategy / 'checkpoints' / f'step-{step:09d}'}"])]
    return root, train_cases(2, cases, root, keep=("params_sha256", "steps"))[0]


@pytest.mark.parametrize("strategy", list(RESUMED))
def test_two_ranks_step_the_lr_per_epoch_and_resume_bit_for_bit(two_ranks: tuple[Path, dict[str, Any]],
                                                               strategy: str):
    root, summaries = two_ranks
    full, resumed = summaries[strategy], summaries[f"{strategy}-resumed"]
    assert isinstance(full, dict), full
    assert isinstance(resumed, dict), resumed
    assert full["steps"] == resumed["steps"] == 16
    assert resumed["params_sha256"] == full["params_sha256"]
    lrs = _logged_lrs(root / strategy)
    assert lrs == {2: 1.0, 4: 1.0, 6: 1.0, 8: 0.5, 10: 0.5, 12: 0.5, 14: 0.5, 16: 0.25}
    after = _logged_lrs(root / f"{strategy}-resumed")
    assert after == {s: lr for s, lr in lrs.items() if s > RESUMED[strategy]}


def _logged_lrs(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if "lr" in r}

