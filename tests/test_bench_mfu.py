"""``hpctrain bench mfu`` and ``precision=fp8`` on a CPU: the plumbing, the arithmetic and the refusals.

No GPU here: the GPU paths (torchtitan's Trainer, fp8 through torchao) are checked as far as
they go without one. torchtitan's Trainer runs in a child process with two test-only stand-ins
(:func:`_titan_on_cpu`): its device helpers pointed at the CPU (they fall back to ``torch.cuda``),
and ``triton``, which CPU builds of torch lack, stubbed for the one torchtitan module that imports
it at import time (an expert-parallel kernel file the Llama never runs). Everything else in that
run is torchtitan's: its Trainer, model, FSDP2, optimizer, loss and metrics.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.cli import main
from hpctrain.cli.bench import find_bench_dir
from hpctrain.config import ConfigError, load_config
from hpctrain.core.errors import UserError
from hpctrain.models.llama import Llama, LlamaShape
from hpctrain.precision import Precision, fp8_eligible
from tests import test_bench
from tests.test_bench import _bench, in_process  # noqa: F401 - the fixture, by name

sys.path.insert(0, str(find_bench_dir()))  # the cases: the checkout's benchmarks/bench/, outside the package
from bench import mfu  # noqa: E402
from bench.mfu_data import TokenWindows, WindowSpec  # noqa: E402

TINY = LlamaShape(vocab=256, seq_len=128, n_layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=256)


def test_quick_writes_both_rows_and_names_what_it_skipped(tmp_path, capsys, monkeypatch, in_process):  # noqa: F811
    monkeypatch.setitem(test_bench.ROW_KEYS, "mfu", {"trainer", "precision", "status", "tokens_per_s", "peak_mem_gb",
                                                     "loss", "mfu", "speedup"})
    doc, printed = _bench("mfu", tmp_path, capsys)
    rows = {(r["trainer"], r["precision"]): r for r in doc["rows"]}
    assert list(rows) == [("hpctrain", "bf16"), ("torchtitan", "bf16"), ("hpctrain", "fp8")]
    hp = rows["hpctrain", "bf16"]
    assert hp["status"] == "ran" and hp["tokens_per_s"] > 0 and hp["speedup"] == 1.0 and hp["peak_mem_gb"] > 0
    steps = mfu.QUICK.steps
    assert [s for s, _ in hp["losses"]] == list(range(steps.warmup, steps.total + 1, steps.warmup))
    assert hp["mfu"] is None and "MFU n/a on a CPU" in printed  # no datasheet peak for a CPU
    titan, fp8 = rows["torchtitan", "bf16"], rows["hpctrain", "fp8"]
    why = "needs a GPU" if importlib.util.find_spec("torchtitan") else "torchtitan is not installed; hint: pip install"
    assert titan["status"] == "skipped" and why in titan["reason"]
    assert fp8["status"] == "skipped" and "compute capability 9.0" in fp8["reason"]
    assert "hint: precision=bf16" in fp8["reason"]
    assert doc["summary"]["hpctrain_vs_torchtitan"] is None and doc["summary"]["fp8_loss_parity"] is None
    assert doc["settings"]["params"] == mfu.QUICK.shape.params and len(in_process) == 1  # one hpctrain run


def test_mfu_is_estimator_flops_over_the_peak():
    # 6 x 139,584 parameters + 12 x 2 layers x 64 wide x 128 positions = 1,034,112 FLOPs per token
    assert TINY.params == 139_584 and mfu.flops_per_token(TINY) == 1_034_112
    assert mfu.mfu(1000.0, TINY, 1_034_112_000.0) == pytest.approx(1.0)
    assert mfu.mfu(500.0, TINY, 1_034_112_000.0) == pytest.approx(0.5)
    assert mfu.mfu(1000.0, TINY, None) is None
    assert mfu.GPU.shape.params == 1_235_814_400  # Llama 3.2 1B's published count
    assert mfu.gpu_peak_flops(torch.device("cpu"))[0] is None


def test_fp8_loss_parity_compares_the_same_steps():
    bf16 = [(2, 5.0), (4, 4.0), (6, 3.0)]
    assert mfu.loss_rel_diff(bf16, [(2, 5.0), (4, 4.0), (6, 3.0)]) == 0.0
    assert mfu.loss_rel_diff(bf16, [(4, 4.4), (6, 3.3), (8, 1.0)]) == pytest.approx(0.1)  # steps 4 and 6 only
    assert mfu.loss_rel_diff(bf16, []) is None


def test_windows_are_the_same_for_both_trainers_and_learnable():
    spec = WindowSpec(vocab=256, seq_len=32, samples=8)
    a, b = TokenWindows(spec), TokenWindows(spec)
    assert torch.equal(a.batch(2, 3), torch.stack([b[2], b[3], b[4]])) and a[0].shape == (33,)
    follows = (a.cycle.argsort()[a[0][1:]] - a.cycle.argsort()[a[0][:-1]]) % 256 == 1  # one step along the cycle
    assert follows.float().mean() > 0.7  # mostly the bigram the model can learn; a tenth of tokens are noise


def test_fp8_on_cpu_exits_2_naming_the_device_and_the_hint(tmp_path, capsys):
    code = main(["train", "model.name=llama", "model.n_layers=1", "data.name=bench.mfu_data:windows",
                 f"data.path={_spec(tmp_path)}", "data.batch_size=4", "precision=fp8", f"run.dir={tmp_path / 'run'}",
                 "train.max_steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "precision=fp8 needs an NVIDIA GPU of compute capability 9.0 or newer" in err
    assert "this run's device is cpu (no CUDA GPU); hint: precision=bf16" in err
    assert not (tmp_path / "run").exists()  # a refused start leaves nothing behind
    with pytest.raises(UserError, match="compute capability 9.0"):
        Precision("fp8", torch.device("cpu"))


def _spec(tmp_path: Path) -> Path:
    from bench.mfu_data import write_spec

    return write_spec(tmp_path / "windows.json", WindowSpec(vocab=256, seq_len=128, samples=8))


@pytest.mark.parametrize(("override", "message"), [
    ("parallel.tp=2", "precision=fp8 with parallel.tp=2 is not supported yet"),
])
def test_fp8_refuses_what_it_does_not_convert(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["precision=fp8", override])
    assert load_config(None, ["precision=fp8"]).precision == "fp8"


def test_fp8_swaps_the_eligible_linears_and_keeps_the_state_dict():
    float8 = pytest.importorskip("torchao.float8", reason="precision=fp8 trains through torchao (the mfu extra)")
    model = Llama(LlamaShape(vocab=256, seq_len=16, n_layers=2, hidden=32, heads=2, ffn_hidden=48, tie_weights=False))
    model.blocks[0].mlp.down = nn.Linear(48, 24, bias=False)  # 24 is no multiple of 16: torch._scaled_mm refuses it
    keys = list(model.state_dict())
    converted = Precision("bf16", torch.device("cpu")).convert(model)
    assert converted is model  # bf16 leaves the model alone
    from hpctrain.precision import to_float8

    to_float8(model)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds.pop("head") == "Linear" and kinds.pop("blocks.0.mlp.down") == "Linear"
    assert set(kinds.values()) == {float8.float8_linear.Float8Linear.__name__} and len(kinds) == 13
    assert list(model.state_dict()) == keys  # checkpoints and export see the same tensors
    assert not fp8_eligible(nn.Conv1d(16, 16, 1), "conv")


@pytest.fixture(scope="module")
def titan_run(tmp_path_factory) -> dict:
    """torchtitan's Trainer on the tiny shape, on a CPU, in a child process (see the module's docstring)."""
    pytest.importorskip("torchtitan", reason="the torchtitan row needs torchtitan (the mfu extra)")
    out = tmp_path_factory.mktemp("titan")
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29_500 + os.getpid() % 1000)}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow  # a child that imports torchtitan (datasets, wandb, tensorboard...): ~20 s of CPU
def test_torchtitan_trains_the_same_shape_through_its_own_trainer(titan_run):
    assert titan_run["params"] == TINY.params  # torchtitan's Llama3Model of the bench's shape = hpctrain's llama
    steps = [s for s, _ in titan_run["losses"]]
    assert steps == [1, 2, 4, 6] and titan_run["tokens_per_s"] > 0  # logged as hpctrain logs: every warmup steps
    losses = [loss for _, loss in titan_run["losses"]]
    assert losses[-1] < losses[0]  # it trained on the windows


def _titan_on_cpu(out: Path) -> None:
    """The child of :func:`titan_run`: the stand-ins, then the bench's own torchtitan run."""
    import types
    from unittest import mock

    import torch._functorch.partitioners  # noqa: F401 - torch's own triton checks run before the stub exists
    import torch._inductor.codecache  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401

    sys.modules["triton"] = stub = mock.MagicMock()
    sys.modules["triton.language"] = stub.language
    import torchtitan.distributed.minimal_async_ep.kernels  # noqa: F401 - the one module that imports triton

    del sys.modules["triton"], sys.modules["triton.language"]
    import torchtitan.models.llama3  # noqa: F401
    import torchtitan.trainer  # noqa: F401

    cpu = types.SimpleNamespace(
        get_device_name=lambda *a: "cpu", current_device=lambda: 0, device_count=lambda: 1, is_available=lambda: True,
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=16 << 30), memory_stats=lambda *a: {},
        reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None, set_device=lambda *a: None,
        synchronize=lambda *a: None)
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if name.startswith("torchtitan") and getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu
    from bench.mfu_data import write_spec
    from bench.mfu_titan import TitanSettings, measure, trainer_config

    spec = write_spec(out / "windows.json", WindowSpec(vocab=TINY.vocab, seq_len=TINY.seq_len, samples=64))
    s = TitanSettings(spec=str(spec), layers=TINY.n_layers, hidden=TINY.hidden, heads=TINY.heads, kv_heads=TINY.kv,
                      ffn_hidden=TINY.ffn, tie_weights=TINY.tie_weights, batch=4, warmup=2, measured=4, lr=3e-3,
                      compile=False)
    trainer = trainer_config(s, out / "dump").build()
    result = measure(trainer, s)
    result["params"] = sum(p.numel() for p in trainer.model_parts[0].parameters())
    trainer.close()
    (out / "result.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _titan_on_cpu(Path(sys.argv[1]))
