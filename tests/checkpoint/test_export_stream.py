"""The consolidated weights file written one tensor at a time (hpctrain.weights.export):
its .pt is torch.save's format byte for byte and loads with weights_only and mmap; its
.safetensors loads with the safetensors package and tensorfile; FSDP at world 2 writes the
same bytes as one process while no rank holds more than one gathered tensor; pipeline stages
send their tensors to rank 0; a DCP checkpoint exports to the model.pt of its step without
reading the optimizer; a write that fails on rank 0 fails every rank."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hpctrain.checkpoint import tensorfile
from hpctrain.cli import main as cli_main
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import PeerError, RunError, agree
from hpctrain.data.text import write_text_shards
from hpctrain.models.gpt import GPT, GPTShape
from hpctrain.parallel.state import dcp_source
from hpctrain.weights.digest import ParamsHash, param_names, params_sha256
from hpctrain.weights.export import (
    ExportError,
    ExportFormatError,
    LiveBytes,
    Source,
    TensorSpec,
    dict_source,
    model_source,
    pipeline_source,
    save_model,
    write_stream,
)
from tests.dist_utils import run_ranks, train_cases

SHAPE = GPTShape(vocab=256, seq_len=16, n_layers=2, hidden=36, heads=4)  # 36: FSDP pads uneven shards


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(SHAPE)


def _mixed() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(3, 4), "idx": torch.arange(5), "t": torch.randn(2, 3).t(),  # not contiguous
            "half": torch.randn(4, dtype=torch.bfloat16), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3),
            "mask": torch.tensor([True, False]), "view": torch.arange(10.0)[2:6]}  # storage larger than the view


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_pt_is_torch_save_byte_for_byte_and_loads(tmp_path: Path) -> None:
    state = _mixed()
    write_stream(tmp_path / "m.pt", dict_source(state))
    ref = io.BytesIO()
    torch.save({k: state[k].clone(memory_format=torch.contiguous_format) for k in sorted(state)}, ref)  # compact
    assert (tmp_path / "m.pt").read_bytes() == ref.getvalue()
    assert _equal(torch.load(tmp_path / "m.pt", weights_only=True), state)
    assert _equal(torch.load(tmp_path / "m.pt", weights_only=True, mmap=True), state)


def test_safetensors_loads_with_tensorfile_and_the_package(tmp_path: Path) -> None:
    state = _mixed()
    out = tmp_path / "m.safetensors"
    write_stream(out, dict_source(state))
    assert _equal(tensorfile.read(out), state)
    safetensors = pytest.importorskip("safetensors.torch")
    assert _equal(safetensors.load_file(out), state)


def test_write_checks_shapes_and_suffix(tmp_path: Path) -> None:
    spec = TensorSpec("a", torch.float32, (2,))
    wrong = Source([spec], iter([torch.zeros(3)]), LiveBytes())
    with pytest.raises(ExportError, match="'a': expected torch.float32 \\[2\\], got torch.float32 \\[3\\]"):
        write_stream(tmp_path / "m.pt", wrong)
    assert not list(tmp_path.iterdir())  # nothing half-written is left
    with pytest.raises(ExportFormatError, match="must end in .pt or .safetensors"):
        write_stream(tmp_path / "m.bin", dict_source({"a": torch.zeros(2)}))


def test_params_hash_streams_the_same_digest() -> None:
    model = _gpt()
    hasher = ParamsHash(param_names(model))
    for name, tensor in sorted(model.state_dict().items()):
        hasher.update(name, tensor)  # buffers and the tied head's second name are skipped
    assert hasher.hexdigest() == params_sha256(model)
    short = ParamsHash(["b", "a", "c"])
    short.update("a", torch.zeros(1))
    with pytest.raises(RunError, match=r"^params_sha256: 2 parameters never came \(b, c, \.\.\.\)$"):
        short.hexdigest()  # a digest of fewer tensors would pass for another model's
    with pytest.raises(RunError, match=r"^params_sha256: parameter 'b' came out of sorted-name order$"):
        ParamsHash(["a", "b"]).update("b", torch.zeros(1))  # the order is part of the digest


def test_live_bytes_counts_tensors_a_consumer_keeps(tmp_path: Path) -> None:
    """The instrument behind the peak assertions: a consumer that keeps every tensor shows up."""
    import torch.distributed.checkpoint as dcp

    state = {"model.a": torch.randn(100), "model.b": torch.randn(50)}
    dcp.save(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    kept = dcp_source(tmp_path / "c")
    tensors = list(kept.tensors)
    assert kept.live.peak == 600 and len(tensors) == 2
    streamed = dcp_source(tmp_path / "c")
    write_stream(tmp_path / "m.pt", streamed)
    assert streamed.live.peak == 400 and streamed.live.current == 0


def _fsdp_rank(env: ClusterEnv, out: str, mode: str) -> dict[str, Any]:
    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel import parallelize

    model = parallelize(_gpt(), env, ParallelConfig(strategy="fsdp", activation_checkpointing=mode))
    names = param_names(model)
    source = model_source(model, is_main=env.is_main)
    written = write_stream(Path(out), source, write=env.is_main, param_names=names)
    return {"peak": source.live.peak, "current": source.live.current,
            "digest": written.params_sha256 if written is not None else None}


@pytest.mark.parametrize("mode", ["none", "block"])
def test_fsdp_world_2_writes_one_process_bytes_one_tensor_at_a_time(tmp_path: Path, mode: str) -> None:
    one = tmp_path / "one.pt"
    model = _gpt()
    save_model(model, one)
    two = tmp_path / "two.pt"
    ranks = run_ranks(2, _fsdp_rank, str(two), mode)
    assert two.read_bytes() == one.read_bytes()
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    assert 0 < ranks[0]["peak"] <= largest and ranks[0]["current"] == 0
    assert ranks[0]["digest"] == params_sha256(model)
    assert ranks[1]["peak"] == 0  # the other rank joins the gathers and keeps nothing


def _pipeline_rank(env: ClusterEnv, out: str) -> float:
    stage = _gpt()  # rank 0: the embeddings and block 0; rank 1: block 1 (as blocks.1), the final norm, the head
    state = {k: v for k, v in stage.state_dict().items() if (k.startswith("blocks.0") or not k.startswith(
        ("blocks", "ln_f", "head"))) == (env.rank == 0)}
    source = pipeline_source(state, sender=True, rank=env.rank, device=torch.device("cpu"))
    write_stream(Path(out), source, write=env.is_main)
    return source.live.peak


def test_pipeline_stages_send_one_tensor_at_a_time(tmp_path: Path) -> None:
    whole = _gpt().state_dict()
    peaks = run_ranks(2, _pipeline_rank, str(tmp_path / "pp.pt"))
    assert _equal(torch.load(tmp_path / "pp.pt", weights_only=True), whole)
    received = [t for k, t in whole.items() if k.startswith(("blocks.1", "ln_f", "head"))]
    assert 0 < peaks[0] <= max(t.numel() * t.element_size() for t in received)


def _failing_rank(env: ClusterEnv, out: str) -> str:
    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel import parallelize

    model = parallelize(_gpt(), env, ParallelConfig(strategy="fsdp"))
    try:
        agree("writing model.pt", lambda: write_stream(Path(out), model_source(model, is_main=env.is_main),
                                                       write=env.is_main))
    except (ExportError, PeerError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_failed_write_on_rank_0_fails_every_rank_without_a_hang(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    errors = run_ranks(2, _failing_rank, str(tmp_path / "file" / "model.pt"), timeout=60)
    assert errors[0].startswith("ExportError: cannot write") and "hint" in errors[0]
    assert errors[1].startswith("PeerError: writing model.pt failed on rank 0")


# ---------------------------------------------------------------- through `hpctrain train` and `ckpt export`

TRAIN = ["model.name=gpt", "model.n_layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=16",
         "data.name=shards", "data.batch_size=4", "data.max_val_samples=8", "train.max_steps=3", "train.log_every=1",
         "train.progress=false", "train.threads=1", "optim.name=adamw",
         "optim.lr=0.01", "checkpoint.every_steps=3", "checkpoint.every_seconds=None"]


def corpus_shards(root: Path) -> Path:
    """Token shards (seq 16) of a small generated corpus under ``root``: no download."""
    words = [f"w{i % 97}x{i % 13}" for i in range(3000)]
    for doc in range(8):
        (root / f"doc{doc}.txt").write_text(" ".join(words[doc * 300:(doc + 1) * 300 + 200]) + "\n")
    write_text_shards(f"text:{root}", root / "shards", seq_len=16)
    return root / "shards"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return corpus_shards(tmp_path_factory.mktemp("corpus"))


def _train(run: Path, shards: Path, *extra: str) -> None:
    """A 2-rank run on forked ranks (the launcher is not what these tests check)."""
    got = train_cases(2, [(run.name, [*TRAIN, f"data.path={shards}", *extra])], run.parent, keep=("steps",))[0]
    assert isinstance(got[run.name], dict), got


def test_fsdp_run_model_pt_and_dcp_export_agree(tmp_path: Path, shards: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run"
    _train(run, shards, "parallel.strategy=fsdp")
    model = GPT(GPTShape(vocab=256, seq_len=16, n_layers=2, hidden=32, heads=4))
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True, mmap=True))
    assert params_sha256(model) == json.loads((run / "summary.json").read_text())["params_sha256"]
    read: list[str] = []
    original = dcp.FileSystemReader.read_data

    def recording(self: Any, plan: Any, planner: Any) -> Any:
        read.extend(item.storage_index.fqn for item in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", recording)
    ckpt = run / "checkpoints" / "step-000000003"
    assert cli_main(["ckpt", "export", str(ckpt), str(tmp_path / "w.pt")]) == 0
    assert (tmp_path / "w.pt").read_bytes() == (run / "model.pt").read_bytes()
    assert read and all(name.startswith("model.") for name in read)  # never the optimizer state
    assert cli_main(["ckpt", "export", str(run), str(tmp_path / "w.safetensors")]) == 0
    assert _equal(tensorfile.read(tmp_path / "w.safetensors"), torch.load(run / "model.pt", weights_only=True))


def test_export_of_a_torch_format_checkpoint_keeps_working(tmp_path: Path, shards: Path) -> None:
    from hpctrain.config import load_config
    from hpctrain.train import train

    run = tmp_path / "run"
    train(load_config(None, [*TRAIN, f"data.path={shards}", f"run.dir={run}", "checkpoint.format=torch"]))
    assert cli_main(["ckpt", "export", str(run), str(tmp_path / "w.pt")]) == 0
    assert (tmp_path / "w.pt").read_bytes() == (run / "model.pt").read_bytes()


def test_save_model_of_a_module(tmp_path: Path) -> None:
    model: nn.Module = _gpt()
    save_model(model, tmp_path / "m.safetensors")
    assert _equal(tensorfile.read(tmp_path / "m.safetensors"), dict(sorted(model.state_dict().items())))


@pytest.mark.slow
def test_export_of_a_deepspeed_checkpoint_equals_model_pt(tmp_path: Path, shards: Path) -> None:
    pytest.importorskip("deepspeed")
    run = tmp_path / "run"
    _train(run, shards, "parallel.strategy=deepspeed", "parallel.deepspeed_stage=2", "optim.schedule=constant")
    assert cli_main(["ckpt", "export", str(run), str(tmp_path / "w.pt")]) == 0  # DeepSpeed's zero_to_fp32 merge
    assert _equal(torch.load(tmp_path / "w.pt", weights_only=True), torch.load(run / "model.pt", weights_only=True))
