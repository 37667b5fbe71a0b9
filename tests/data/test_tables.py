"""Files users have: CSV, parquet, JSON lines, Hugging Face save_to_disk and image folders, read
straight into ``train`` (data.name=csv:PATH, ...) and packed by ``hpctrain data shard``; a missing
column, an unreadable file or a missing package exits 2 naming it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.cli import main
from hpctrain.config.data import DataConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.data import build_data
from hpctrain.data.loader import ShardedLoader

pa = pytest.importorskip("pyarrow")
CPU = torch.device("cpu")


def _rows(n: int, offset: int = 0) -> dict[str, list[Any]]:
    return {"a": [float(i) for i in range(offset, offset + n)], "b": [i % 7 for i in range(offset, offset + n)],
            "label": [i % 3 for i in range(offset, offset + n)], "note": ["x"] * n}


def _write(kind: str, path: Path, rows: dict[str, list[Any]]) -> None:
    if kind == "csv":
        lines = [",".join(rows)] + [",".join(str(v) for v in vals) for vals in zip(*rows.values())]
        path.write_text("\n".join(lines) + "\n")
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(dict(zip(rows, vals))) + "\n" for vals in zip(*rows.values())))
    else:
        import pyarrow.parquet as pq

        pq.write_table(pa.table(rows), path)


def _bundle(name: str, **keys: Any) -> Any:
    return build_data(DataConfig(name=name, batch_size=4, **keys), ClusterEnv(), CPU, seed=0)


@pytest.mark.parametrize("kind", ["csv", "parquet", "jsonl"])
def test_a_table_trains_from_its_columns_and_packs_to_shards(tmp_path: Path, kind: str, capsys) -> None:
    root = tmp_path / "t"
    root.mkdir()
    _write(kind, root / f"train.{kind}", _rows(20))
    _write(kind, root / f"val.{kind}", _rows(6, offset=100))
    bundle = _bundle(f"{kind}:{root}", input_columns=["a", "b"])
    assert (bundle.num_classes, bundle.input_shape, bundle.train_size, bundle.val_size) == (3, (2,), 20, 6)
    assert bundle.input_dtype == torch.float32  # a float column and an int column: one float vector
    ints = _bundle(f"{kind}:{root}", input_columns=["b"])
    assert ints.input_dtype == torch.int64  # integer features stay integer
    batch = next(iter(ints.val_loader))
    assert batch.inputs.tolist() == [[100 % 7], [101 % 7], [102 % 7], [103 % 7], [104 % 7], [105 % 7]]
    out = tmp_path / "shards"
    for split in ("train", "val"):
        code = main(["data", "shard", f"{kind}:{root}", str(out), "--split", split, "--input-column", "a",
                     "--input-column", "b", "--quiet"])
        assert code == 0, capsys.readouterr().err
    packed = next(iter(ShardedLoader(out, ClusterEnv(), 20, shuffle="none")))
    assert packed.inputs.tolist() == [[float(i), float(i % 7)] for i in range(20)]
    assert packed.targets.tolist() == [i % 3 for i in range(20)]


def test_a_hugging_face_dataset_saved_to_disk(tmp_path: Path, capsys) -> None:
    datasets = pytest.importorskip("datasets")
    rows = {"input_ids": [[i, i + 1, i + 2] for i in range(12)], "label": [i % 2 for i in range(12)]}
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                                   "validation": datasets.Dataset.from_dict({k: v[:5] for k, v in rows.items()})})
    splits.save_to_disk(str(tmp_path / "hf"))
    bundle = _bundle(f"hf:{tmp_path / 'hf'}", input_columns=["input_ids"])
    assert (bundle.num_classes, bundle.input_shape, bundle.input_dtype) == (2, (3,), torch.int64)
    assert (bundle.train_size, bundle.val_size) == (12, 5)
    assert main(["data", "shard", f"hf:{tmp_path / 'hf'}", str(tmp_path / "s"), "--quiet"]) == 0
    assert next(iter(ShardedLoader(tmp_path / "s", ClusterEnv(), 2, shuffle="none"))).inputs.tolist() == [
        [0, 1, 2], [1, 2, 3]]


def test_an_image_folder_trains_directly_labelled_by_class_name(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    for split, classes in (("train", ["cat", "dog", "emu"]), ("val", ["dog", "emu"])):  # val lacks a class
        for cls in classes:
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(3):
                image.new("RGB", (6, 5), (40 * i, 0, 0)).save(tmp_path / split / cls / f"{i}.png")
    image.new("L", (6, 5), 7).save(tmp_path / "train" / "cat" / "gray.png")  # converted to RGB, the majority
    bundle = _bundle(f"imagefolder:{tmp_path}")
    assert (bundle.num_classes, bundle.input_shape, bundle.train_size, bundle.val_size) == (3, (3, 5, 6), 10, 6)
    labels = sorted(t for b in bundle.val_loader for t in b.targets.tolist())
    assert labels == [1, 1, 1, 2, 2, 2]  # dog and emu keep train's numbers
    image.new("RGB", (9, 9)).save(tmp_path / "train" / "dog" / "big.png")
    with pytest.raises(Exception, match=r"mixes image sizes: .*big.png is 9x9 .* hint: --image-size N"):
        _bundle(f"imagefolder:{tmp_path}")
    assert _bundle(f"imagefolder:{tmp_path}", image_size=4).input_shape == (3, 4, 4)


def _train(capsys: pytest.CaptureFixture[str], tmp_path: Path, *keys: str) -> tuple[int, str]:
    code = main(["train", "model.name=tests.data.user_datasets:mlp", "train.progress=false",
                 "checkpoint.enabled=false", f"run.dir={tmp_path / 'run'}", *keys])
    return code, capsys.readouterr().err


def test_bad_tables_exit_2_naming_file_column_and_row(tmp_path: Path, capsys) -> None:
    _write("csv", tmp_path / "t.csv", _rows(8))
    code, err = _train(capsys, tmp_path, f"data.name=csv:{tmp_path / 't.csv'}", "data.input_columns=[a,c]")
    assert code == 2 and f"{tmp_path / 't.csv'} has no column 'c'; its columns are ['a', 'b', 'label', 'note']; " \
                          "hint: set data.input_columns (--input-column)" in err, err
    code, err = _train(capsys, tmp_path, f"data.name=csv:{tmp_path / 't.csv'}")  # 'note' is text
    assert code == 2 and "column 'note' holds string, not numbers" in err, err
    (tmp_path / "bad.csv").write_text("a,label\n1.0,0\n2.0,-1\n")
    code, err = _train(capsys, tmp_path, f"data.name=csv:{tmp_path / 'bad.csv'}")
    assert code == 2 and f"{tmp_path / 'bad.csv'} line 3 (column 'label') has label -1, outside [0, 1)" in err, err
    code, err = _train(capsys, tmp_path, f"data.name=parquet:{tmp_path / 't.csv'}")  # not a parquet file
    assert code == 2 and f"{tmp_path / 't.csv'} cannot be read as parquet" in err, err
    code = main(["data", "shard", f"xlsx:{tmp_path / 't.xlsx'}", str(tmp_path / "o"), "--quiet"])
    assert code == 2 and "unknown source 'xlsx:" in capsys.readouterr().err
    assert "Traceback" not in err


def test_missing_optional_packages_give_the_pip_command(tmp_path: Path, capsys, monkeypatch) -> None:
    _write("csv", tmp_path / "t.csv", _rows(8))
    (tmp_path / "cls" / "a").mkdir(parents=True)
    for name in ("pyarrow", "pyarrow.csv", "PIL", "PIL.Image"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError, as when not installed
    code, err = _train(capsys, tmp_path, f"data.name=csv:{tmp_path / 't.csv'}")
    assert code == 2 and "hint: pip install pyarrow" in err, err
    code, err = _train(capsys, tmp_path, f"data.name=imagefolder:{tmp_path / 'cls'}")
    assert code == 2 and "images need Pillow" in err and "hint: pip install pillow" in err, err
