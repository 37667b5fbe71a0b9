"""Precision, schedules, data sources, the launcher's torchrun command line, determinism."""

import gzip
import math
import struct

import numpy as np
import pytest
import torch

from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.data.mnist import FASHION_DIR, load_fashion_mnist, read_idx
from hpctrain.data.sources import load_dataset
from hpctrain.launch.local import torchrun_args
from hpctrain.optim import lr_factor, peak_lr
from hpctrain.parallel import unwrap
from hpctrain.precision import Precision
from hpctrain.train import build_components, fit, load_data, seed_everything
from hpctrain.weights.digest import params_sha256

CPU = torch.device("cpu")


def _run(*overrides: str):
    cfg = load_config(None, ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny",
                             "data.synthetic_size=512", "data.batch_size=16", "train.max_steps=8",
                             "train.progress=false", "train.eval_each_epoch=false", *overrides])
    env = ClusterEnv()
    parts = build_components(cfg, env, CPU, load_data(cfg, env, CPU, with_val=False))
    seed_everything(cfg.seed)
    fit(cfg, env, CPU, parts)
    return parts


def test_optim_lr_factor_warmup_cosine_step():
    cfg = load_config(None, ["optim.warmup_steps=4", "optim.schedule=cosine", "optim.min_lr_ratio=0.1"]).optim
    assert [lr_factor(s, cfg, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, cfg, 14) == 1.0
    assert math.isclose(lr_factor(9, cfg, 14), 0.1 + 0.9 * 0.5)
    assert math.isclose(lr_factor(14, cfg, 14), 0.1)
    step = load_config(None, ["optim.schedule=step", "optim.step_size=3", "optim.gamma=0.5"]).optim
    assert [lr_factor(s, step, 10) for s in (0, 2, 3, 6)] == [1.0, 1.0, 0.5, 0.25]


def test_linear_lr_scaling_by_global_batch():
    cfg = load_config(None, ["optim.scale_lr=linear", "optim.base_batch=64", "optim.lr=0.1"]).optim
    assert math.isclose(peak_lr(cfg, 256), 0.4)
    assert peak_lr(load_config(None, ["optim.lr=0.1"]).optim, 256) == 0.1


def test_scheduler_drives_the_optimizer_lr():
    parts = _run("optim.schedule=cosine", "optim.warmup_steps=2", "optim.lr=0.5")
    assert parts.scheduler is not None and parts.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_mixed_precision_trains(mode):
    parts = _run(f"precision={mode}", "optim.name=adamw", "optim.lr=0.01")
    assert (parts.precision.scaler is not None) == (mode == "fp16")
    with parts.precision.autocast():
        out = unwrap(parts.model)(torch.randn(2, 128))
    assert out.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    assert all(torch.isfinite(p).all() for p in parts.model.parameters())


def test_fp16_scaler_state_round_trips():
    prec = Precision("fp16", CPU)
    state = prec.state_dict()
    assert "scale" in state
    other = Precision("fp16", CPU)
    other.load_state_dict(state)
    assert other.state_dict()["scale"] == state["scale"]


def test_deterministic_runs_repeat_bit_for_bit():
    a = params_sha256(unwrap(_run("train.deterministic=true", "seed=5").model))
    b = params_sha256(unwrap(_run("train.deterministic=true", "seed=5").model))
    c = params_sha256(unwrap(_run("train.deterministic=true", "seed=6").model))
    torch.use_deterministic_algorithms(False)
    assert a == b != c


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_clip_grad_norm_limits_the_norm_the_optimizer_sees(precision):
    """Fails if clipping does nothing, or (fp16) clips the loss-scaled gradients before unscaling."""
    cfg = load_config(None, ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny",
                             "data.synthetic_size=512",
                             "data.batch_size=16", "train.max_steps=4", "train.progress=false",
                             "train.eval_each_epoch=false", "train.clip_grad_norm=0.01", f"precision={precision}"])
    env = ClusterEnv()
    parts = build_components(cfg, env, CPU, load_data(cfg, env, CPU, with_val=False))
    norms: list[float] = []
    parts.optimizer.register_step_pre_hook(lambda opt, args, kwargs: norms.append(_grad_norm(opt)))
    fit(cfg, env, CPU, parts)
    assert len(norms) == 4 and all(abs(n - 0.01) < 1e-5 for n in norms), norms


def _grad_norm(optimizer: torch.optim.Optimizer) -> float:
    grads = [p.grad.float() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def test_resume_mid_accumulation_keeps_whole_optimizer_steps():
    """A loader resumed at an odd micro-batch (another world size's step boundary): every optimizer
    step still takes exactly grad_accum micro-batches, each counted from the resume point."""
    cfg = load_config(None, ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny",
                             "data.synthetic_size=256",
                             "data.batch_size=16", "train.grad_accum=2", "train.progress=false",
                             "train.eval_each_epoch=false", "train.log_every=1000"])
    env = ClusterEnv()
    parts = build_components(cfg, env, CPU, load_data(cfg, env, CPU, with_val=False))
    parts.train_loader.load_state_dict({"epoch": 0, "batches_done": 3})  # 16 batches: 3 done, 13 left
    micro_batches: list[int] = []
    forwards = [0]

    def count_forward(*_: object) -> None:
        forwards[0] += 1

    def close_step(*_: object) -> None:
        micro_batches.append(forwards[0])
        forwards[0] = 0

    parts.model.register_forward_hook(count_forward)
    parts.optimizer.register_step_pre_hook(close_step)
    fit(cfg, env, CPU, parts)
    assert micro_batches == [2] * 6 and parts.counters.step == 6  # 13 = 6 whole steps + 1 dropped


def test_torchrun_command_line_carries_elastic_options():
    args = torchrun_args(4, ["train", "x.yaml"], max_restarts=3)
    assert "--nproc-per-node=4" in args and "--max-restarts=3" in args and "--standalone" in args
    assert args[-4:] == ["-m", "hpctrain", "train", "x.yaml"]
    multi = torchrun_args(2, ["train"], nnodes="2:4", rdzv_endpoint="n1:29400", rdzv_id="job7")
    assert "--standalone" not in multi and "--rdzv-endpoint=n1:29400" in multi and "--nnodes=2:4" in multi


def _write_idx(path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_idx_reader(tmp_path):
    images = np.arange(3 * 28 * 28).reshape(3, 28, 28) % 256
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([1, 2, 9]))
    assert (read_idx(tmp_path / "t10k-images-idx3-ubyte.gz") == images).all()
    data = load_fashion_mnist("val", str(tmp_path))
    assert data.inputs.shape == (3, 1, 28, 28) and data.targets.tolist() == [1, 2, 9]


@pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist():
    data = load_dataset("fashion_mnist", "test")
    assert len(data) == 10_000 and data.num_classes == 10


def test_real_mnist_splits():
    assert [len(load_dataset("mnist", s)) for s in ("train", "val", "test")] == [50_000, 10_000, 10_000]


def test_synthetic_cifar_is_deterministic_and_shaped():
    a, b = load_dataset("synthetic_cifar", "train", synthetic_size=64), load_dataset("synthetic_cifar", "train",
                                                                                       synthetic_size=64)
    assert a.inputs.shape == (64, 3, 32, 32) and torch.equal(a.inputs, b.inputs)


@pytest.mark.slow
def test_compile_is_opt_in_and_trains():
    from torch._dynamo.eval_frame import OptimizedModule

    assert not isinstance(_run("train.max_steps=1").model, OptimizedModule)
    parts = _run("train.compile=true", "train.max_steps=3")
    assert isinstance(parts.model, OptimizedModule) and parts.counters.step == 3
    assert isinstance(unwrap(parts.model), torch.nn.Sequential)


def test_best_metric_direction_and_unknown_name():
    from hpctrain.config import ConfigError
    from hpctrain.train import _improved

    row = {"step": 5, "val_loss": 0.3, "val_accuracy": 0.9}
    cfg = load_config(None, [])
    acc = "val_accuracy"
    assert _improved(cfg, acc, row, {}) and not _improved(cfg, acc, row, {"metric": acc, "value": 0.95})
    loss = "val_loss"  # best_mode=auto: lower is better for a loss
    assert _improved(cfg, loss, row, {"metric": loss, "value": 0.4})
    assert not _improved(cfg, loss, row, {"metric": loss, "value": 0.2})
    assert _improved(cfg, loss, row, {"metric": acc, "value": 0.1})  # another metric's record
    source = "val_loss/web"  # one source of a data.mix: still a loss, lower is better
    assert not _improved(cfg, source, {**row, source: 0.5}, {"metric": source, "value": 0.4})
    with pytest.raises(ConfigError, match="val_accuracy"):
        _improved(cfg, "val_f1", row, {})


def test_best_metric_auto_follows_the_task():
    from hpctrain.tasks import CausalLM, Classification
    from hpctrain.train import best_metric

    auto = load_config(None, [])
    assert (best_metric(auto, Classification()), best_metric(auto, CausalLM())) == ("val_accuracy", "val_loss")
    named = load_config(None, ["train.best_metric=val_perplexity"])
    assert best_metric(named, CausalLM()) == "val_perplexity"


def test_best_is_tracked_in_training():
    from hpctrain.telemetry.loop import Telemetry
    from hpctrain.train import Loop, _validate

    cfg = load_config(None, ["model.name=tests.user_models:tiny_mlp", "data.name=synthetic_tiny",
                             "data.synthetic_size=256", "train.progress=false", "train.best_metric=val_loss"])
    env = ClusterEnv()
    parts = build_components(cfg, env, CPU, load_data(cfg, env, CPU))
    loop = Loop(cfg, env, CPU, parts, Telemetry.build(cfg.telemetry, env, CPU, 0, batch=parts.layout))
    _validate(loop)
    result = loop.result
    assert result.best["metric"] == "val_loss" and result.best["value"] == result.last_eval.metrics["loss"]
    assert result.last_eval.metrics["count"] == 256 // 5


def test_a_failed_start_leaves_the_callers_signal_handlers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """train() installs its preemption handlers before set-up; a start that fails (here: a model
    with the wrong output shape) puts the caller's handlers back, so SIGTERM is not swallowed."""
    import signal

    from hpctrain.models import ModelError
    from hpctrain.train import train

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    with pytest.raises(ModelError):
        train(load_config(None, ["model.name=tests.user_models:three_classes", "data.name=synthetic_tiny",
                                 "data.synthetic_size=64", f"run.dir={tmp_path / 'run'}"]))
    assert {sig: signal.getsignal(sig) for sig in before} == before
