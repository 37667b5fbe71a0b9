"""Bad data is refused by ``hpctrain data shard`` (exit 2, naming the sample and a hint), image
folders are numbered by class name across splits, and ``data verify`` checks labels."""

from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hpctrain.cli import main
from hpctrain.data.manifest import load_index, load_manifest
from hpctrain.data.shard_dataset import ShardDataset
from hpctrain.data.shard_index import ShardIndex

Image = pytest.importorskip("PIL.Image")


def _image_folder(root: Path, layout: dict[str, list[tuple[tuple[int, int], str]]]) -> Path:
    """``layout``: class -> [((width, height), mode), ...], one PNG each (a distinct gray level per file)."""
    for cls, images in layout.items():
        (root / cls).mkdir(parents=True)
        for i, (size, mode) in enumerate(images):
            Image.new(mode, size, 40 * i + 20).save(root / cls / f"{i}.png")
    return root


def _shard(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["data", "shard", *argv, "--quiet"])
    return code, capsys.readouterr().err


def _labels(out: Path, split: str) -> dict[str, int]:
    """Each sample's label, by key, as the loader reads it."""
    dataset = ShardDataset(ShardIndex(out, split))
    return {s["__key__"]: s["cls"] for s in map(dataset.read, range(len(dataset)))}


@pytest.mark.parametrize("y, culprit", [
    (np.array([0, 1, -1, 2]), "sample 2 (y[2]) has label -1, outside [0, 5)"),
    (np.array([0.0, 1.5, 1.0, 2.0]), "sample 1 (y[1]) has label 1.5, not a whole number"),
    (np.array([0, 1, 7, 2]), "sample 2 (y[2]) has label 7, outside [0, 5)"),
])
def test_npz_labels_outside_the_classes_or_fractional_are_refused(tmp_path, capsys, y, culprit):
    np.savez(tmp_path / "d.npz", x=np.ones((4, 3), np.float32), y=y)
    code, err = _shard(capsys, f"npz:{tmp_path / 'd.npz'}", str(tmp_path / "out"), "--num-classes", "5")
    assert code == 2 and culprit in err and "hint:" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "train.manifest.json").exists()


def test_whole_number_float_labels_are_class_ids(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", x=np.ones((3, 2), np.float32), y=np.array([0.0, 2.0, 1.0]))
    assert _shard(capsys, f"npz:{tmp_path / 'd.npz'}", str(tmp_path / "out"))[0] == 0
    assert sorted(_labels(tmp_path / "out", "train").values()) == [0, 1, 2]


def test_jsonl_labels_are_checked_by_record(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text('{"x": 1, "label": 0}\n{"x": 2, "label": 2.5}\n')
    code, err = _shard(capsys, f"jsonl:{path}", str(tmp_path / "a"))
    assert code == 2 and "record 2 has label 2.5, not a whole number" in err
    path.write_text('{"x": 1, "label": 0}\n{"x": 2}\n')
    code, err = _shard(capsys, f"jsonl:{path}", str(tmp_path / "b"))
    assert code == 2 and "record 2 has label None" in err


def test_a_csv_given_as_npz_is_named_not_an_internal_error(tmp_path, capsys):
    path = tmp_path / "d.csv"
    path.write_text("a,b,label\n1,2,0\n3,4,1\n")
    code, err = _shard(capsys, f"npz:{path}", str(tmp_path / "out"))
    assert code == 2 and f"{path} is not an .npz file" in err and "internal error" not in err


def test_image_folder_with_mixed_sizes_is_refused_or_resized(tmp_path, capsys):
    root = _image_folder(tmp_path / "img", {"a": [((8, 8), "RGB"), ((8, 8), "RGB")], "b": [((9, 6), "RGB")]})
    code, err = _shard(capsys, f"imagefolder:{root}", str(tmp_path / "out"))
    assert code == 2 and f"{root / 'b' / '0.png'} is 9x6" in err and "--image-size" in err
    assert _shard(capsys, f"imagefolder:{root}", str(tmp_path / "out"), "--image-size", "8")[0] == 0
    dataset = ShardDataset(ShardIndex(tmp_path / "out", "train"))
    assert tuple(dataset.batch(list(range(3))).inputs.shape) == (3, 3, 8, 8)


def test_gray_and_rgb_in_one_folder_become_the_majority_mode(tmp_path, capsys):
    root = _image_folder(tmp_path / "img", {"a": [((8, 8), "L"), ((8, 8), "L")], "b": [((8, 8), "RGB")]})
    assert _shard(capsys, f"imagefolder:{root}", str(tmp_path / "out"))[0] == 0
    dataset = ShardDataset(ShardIndex(tmp_path / "out", "train"))
    assert tuple(dataset.batch(list(range(3))).inputs.shape) == (3, 1, 8, 8)


def test_an_unreadable_image_is_named(tmp_path, capsys):
    root = _image_folder(tmp_path / "img", {"a": [((8, 8), "RGB")], "b": [((8, 8), "RGB")]})
    good = (root / "b" / "0.png").read_bytes()
    (root / "b" / "1.png").write_bytes(good[: len(good) // 2])  # truncated mid-stream
    code, err = _shard(capsys, f"imagefolder:{root}", str(tmp_path / "out"))
    assert code == 2 and f"image {root / 'b' / '1.png'} cannot be read" in err


def test_image_folder_labels_follow_class_names_across_splits(tmp_path, capsys):
    train = _image_folder(tmp_path / "train", {c: [((4, 4), "L")] for c in ("ant", "bee", "cat")})
    val = _image_folder(tmp_path / "val", {c: [((4, 4), "L")] for c in ("ant", "cat")})
    out = tmp_path / "out"
    assert _shard(capsys, f"imagefolder:{train}", str(out))[0] == 0
    code, err = _shard(capsys, f"imagefolder:{val}", str(out), "--split", "val")
    assert code == 2 and "lacks class folders ['bee']" in err and "--allow-missing-classes" in err
    assert _shard(capsys, f"imagefolder:{val}", str(out), "--split", "val", "--allow-missing-classes")[0] == 0
    assert load_manifest(out, "val")["classes"] == ["ant", "bee", "cat"]
    assert sorted(_labels(out, "val").values()) == [0, 2]  # cat keeps train's label 2, not position 1
    extra = _image_folder(tmp_path / "extra", {c: [((4, 4), "L")] for c in ("ant", "dog")})
    code, err = _shard(capsys, f"imagefolder:{extra}", str(out), "--split", "test", "--allow-missing-classes")
    assert code == 2 and "has class folders ['dog'] that the other split does not" in err


def test_verify_checks_labels_and_classes_across_splits(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", x=np.ones((3, 2), np.float32), y=np.array([0, 1, 2]))
    out = tmp_path / "out"
    assert _shard(capsys, f"npz:{tmp_path / 'd.npz'}", str(out))[0] == 0
    manifest = load_manifest(out, "train")
    manifest["classes"] = ["0", "1"]  # a label 2 with two classes: out of range
    (out / "train.manifest.json").write_text(json.dumps(manifest))
    assert main(["data", "verify", str(out)]) == 1
    err = capsys.readouterr().err
    key = load_index(out, manifest["shards"][0])["keys"][2]
    assert f"sample {key!r}: label 2 is outside [0, 2)" in err
    val = {**manifest, "split": "val", "classes": ["0", "2"]}  # an older val split, numbered by position
    (out / "val.manifest.json").write_text(json.dumps(val))
    manifest["classes"] = ["0", "1", "2"]
    (out / "train.manifest.json").write_text(json.dumps(manifest))
    assert main(["data", "verify", str(out)]) == 1
    assert "val.manifest.json: classes [0, 2] (2) differ from train's [0, 1, 2] (3)" in capsys.readouterr().err


def test_missing_pillow_is_a_user_error_with_the_install_command(tmp_path, capsys, monkeypatch):
    root = _image_folder(tmp_path / "img", {"a": [((4, 4), "L")]})
    real_import = builtins.__import__

    def no_pil(name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError("No module named 'PIL'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "PIL", raising=False)
    monkeypatch.delitem(sys.modules, "PIL.Image", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_pil)
    code, err = _shard(capsys, f"imagefolder:{root}", str(tmp_path / "out"))
    assert code == 2 and "pip install pillow" in err and "Traceback" not in err
