"""The checkpoint-view protocol (hpctrain.checkpoint.view): every registered format's view saves
and loads a model + optimizer through the checkpointer (and loads the other layout's format);
DeepSpeed's view resumes its own files and exports the trained weights through zero_to_fp32; a
format registered from this module is saved, resumed, verified and exported by `hpctrain ckpt`
without a line of hpctrain.checkpoint knowing it; hpctrain.checkpoint names no strategy or
format and imports neither the parallel layer nor weights nor launch."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hpctrain.parallel.checkpoint_formats  # noqa: F401  (the registry lines of the built-in formats)
from hpctrain.checkpoint import layout
from hpctrain.checkpoint.checkpointer import Checkpointer
from hpctrain.checkpoint.confine import CheckpointError
from hpctrain.checkpoint.state import Counters
from hpctrain.checkpoint.view import CheckpointView, formats, register_format, view_class
from hpctrain.cli import main as cli_main
from hpctrain.config.checkpoint import CheckpointConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.parallel.state import ShardedState, WholeState
from hpctrain.weights.export import Source, dict_source

CHECKPOINT = Path(__file__).resolve().parents[2] / "hpctrain" / "checkpoint"
BUILTIN = ("torch", "dcp", "deepspeed")


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A tiny model and AdamW after one step (so the optimizer holds state), different per seed."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _checkpointer(run: Path, view: CheckpointView, counters: Counters, fmt: str = "torch") -> Checkpointer:
    config = CheckpointConfig(every_seconds=None, format=fmt)  # type: ignore[arg-type]
    return Checkpointer(run, ClusterEnv(), torch.device("cpu"), config, {"model": view, "counters": counters})


def _save(run: Path, view: CheckpointView, fmt: str = "torch") -> Path:
    counters = Counters(step=1)
    ckpt = _checkpointer(run, view, counters, fmt)
    ckpt.save({}, blocking=True)
    ckpt.close()
    return layout.checkpoints_dir(run) / layout.step_name(1)


def _resume(run: Path, view: CheckpointView) -> None:
    ckpt = _checkpointer(run, view, Counters())
    assert ckpt.resume("auto")
    ckpt.close()


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _tensors(source: Source) -> dict[str, torch.Tensor]:
    return {spec.name: tensor for spec, tensor in zip(source.specs, source.tensors, strict=True)}


WRITERS = {"torch": (WholeState, "torch"), "dcp": (ShardedState, "dcp"),
           "dcp via checkpoint.format": (WholeState, "dcp")}


@pytest.mark.parametrize("reader", [WholeState, ShardedState], ids=["whole", "sharded"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_each_format_round_trips_model_and_optimizer_into_either_layout(tmp_path: Path, writer: str,
                                                                        reader: type[WholeState]) -> None:
    view_type, fmt = WRITERS[writer]
    model, optimizer = _model_and_optimizer(0)
    path = _save(tmp_path, view_type(model, optimizer), fmt)
    manifest = layout.read_manifest(path)
    assert manifest["format"] == fmt and view_class(fmt).format == fmt
    assert bool(view_class(fmt).own_files(manifest["files"])) == (fmt == "dcp")
    exported = _tensors(view_class(fmt).export(path))
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())

    other, other_optimizer = _model_and_optimizer(1)
    assert not torch.equal(other[0].weight, model[0].weight)
    _resume(tmp_path, reader(other, other_optimizer))
    for a, b in zip(other.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_optimizer_tensors(other_optimizer), _optimizer_tensors(optimizer), strict=True):
        assert torch.equal(a, b)


def test_every_builtin_format_is_registered_by_the_parallel_layer() -> None:
    assert set(BUILTIN) <= set(formats())
    for name in BUILTIN:
        view = view_class(name)
        assert view.format == name and view.__module__.startswith("hpctrain.parallel.")


# DeepSpeed's own files go through DeepSpeedState in the trainer's tests: a SIGTERM save resumed
# bit-identical to the uninterrupted run (tests/train/test_deepspeed.py), `ckpt export` equal to
# model.pt (tests/checkpoint/test_export_stream.py), a wrong world size refused.


# ---------------------------------------------------------------- a format of one's own


class ToyView(CheckpointView):
    """A format hpctrain does not know: every parameter as JSON numbers in ``toy/params.json``."""

    format = "toy-json"
    files_dir = "toy"
    written_by = "tests/checkpoint/test_views.py"
    checked: list[set[str] | None] = []

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def own_state(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def write(self, state: Any, directory: Path, rank: int, group: Any) -> list[Path]:
        path = directory / "toy" / "params.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({k: v.tolist() for k, v in state.items()}))
        return [path]

    def load(self, path: Path, manifest: dict[str, Any], replicated: dict[str, Any], group: Any) -> dict[str, Any]:
        self.model.load_state_dict({k: torch.tensor(v) for k, v in self._read(path).items()})
        return replicated

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @classmethod
    def _read(cls, path: Path) -> dict[str, Any]:
        data = json.loads((path / "toy" / "params.json").read_text())
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: toy/params.json holds no mapping")
        return data

    @classmethod
    def check_files(cls, path: Path, names: set[str] | None = None) -> None:
        cls.checked.append(names)
        cls._read(path)

    @classmethod
    def export(cls, path: Path) -> Source:
        return dict_source({k: torch.tensor(v) for k, v in cls._read(path).items()})


def test_a_format_registered_from_user_code_is_saved_resumed_verified_and_exported(tmp_path: Path) -> None:
    register_format(ToyView.format, f"{__name__}:ToyView")
    model, _ = _model_and_optimizer(0)
    path = _save(tmp_path / "run", ToyView(model))
    manifest = layout.read_manifest(path)
    assert manifest["format"] == "toy-json" and "toy/params.json" in manifest["files"]

    ToyView.checked.clear()
    other, _ = _model_and_optimizer(1)
    _resume(tmp_path / "run", ToyView(other))
    assert ToyView.checked == [{"toy/params.json"}]  # hashed, then checked by the view, before its load
    assert all(torch.allclose(a, b) for a, b in zip(other.parameters(), model.parameters(), strict=True))

    assert cli_main(["ckpt", "verify", str(path)]) == 0
    assert ToyView.checked[-1] is None  # verify asked the view to check all its files
    out = tmp_path / "model.pt"
    assert cli_main(["ckpt", "export", str(path), str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.allclose(exported[k], v) for k, v in model.state_dict().items())

    (path / "toy" / "params.json").write_text("[]")  # a crafted file with a matching checksum
    entry = layout.hash_file(path / "toy" / "params.json")
    manifest["files"]["toy/params.json"] = entry
    (path / layout.MANIFEST).write_text(json.dumps(manifest))
    assert cli_main(["ckpt", "verify", str(path)]) == 2  # REFUSED by the view's own check


def test_an_unknown_format_is_named_with_a_hint() -> None:
    with pytest.raises(CheckpointError, match=r"'no-such-format' has no registered view .*register_format"):
        view_class("no-such-format")


# ---------------------------------------------------------------- what hpctrain.checkpoint may name

NAMES = re.compile(r"\b(dcp|deepspeed|fsdp|ddp)\b", re.IGNORECASE)


def _strings(tree: ast.Module) -> list[tuple[int, str, bool]]:
    """(line, text, used as a mapping key) of every string constant but docstrings."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    keys = {id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict) for k in node.keys if k is not None}
    keys |= {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)}
    return [(node.lineno, node.value, id(node) in keys) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def test_the_checkpoint_package_names_no_strategy_or_format() -> None:
    """Code and messages of hpctrain/checkpoint/ never say dcp, deepspeed, fsdp or ddp (docstrings and
    comments may, to explain the plug), and "torch" only as a key (the torch RNG stream, torch's
    version in the manifest), never as a format: formats are the views' business."""
    found = []
    for path in sorted(CHECKPOINT.glob("*.py")):
        for line, text, is_key in _strings(ast.parse(path.read_text())):
            if NAMES.search(text) or (text == "torch" and not is_key):
                found.append(f"{path.name}:{line}: {text!r}")
    assert found == []


def test_the_checkpoint_package_imports_no_higher_layer_nor_weights() -> None:
    """Module-level, deferred and TYPE_CHECKING imports alike."""
    found = []
    for path in sorted(CHECKPOINT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}:{node.lineno}: {n}" for n in names  # type: ignore[attr-defined]
                      if re.match(r"hpctrain\.(parallel|weights|launch|planning|cli|train)\b", n)]
    assert found == []


def test_the_rules_catch_what_they_forbid() -> None:
    tree = ast.parse('"""about dcp"""\nx = {"torch": 1}\nif fmt == "torch": pass\nmsg = f"DeepSpeed {x}"\n')
    flagged = [text for _, text, key in _strings(tree) if NAMES.search(text) or (text == "torch" and not key)]
    assert flagged == ["torch", "DeepSpeed "]
