"""data.decoder=dali (hpctrain.data.dali): the refusal without DALI, and the order/resume adapter with a
stand-in decoder of DALI's interface that decodes with PIL: the same samples in the same order as the
native loader, bit-identical mid-epoch resume at 1 and 2 ranks and at another world size, exact
validation, bad images under data.on_corrupt. The real DALI CPU pipeline runs where DALI is installed
(``pip install 'hpctrain[dali]'``; not in the test install: its wheel is 424 MB)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.cli import main
from hpctrain.config.data import DataConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import EXIT_USER_ERROR, UserError
from hpctrain.data.dali import (
    Augment,
    DaliShardedEvalLoader,
    DaliShardedLoader,
    Plan,
    check_dali,
    dali_available,
    plan_batch,
    require_dali,
)
from hpctrain.data.errors import CorruptSampleError
from hpctrain.data.loader import ShardedEvalLoader, ShardedLoader
from hpctrain.data.writer import write_shards
from tests.data.test_shards import make_shards, pixels, png_bytes

N = 45  # samples of the fixture: 7 shards of 7 and one of 3; 8x8 gray PNGs, classes i % 5


def env_of(rank: int, world: int) -> ClusterEnv:
    return ClusterEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)


class PilDecoder:
    """DALI's interface (encoded uint8 buffers + a Plan -> uint8 NCHW), decoded with PIL: crop box,
    bilinear resize, horizontal flip."""

    def __init__(self, batch_size: int, gray: bool) -> None:
        self.gray, self.calls = gray, 0

    def __call__(self, data: list[np.ndarray], plan: Plan) -> torch.Tensor:
        from PIL import Image

        self.calls += 1
        out = []
        for i, buf in enumerate(data):
            img = Image.open(io.BytesIO(buf.tobytes()))
            img.load()
            if plan.boxes is not None:
                x, y, w, h = (int(v) for v in plan.boxes[i])
                img = img.crop((x, y, x + w, y + h))
            if plan.size is not None:
                img = img.resize((plan.size, plan.size), Image.Resampling.BILINEAR)
            arr = np.asarray(img.convert("L" if self.gray else "RGB"))
            if plan.flips is not None and plan.flips[i]:
                arr = arr[:, ::-1]
            out.append(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))
        return torch.from_numpy(np.ascontiguousarray(np.stack(out)))


AUG = Augment(size=6, scale=(0.3, 1.0), flip=True)


def dali_loader(root: Path, rank: int, world: int, *, augment: Augment | None = AUG, workers: int = 0,
                **kw) -> DaliShardedLoader:
    return DaliShardedLoader(root, env_of(rank, world), 3, seed=4, augment=augment, decoder=PilDecoder,
                             num_workers=workers, persistent_workers=False, **kw)


def same(a: list, b: list) -> bool:
    """Batches equal bit for bit: keys, inputs, targets and masks."""
    return len(a) == len(b) and all(
        x.keys == y.keys and torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
        and (x.mask is None) == (y.mask is None) and (x.mask is None or torch.equal(x.mask, y.mask))
        for x, y in zip(a, b))


def by_key(batches: list) -> dict[str, torch.Tensor]:
    out = {}
    for b in batches:
        mask = b.mask.tolist() if b.mask is not None else [True] * len(b)
        out |= {k: x for k, x, m in zip(b.keys, b.inputs, mask) if m}
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = make_shards(tmp_path_factory.mktemp("dali"), n=N, per_shard=7, kind="png")
    return make_shards(root, n=10, per_shard=4, split="val", kind="png")


# ---------------------------------------------------------------- the refusal (always runs)


def test_without_dali_the_key_is_refused_with_the_install_hint(shards, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import nvidia.dali raises ImportError
    with pytest.raises(UserError, match=r"data.decoder=dali needs NVIDIA DALI.*pip install 'hpctrain\[dali\]'") as err:
        require_dali()
    assert err.value.exit_code == EXIT_USER_ERROR == 2 and "\n" not in str(err.value)
    assert not dali_available()
    with pytest.raises(UserError, match="needs NVIDIA DALI"):
        check_dali(DataConfig(name="shards", path=str(shards), decoder="dali"), shards=True)
    with pytest.raises(UserError, match="needs NVIDIA DALI"):  # before any shard is read
        DaliShardedLoader(shards, ClusterEnv(), 4)
    check_dali(DataConfig(name="shards", path=str(shards)), shards=True)  # native: nothing to check


def test_dali_refuses_what_is_not_image_shards(tmp_path, capsys):
    with pytest.raises(UserError, match=r"data.name=mnist is not read from shards; hint: hpctrain data shard"):
        check_dali(DataConfig(decoder="dali"), shards=False)
    npy = make_shards(tmp_path, n=8, per_shard=4, kind="npy")
    with pytest.raises(UserError, match=r"hold \.npy; hint: data.decoder=native"):
        DaliShardedLoader(npy, ClusterEnv(), 4, decoder=PilDecoder)
    assert main(["config", "show", "data.decoder=nvjpeg"]) == 2
    assert "data.decoder='nvjpeg' is not allowed; choose one of: native, dali" in capsys.readouterr().err


# ---------------------------------------------------------------- order and resume, stand-in decoder


@pytest.mark.parametrize("world,workers", [(1, 0), (2, 1)])
def test_same_samples_same_order_as_the_native_loader(shards, world, workers):
    for rank in range(world):
        native = ShardedLoader(shards, env_of(rank, world), 3, seed=4, drop_last=False)
        dali = dali_loader(shards, rank, world, augment=None, workers=workers, drop_last=False)
        for epoch in (0, 1):
            native.set_epoch(epoch)
            dali.set_epoch(epoch)
            assert same(list(native), list(dali)), f"rank {rank} epoch {epoch}"  # pixels too: bit-identical
        assert dali.state_dict() == native.state_dict()


@pytest.mark.parametrize("world", [1, 2])
def test_mid_epoch_resume_is_bit_identical_with_augmentation(shards, world):
    for rank in range(world):
        full = dali_loader(shards, rank, world)
        full.set_epoch(1)
        expected = list(full)
        cut = dali_loader(shards, rank, world)
        cut.set_epoch(1)
        it = iter(cut)
        head = [next(it) for _ in range(2)]
        state = json.loads(json.dumps(cut.state_dict()))
        fresh = dali_loader(shards, rank, world, workers=1)  # another worker count: the same batches
        fresh.load_state_dict(state)
        fresh.set_epoch(1)
        assert same(head + list(fresh), expected)
        assert expected[0].inputs.shape == (3, 1, 6, 6)


def test_resume_at_another_world_size_gives_each_sample_its_pixels(shards):
    whole = dali_loader(shards, 0, 1, drop_last=False)
    reference = by_key(list(whole))  # epoch 0, one rank, never cut
    first, state = {}, None
    for rank in range(2):
        ld = dali_loader(shards, rank, 2, drop_last=False)
        it = iter(ld)
        first |= by_key([next(it) for _ in range(3)])
        state = ld.state_dict()
    rest = {}
    for rank in range(3):
        ld = dali_loader(shards, rank, 3, drop_last=False)
        ld.load_state_dict(state)
        rest |= by_key(list(ld))
    assert len(first) + len(rest) == N and sorted([*first, *rest]) == sorted(reference)
    assert all(torch.equal(x, reference[k]) for k, x in (first | rest).items())


def test_augmentation_is_per_sample_and_per_epoch(shards):
    ld = dali_loader(shards, 0, 1)
    e0 = by_key(list(ld))
    e1 = by_key(list(ld))  # the next pass is epoch 1
    assert e0.keys() == e1.keys() and ld.epoch == 2
    assert sum(not torch.equal(e0[k], e1[k]) for k in e0) > len(e0) // 2
    plan = plan_batch(AUG, list(range(2000)), train=True, seed=4, epoch=0, height=20, width=30)
    assert plan.boxes is not None and plan.flips is not None and plan.size == 6
    x, y, w, h = plan.boxes.T
    assert (x >= 0).all() and (y >= 0).all() and (x + w <= 30).all() and (y + h <= 20).all() and (w * h > 0).all()
    assert 0.45 < plan.flips.mean() < 0.55 and len({tuple(b) for b in plan.boxes}) > 1000
    again = plan_batch(AUG, [7, 3], train=True, seed=4, epoch=0, height=20, width=30)
    assert (again.boxes == plan.boxes[[7, 3]]).all()  # a sample's draw does not depend on its batch
    val = plan_batch(AUG, [0, 1], train=False, seed=4, epoch=0, height=20, width=30)
    assert val.flips is None and val.boxes.tolist() == [[6, 1, 18, 18]] * 2  # the centre 0.875 of the shorter side


def test_validation_is_exact_and_each_sample_once(shards):
    keys = []
    for rank in range(2):
        native = list(ShardedEvalLoader(shards, env_of(rank, 2), 4))
        dali = DaliShardedEvalLoader(shards, env_of(rank, 2), 4, decoder=PilDecoder)
        assert same(native, list(dali)) and dali.template().inputs.shape == (1, 1, 8, 8)
        keys += [k for b in native for k in b.keys]
    assert sorted(keys) == [f"s{i:05d}" for i in range(10)]
    cropped = list(DaliShardedEvalLoader(shards, ClusterEnv(), 4, decoder=PilDecoder, augment=AUG))
    assert cropped[0].inputs.shape == (4, 1, 6, 6) and same(cropped, list(DaliShardedEvalLoader(
        shards, ClusterEnv(), 4, decoder=PilDecoder, augment=AUG)))


def _with_bad_image(root: Path) -> Path:
    """Eight PNG samples, s00003's bytes not an image (its CRC is right: only the decoder finds it)."""
    def samples():
        for i in range(8):
            yield f"s{i:05d}", {"cls": b"1", "png": b"not a png" if i == 3 else png_bytes(pixels(i))}
    meta = {"source": "test", "classes": ["0", "1"], "decode": {"input": "png", "target": "cls", "scale": 255.0}}
    write_shards(samples(), root, "train", samples_per_shard=4, meta=meta)
    return root


def test_a_bad_image_stops_or_is_skipped_and_counted(tmp_path):
    root = _with_bad_image(tmp_path)
    with pytest.raises(CorruptSampleError, match=r"sample 's00003': cannot decode.*data.on_corrupt=skip"):
        list(DaliShardedLoader(root, ClusterEnv(), 4, decoder=PilDecoder, shuffle="none"))
    ld = DaliShardedLoader(root, ClusterEnv(), 4, decoder=PilDecoder, shuffle="none", on_corrupt="skip")
    batches = list(ld)
    assert batches[0].mask.tolist() == [True, True, True, False] and batches[1].mask is None
    assert not batches[0].inputs[3].any() and ld.stats() == {"skipped_samples": 1, "skipped_keys": ["s00003"]}


# ---------------------------------------------------------------- the real DALI CPU pipeline

needs_dali = pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI is not installed (pip install "
                                "'hpctrain[dali]'; 424 MB, so not in the test install)")


@needs_dali
def test_dali_cpu_pipeline_matches_native_and_the_stand_in(shards):
    native = ShardedLoader(shards, ClusterEnv(), 4, seed=4, drop_last=False)
    dali = DaliShardedLoader(shards, ClusterEnv(), 4, seed=4, drop_last=False, backend="cpu")
    assert same(list(native), list(dali))  # PNG: bit-identical pixels, same order
    flip = Augment(flip=True)  # crop and flip are exact in both; only resize kernels differ
    real = DaliShardedLoader(shards, ClusterEnv(), 4, seed=4, backend="cpu", augment=flip)
    stand_in = DaliShardedLoader(shards, ClusterEnv(), 4, seed=4, decoder=PilDecoder, augment=flip)
    assert same(list(real), list(stand_in))


@needs_dali
def test_dali_cpu_resume_is_bit_identical(shards):
    def loader() -> DaliShardedLoader:
        return DaliShardedLoader(shards, ClusterEnv(), 4, seed=4, backend="cpu", augment=AUG)
    full = list(loader())
    cut = loader()
    it = iter(cut)
    head = [next(it) for _ in range(3)]
    fresh = loader()
    fresh.load_state_dict(cut.state_dict())
    assert same(head + list(fresh), full) and full[0].inputs.shape == (4, 1, 6, 6)


def test_train_refuses_dali_before_start_without_it(shards, monkeypatch, tmp_path):
    from hpctrain.cli import main

    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    assert main(["train", "data.name=shards", f"data.path={shards}", "data.decoder=dali",
                 f"run.dir={tmp_path / 'r'}", "train.max_steps=1", "checkpoint.enabled=false"]) == 2
