"""The shard format: writer, manifest, index, verify, sources, CLI, corruption, WebDataset interop."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.cli import main
from hpctrain.core.env import ClusterEnv
from hpctrain.data.errors import CorruptSampleError, ShardError
from hpctrain.data.indexing import index_existing
from hpctrain.data.loader import ShardedEvalLoader, ShardedLoader
from hpctrain.data.manifest import load_index, load_manifest
from hpctrain.data.pack import npy_bytes
from hpctrain.data.shard_dataset import ShardDataset
from hpctrain.data.shard_index import ShardIndex
from hpctrain.data.verify import verify
from hpctrain.data.writer import ShardWriter, parse_size, write_shards

# ---------------------------------------------------------------- helpers (also used by test_data_loader)


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def pixels(i: int) -> np.ndarray:
    """An 8x8 uint8 image whose first row encodes the sample number (checkable after decode)."""
    img = np.full((8, 8), i % 251, dtype=np.uint8)
    img[1:, :] = (np.arange(56).reshape(7, 8) + i) % 256
    return img


def make_shards(root: Path, n: int = 45, per_shard: int = 7, split: str = "train", kind: str = "npy") -> Path:
    """n samples (keys s00000..), labels i % 5, in shards of per_shard (the last one shorter)."""
    def samples():
        for i in range(n):
            data = png_bytes(pixels(i)) if kind == "png" else npy_bytes(pixels(i).astype(np.float32))
            yield f"s{i:05d}", {"cls": str(i % 5).encode(), kind: data}
    decode = {"input": kind, "target": "cls"} | ({"scale": 255.0} if kind == "png" else {})
    meta = {"source": "test", "classes": [str(c) for c in range(5)], "decode": decode}
    write_shards(samples(), root, split, samples_per_shard=per_shard, meta=meta)
    return root


def _mask(batch) -> list[bool]:
    return batch.mask.tolist() if batch.mask is not None else [True] * len(batch)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- writing and the manifest


def test_writer_layout_manifest_and_index(tmp_path):
    make_shards(tmp_path, n=45, per_shard=7)
    m = load_manifest(tmp_path, "train")
    assert [s["samples"] for s in m["shards"]] == [7] * 6 + [3]
    assert [s["name"] for s in m["shards"]][:2] == ["train-000000.tar", "train-000001.tar"]
    assert m["total_samples"] == 45 and m["fields"] == ["cls", "npy"] and m["classes"] == list("01234")
    for shard in m["shards"]:
        path = tmp_path / shard["name"]
        assert path.stat().st_size == shard["bytes"]
        with tarfile.open(path) as tf:  # plain USTAR members, one per field, key.ext
            names = tf.getnames()
            assert all(tf.getmember(n).pax_headers == {} for n in names)
        index = load_index(tmp_path, shard)
        assert names == [f"{k}.{e}" for k in index["keys"] for e in ("cls", "npy")]
    assert not list(tmp_path.glob(".*tmp*")), "no temporary files remain"
    assert verify(tmp_path, "train") == []


def test_shard_size_limit_and_parse_size(tmp_path):
    assert parse_size("256MB") == 256 * 2**20 and parse_size("1.5k") == 1536 and parse_size("4096") == 4096
    with pytest.raises(ShardError, match="not a size"):
        parse_size("big")
    samples = ((f"k{i}", {"cls": b"1", "npy": npy_bytes(np.zeros(500, np.float32))}) for i in range(20))
    m = write_shards(samples, tmp_path, "train", max_bytes=12000)
    assert all(s["bytes"] <= 12000 for s in m["shards"]) and len(m["shards"]) > 3
    assert sum(s["samples"] for s in m["shards"]) == 20


def test_interrupted_write_leaves_no_whole_looking_shard(tmp_path):
    def samples():
        for i in range(10):
            if i == 8:
                raise KeyboardInterrupt
            yield f"k{i}", {"cls": b"0", "npy": npy_bytes(np.zeros(3, np.float32))}
    with pytest.raises(KeyboardInterrupt):
        write_shards(samples(), tmp_path, "train", samples_per_shard=5)
    # shard 0 was complete and renamed; shard 1 was not: no tar by its name, no manifest
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == ["train-000000.tar"]
    assert not (tmp_path / "train.manifest.json").exists() and not list(tmp_path.glob(".*tmp*"))


def test_bad_keys_and_fields_are_named(tmp_path):
    with pytest.raises(ShardError, match="a.b"):
        with ShardWriter(tmp_path, "train") as w:
            w.write("a.b", {"cls": b"1"})
    with pytest.raises(ShardError, match="'k1' has fields"):
        with ShardWriter(tmp_path, "train") as w:
            w.write("k0", {"cls": b"1", "npy": b"x"})
            w.write("k1", {"cls": b"1"})
    with pytest.raises(ShardError, match="no manifest"):
        load_manifest(tmp_path / "nothing", "train")


# ---------------------------------------------------------------- decoding


def test_png_and_npy_decode_to_the_written_values(tmp_path):
    for kind in ("png", "npy"):
        root = make_shards(tmp_path / kind, n=12, per_shard=5, kind=kind)
        ds = ShardDataset(ShardIndex(root, "train"))
        batch = ds.__getitems__([3, 0, 11])
        assert batch.keys == ["s00003", "s00000", "s00011"] and batch.mask is None
        assert batch.targets.tolist() == [3, 0, 1] and batch.targets.dtype == torch.int64
        want = torch.from_numpy(np.stack([pixels(i) for i in (3, 0, 11)])).float()
        if kind == "png":  # images become N x C x H x W floats, scaled by the manifest
            want = want.unsqueeze(1) / 255.0
        assert batch.inputs.dtype == torch.float32 and torch.equal(batch.inputs, want)


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_image_sources_reproduce_the_in_memory_tensors(tmp_path, name):
    import itertools

    from hpctrain.data.errors import DataMissingError
    from hpctrain.data.sources import load_dataset, open_source

    try:
        src, ref = open_source(name, "val"), load_dataset(name, "val")
    except DataMissingError as err:
        pytest.skip(str(err))
    write_shards(itertools.islice(src.samples, 40), tmp_path, "val", samples_per_shard=16, meta=src.meta)
    loader = ShardedEvalLoader(tmp_path, ClusterEnv(), 16, split="val")
    batches = list(loader)
    inputs = torch.cat([b.inputs for b in batches])
    assert inputs.shape == (40, 1, 28, 28)
    assert torch.equal(inputs, ref.inputs[:40])
    assert torch.equal(torch.cat([b.targets for b in batches]), ref.targets[:40])


def test_transform_hook_and_text_records(tmp_path):
    lines = [json.dumps({"text": "ab" * (i + 1), "label": i % 2}) for i in range(6)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    assert main(["data", "shard", f"jsonl:{tmp_path / 'd.jsonl'}", str(tmp_path / "out"), "--quiet"]) == 0
    with pytest.raises(ShardError, match="transform"):
        ShardedLoader(tmp_path / "out", ClusterEnv(), 2)
    loader = ShardedLoader(tmp_path / "out", ClusterEnv(), 2,
                           transform=lambda s: (torch.tensor([len(s["json"]["text"])], dtype=torch.float32), s["cls"]))
    batch = next(iter(loader))
    assert batch.inputs.shape == (2, 1) and set(batch.targets.tolist()) <= {0, 1}


# ---------------------------------------------------------------- sources and the CLI


def test_cli_shard_inspect_verify_for_file_sources(tmp_path, capsys):
    from PIL import Image

    for c in ("cat", "dog"):
        (tmp_path / "img" / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(pixels(i)).convert("RGB").save(tmp_path / "img" / c / f"{i}.png")
    np.savez(tmp_path / "d.npz", x=np.ones((9, 4), np.float32), y=np.arange(9) % 3)
    cases = {"imagefolder": (f"imagefolder:{tmp_path / 'img'}", (3, 8, 8), 2),
             "npz": (f"npz:{tmp_path / 'd.npz'}", (4,), 3), "synth": ("synthetic_cifar:10", (3, 32, 32), 10)}
    for name, (source, shape, classes) in cases.items():
        out = tmp_path / name
        assert main(["data", "shard", source, str(out), "--samples-per-shard", "4", "--quiet"]) == 0
        assert main(["data", "verify", str(out)]) == 0
        loader = ShardedEvalLoader(out, ClusterEnv(), 4, split="train")
        assert loader.dataset.sample_shape() == shape
        assert len(load_manifest(out, "train")["classes"]) == classes
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "npz")]) == 0
    text = capsys.readouterr().out
    assert "9 samples in 3 shards" in text and "3 classes" in text
    assert main(["data", "shard", "nope", str(tmp_path / "x"), "--quiet"]) == 2


# ---------------------------------------------------------------- corruption


def test_truncated_shard_is_named_by_loader_and_verify(tmp_path, capsys):
    make_shards(tmp_path, n=20, per_shard=10)
    shard = tmp_path / "train-000001.tar"
    index = json.loads((tmp_path / "train-000001.idx.json").read_text())
    with open(shard, "r+b") as fh:  # cut into the 7th sample
        fh.truncate(index["start"][6] + 100)
    with pytest.raises(CorruptSampleError, match=r"train-000001\.tar.*s00016"):
        ShardedLoader(tmp_path, ClusterEnv(), 4)
    problems = verify(tmp_path, "train")
    assert any(p.shard == "train-000001.tar" and p.key == "s00016" for p in problems)
    assert main(["data", "verify", str(tmp_path)]) == 1
    assert "s00016" in capsys.readouterr().err
    # skip: the lost samples are masked out, counted, and the rest still arrives
    loader = ShardedLoader(tmp_path, ClusterEnv(), 4, on_corrupt="skip", drop_last=False, shuffle="none")
    seen = [k for b in loader for k, m in zip(b.keys, _mask(b)) if m]
    assert loader.skipped == 4 and loader.stats()["skipped_keys"] == ["s00016", "s00017", "s00018", "s00019"]
    assert seen == [f"s{i:05d}" for i in range(16)]


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_is_named_by_loader_and_verify(tmp_path, where):
    make_shards(tmp_path, n=12, per_shard=6, kind="png")
    index = json.loads((tmp_path / "train-000000.idx.json").read_text())
    sample = 4  # s00004
    offset = index["start"][sample] + (index["offsets"][sample][2] + 20 if where == "data" else 5)
    flip_byte(tmp_path / "train-000000.tar", offset)
    problems = verify(tmp_path, "train")
    assert any(p.key == "s00004" for p in problems) and any("sha256" in p.message for p in problems)
    loader = ShardedLoader(tmp_path, ClusterEnv(), 3, shuffle="none")
    with pytest.raises(CorruptSampleError, match=r"train-000000\.tar sample 's00004'"):
        list(loader)
    skip = ShardedLoader(tmp_path, ClusterEnv(), 3, shuffle="none", on_corrupt="skip")
    batches = list(skip)
    assert skip.skipped == 1 and sum(int(b.mask.sum()) if b.mask is not None else len(b) for b in batches) == 11


def test_corrupt_sample_in_a_loader_worker_is_one_line(tmp_path):
    """DataLoader re-raises a worker's error with the worker's traceback as its message; the
    loaders raise the worker's own error instead: one line naming shard and key (issue 17)."""
    make_shards(tmp_path, n=12, per_shard=6, kind="png")
    index = json.loads((tmp_path / "train-000000.idx.json").read_text())
    flip_byte(tmp_path / "train-000000.tar", index["start"][4] + index["offsets"][4][2] + 20)  # s00004's pixels
    loaders = [ShardedLoader(tmp_path, ClusterEnv(), 3, shuffle="none", num_workers=2, persistent_workers=False),
               ShardedEvalLoader(tmp_path, ClusterEnv(), 3, split="train", num_workers=2)]
    for loader in loaders:
        with pytest.raises(CorruptSampleError) as caught:
            list(loader)
        message = str(caught.value)
        assert message.startswith("shard ") and "train-000000.tar sample 's00004'" in message, message
        assert "\n" not in message and "Traceback" not in message and "worker" not in message, message


def test_missing_shard_is_called_missing_not_truncated(tmp_path, capsys):
    make_shards(tmp_path, n=20, per_shard=10)
    (tmp_path / "train-000001.tar").unlink()
    for make in (lambda: ShardedLoader(tmp_path, ClusterEnv(), 4),
                 lambda: ShardedLoader(tmp_path, ClusterEnv(), 4, on_corrupt="skip"),  # skip is for bad samples
                 lambda: ShardedEvalLoader(tmp_path, ClusterEnv(), 4, split="train")):
        with pytest.raises(ShardError, match=r"1 of the 2 shards .*train\.manifest\.json lists are missing.*"
                                             r"train-000001\.tar") as caught:
            make()
        assert "truncated" not in str(caught.value)
    assert main(["data", "verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "train-000001.tar: file is missing" in err and "truncated" not in err


def test_verify_fails_when_a_manifest_is_deleted(tmp_path, capsys):
    make_shards(tmp_path, n=12, per_shard=6)
    make_shards(tmp_path, n=6, per_shard=6, split="val")
    (tmp_path / "train.manifest.json").unlink()
    assert main(["data", "verify", str(tmp_path)]) == 1  # val is fine, train's shards have no manifest
    captured = capsys.readouterr()
    assert "ok   val" in captured.out
    assert f"2 shard(s) of split 'train' but no manifest {tmp_path / 'train.manifest.json'}" in captured.err
    assert "delete" not in captured.err and "remove" not in captured.err
    (tmp_path / "val.manifest.json").unlink()  # no manifest at all: the shards are still reported
    assert main(["data", "verify", str(tmp_path)]) == 1
    assert "split 'val'" in capsys.readouterr().err
    assert main(["data", "verify", str(tmp_path), "--split", "train"]) == 2  # asked for it by name: bad input
    assert "train.manifest.json" in capsys.readouterr().err


# ---------------------------------------------------------------- WebDataset interop


def test_hpctrain_shards_read_by_webdataset(tmp_path):
    import webdataset as wds

    make_shards(tmp_path, n=23, per_shard=10, kind="png")
    urls = [str(p) for p in sorted(tmp_path.glob("train-*.tar"))]
    rows = list(wds.WebDataset(urls, shardshuffle=False).decode("l8").to_tuple("__key__", "png", "cls"))
    assert [r[0] for r in rows] == [f"s{i:05d}" for i in range(23)]
    assert all(np.array_equal(np.asarray(r[1]), pixels(i)) and r[2] == i % 5 for i, r in enumerate(rows))


def test_webdataset_shards_read_by_hpctrain(tmp_path):
    import webdataset as wds

    with wds.ShardWriter(str(tmp_path / "train-%06d.tar"), maxcount=6, verbose=0) as sink:
        for i in range(15):
            sink.write({"__key__": f"w{i:04d}", "png": png_bytes(pixels(i)), "cls": i % 3})
    manifest = index_existing(tmp_path, "train")
    assert manifest["total_samples"] == 15 and manifest["classes"] == ["0", "1", "2"]
    assert verify(tmp_path, "train") == []
    loader = ShardedEvalLoader(tmp_path, ClusterEnv(), 4, split="train")
    batches = list(loader)
    keys = [k for b in batches for k in b.keys]
    assert keys == [f"w{i:04d}" for i in range(15)]
    inputs = torch.cat([b.inputs for b in batches])
    want = torch.from_numpy(np.stack([pixels(i) for i in range(15)])).float().unsqueeze(1) / 255.0
    assert torch.equal(inputs, want) and torch.cat([b.targets for b in batches]).tolist() == [i % 3 for i in range(15)]
