"""One source registry for data.name and `hpctrain data shard`; data built from its own section; a light
``hpctrain.config.data``."""

from __future__ import annotations

import ast
import gzip
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.config.data import DataConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.core.section import ConfigError
from hpctrain.data import sources
from hpctrain.data.batch import ArrayDataset
from hpctrain.data.build import build_data, build_val_loader
from hpctrain.data.errors import DataFormatError, ShardError
from hpctrain.data.sources import Source, data_source, load_dataset, open_source, register_source
from hpctrain.data.text import write_text_shards

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ConfigError, match=r"data.name='cifar11' is unknown; choose one of: mnist, fashion_mnist, "
                                          r"synthetic_cifar, synthetic_tiny, shakespeare \(text, sharded on first "
                                          r"use\), shards \(with data.path\), imagefolder:PATH, jsonl:PATH, "
                                          r"csv:PATH, parquet:PATH, hf:PATH, package.module:NAME \(your own\)$"):
        data_source("cifar11")
    with pytest.raises(ConfigError, match="data.name='npz' is unknown"):  # a pack-only source is no data.name
        load_dataset("npz", "train")
    for spec in ("bogus", "npz", "shards"):  # unknown, its PATH missing, not a source to pack
        with pytest.raises(ShardError, match=rf"unknown source '{spec}'; choose one of: mnist, fashion_mnist, "
                                             r"synthetic_cifar:N, imagefolder:PATH, npz:PATH, jsonl:PATH, "
                                             r"csv:PATH, parquet:PATH, hf:PATH, text:PATH, shakespeare$"):
            open_source(spec, "train")
    with pytest.raises(ShardError, match="synthetic_cifar:x: N must be a positive number"):
        open_source("synthetic_cifar:x", "train")


def test_every_hook_in_the_table_resolves():
    """The table names its functions as import paths: a typo would only show when that source is used."""
    for name, source in sources._SOURCES.items():
        hooks = [t for t in (source.memory, source.shards, source.pack, source.splits) if t is not None]
        assert hooks, name
        for target in hooks:
            assert callable(sources.hook(target)), f"{name}: {target}"


def _two_classes(data: DataConfig, split: str, seed: int) -> ArrayDataset:
    n = 12 if split == "train" else 5
    x = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
    return ArrayDataset(x, torch.arange(n) % 2, 2, f"mine/{split}")


def test_a_registered_source_is_a_data_name(monkeypatch):
    monkeypatch.setattr(sources, "_SOURCES", dict(sources._SOURCES))  # registered for this test only
    register_source("mine", Source(memory=f"{__name__}:_two_classes"))
    bundle = build_data(DataConfig(name="mine", batch_size=4), ClusterEnv(), CPU, seed=0)
    assert (bundle.num_classes, bundle.input_shape, bundle.train_size, bundle.val_size, bundle.task) == (
        2, (3,), 12, 5, "classification")
    assert sorted(k for b in bundle.train_loader for k in b.keys.tolist()) == list(range(12))
    assert len(load_dataset("mine", "test")) == 5


def test_val_loader_carries_the_task_the_data_decides(tmp_path):
    val = build_val_loader(DataConfig(name="synthetic_tiny", synthetic_size=50), ClusterEnv(), seed=1)
    assert (val.size, val.layout.task, val.layout.input_shape, val.layout.input_dtype) == (
        10, "classification", (128,), torch.float32)
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * (20 + i))
    write_text_shards(f"text:{corpus}", tmp_path / "s", seq_len=16, val_fraction=0.3)
    text = build_val_loader(DataConfig(name="shards", path=str(tmp_path / "s")), ClusterEnv(), seed=0)
    assert (text.layout.task, text.layout.num_classes, text.layout.input_shape, text.layout.input_dtype) == (
        "causal_lm", 256, (16,), torch.long)
    assert text.size == sum(len(b) for b in text.loader) > 0


# ---------------------------------------------------------------- import weight


def _module_level_imports(path: Path) -> set[str]:
    """Modules a file imports when it is imported: its top level, ``if TYPE_CHECKING:`` aside."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


@pytest.mark.parametrize("module, heavy", [("hpctrain.config.data", ("torch", "numpy")),
                                           ("hpctrain.data.sources", ("torch",))])
def test_config_and_source_names_import_no_torch(module, heavy):
    """The config loader imports every section's config (``hpctrain config show`` must not pay for torch
    or numpy), and naming sources must not pay for torch: the hpctrain.data modules such an import
    runs (the package first, always) import neither. Other packages' own imports are their business."""
    stub = f"import sys, types; p = types.ModuleType('hpctrain'); p.__path__ = [{str(ROOT / 'hpctrain')!r}]; " \
           "sys.modules['hpctrain'] = p; "  # hpctrain/__init__ is not hpctrain.data's to keep light
    names = f"sorted(m for m in sys.modules if m.startswith('hpctrain.data') or m == {module!r})"
    code = stub + f"import json, {module}; print(json.dumps({names}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout)
    assert module in loaded and "hpctrain.data.build" not in loaded
    for name in loaded:
        path = ROOT / (name.replace(".", "/") + ("/__init__.py" if name == "hpctrain.data" else ".py"))
        found = {m for m in _module_level_imports(path) if m.split(".")[0] in heavy}
        assert not found, f"{name} imports {found} when {module} is imported"


def test_the_package_exports_lazily_what_it_lists():
    import hpctrain.data as data

    assert sorted(data.__all__) == sorted(data._EXPORTS)
    for name in data.__all__:
        assert getattr(data, name).__module__ == data._EXPORTS[name], name
    with pytest.raises(AttributeError, match="no attribute 'shards'"):
        data.shards  # noqa: B018 - the old module is gone, not re-exported


@pytest.mark.parametrize(("name", "content", "says"), [
    ("random.bin", b"\xc7\xda" + bytes(range(256)) * 4, "is not MNIST's mnist.pkl.gz (not a complete gzip file"),
    ("cut.pkl.gz", None, "is not MNIST's mnist.pkl.gz (not a complete gzip file"),
    ("wrong-shape.pkl.gz", ((np.zeros((3, 5), np.float32), np.zeros(3)),) * 3, "not N x 784 pixels with N labels"),
    ("scalars.pkl.gz", ((np.float32(1), np.float32(2)),) * 3, "not N x 784 pixels with N labels"),
    ("fewer-labels.pkl.gz", ((np.zeros((3, 784), np.float32), np.zeros(2)),) * 3, "not N x 784 pixels"),
])
def test_a_data_path_that_is_not_mnist_is_named(tmp_path, name, content, says):
    """A random file, a cut download or another pickle of arrays as data.path: a DataFormatError
    (exit 2) naming the file, never a gzip or numpy traceback (issue 17)."""
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        whole = gzip.compress(pickle.dumps(content if content is not None else ((np.zeros((2, 784)),) * 2,) * 3))
        path.write_bytes(whole if content is not None else whole[: len(whole) // 2])
    with pytest.raises(DataFormatError, match=re.escape(says)) as caught:
        load_dataset("mnist", "train", str(path))
    assert str(path) in str(caught.value) and caught.value.exit_code == 2
