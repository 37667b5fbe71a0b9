"""``data.decoder=dali``: image shards decoded (and augmented) by NVIDIA DALI, in hpctrain's order.

hpctrain keeps everything that makes a run exact: the epoch order, the rank x worker split, the
resumable position (:class:`~hpctrain.data.loader.ShardedLoader`'s, unchanged), the CRC checks and
``data.on_corrupt``. Its DataLoader workers read each batch's *encoded* bytes
(:class:`EncodedShardDataset`); in the training process a :class:`BatchDecoder` turns them into
uint8 NCHW pixels: :class:`DaliDecoder` runs a DALI pipeline fed through ``external_source``,
"mixed" (nvJPEG / nvImageCodec on the GPU) under CUDA and DALI's CPU backend elsewhere. The
manifest's scale/mean/std are then applied by the same torch code as the native decoder's
(:meth:`~hpctrain.data.decode.InputConversion.scaled`), on the device the pixels lie on, so
without augmentation a PNG split gives bit-identical inputs with either decoder.

Augmentation (:class:`Augment`: random resized crop, horizontal flip) is drawn by hpctrain, not by
DALI: DALI's random operators draw from one generator per operator, advanced sample after sample
in pipeline order, so a restart mid-epoch, another world size or another worker count would draw
other crops. Here each sample's crop box and flip come from a counter-based hash of (seed, epoch,
global sample id) (:func:`plan_batch`), and DALI only applies them with deterministic operators
(``decoders.image_slice``, ``resize``, ``crop_mirror_normalize(mirror=...)``): a sample gets the
same pixels however the run was cut. Validation uses the deterministic centre crop only.
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, Protocol, cast

import numpy as np
import torch
import torch.utils.data
from torch.utils.data import Sampler

from hpctrain.config.data import DataConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import UserError
from hpctrain.data.batch import Batch
from hpctrain.data.decode import decode_field, decode_image
from hpctrain.data.errors import CorruptSampleError
from hpctrain.data.loader import ShardedEvalLoader, ShardedLoader
from hpctrain.data.manifest import IMAGE_EXTS
from hpctrain.data.position import PAD
from hpctrain.data.shard_dataset import ShardDataset
from hpctrain.data.workers import WorkerError, in_worker, make_loader

log = logging.getLogger("hpctrain")

INSTALL_HINT = ("pip install 'hpctrain[dali]' (NVIDIA DALI for CUDA 12: nvidia-dali-cuda120; for CUDA 13: pip install "
                "nvidia-dali-cuda130); DALI's CPU backend needs no GPU")
Backend = Literal["auto", "cpu", "gpu"]
_AUG_TAG = 0x6175676D  # "augm": the augmentation's hash stream, apart from every other use of the seed
_ATTEMPTS = 10  # random resized crop: boxes tried before the centre-crop fallback (the usual recipe's count)


# ---------------------------------------------------------------- DALI itself


def require_dali() -> ModuleType:
    """``nvidia.dali``, or the refusal a run gets before it starts (exit 2, the install hint)."""
    try:
        import nvidia.dali as dali  # type: ignore[import-not-found,import-untyped,unused-ignore]  # optional, no stubs
    except ImportError as err:
        raise UserError(f"data.decoder=dali needs NVIDIA DALI, which is not installed here ({err}); hint: "
                        f"{INSTALL_HINT}; or data.decoder=native") from None
    return dali


def dali_available() -> bool:
    try:
        require_dali()
    except UserError:
        return False
    return True


# ---------------------------------------------------------------- what a worker sends


@dataclass
class EncodedBatch:
    """One batch as a worker reads it for DALI: each slot's encoded image (uint8, 1-D), its class,
    shard key and global sample id; PAD and skipped slots repeat a real sample's bytes, masked
    (key ``""`` = padding, a key = skipped, as in :class:`~hpctrain.data.batch.Batch`)."""

    data: list[np.ndarray]
    targets: list[int]
    keys: list[str]
    ids: list[int]
    mask: list[bool] | None = None

    def pin_memory(self) -> EncodedBatch:
        return self  # encoded bytes: nothing worth pinning (DataLoader's pin thread calls this)


class EncodedShardDataset(ShardDataset):
    """A :class:`ShardDataset` whose batches (``__getitems__``) keep the input image encoded: read
    and checked (length, CRC-32, label) like the native path, decoded later by a BatchDecoder.
    ``batch()`` still decodes natively (templates, the data's layout)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.input_field.rsplit(".", 1)[-1] not in IMAGE_EXTS or self.transform is not None:
            raise UserError(f"data.decoder=dali decodes images, but the samples of {self.index.root} hold "
                            f".{self.input_field}; hint: data.decoder=native")
        self._fill_bytes: np.ndarray | None = None

    def __getitems__(self, ids: list[int]) -> EncodedBatch | WorkerError:  # type: ignore[override]
        return in_worker(self.encoded, ids)

    def read_encoded(self, gid: int) -> dict[str, Any]:
        """One sample's fields, the input image left encoded (``np.uint8`` view), the rest decoded."""
        ix = self.index
        shard, start, size = self._span(gid)
        data = self._remote().read(shard, start, size) if ix.remote else self._pread(gid, shard, start, size)
        if len(data) != int(ix.length[gid]) or zlib.crc32(data) != int(ix.crc[gid]):
            self._raise_corrupt(gid, data)
        sample: dict[str, Any] = {"__key__": ix.keys[gid]}
        offs = ix.offsets[gid]
        for j, ext in enumerate(ix.fields):
            part = data[offs[2 * j] : offs[2 * j] + offs[2 * j + 1]]
            if ext == self.input_field:
                sample[ext] = np.frombuffer(part, dtype=np.uint8)
            elif ext == self.target_field:
                try:
                    sample[ext] = decode_field(ext, part)
                except Exception as err:  # any decoder failure is a bad sample, named
                    raise CorruptSampleError(f"{self._where(gid)}: cannot decode: {err}") from err
        self._label(gid, sample)
        return sample

    def _pread(self, gid: int, shard: int, start: int, size: int) -> bytes:
        try:
            return os.pread(self._fd(shard), size, start)
        except OSError as err:  # EIO of a bad sector; ESPIPE of a shard replaced by a FIFO
            raise CorruptSampleError(f"{self._where(gid)}: cannot be read: {err.strerror}; hint: hpctrain data verify "
                                     f"{self.index.root}") from err

    def _encoded_or_skip(self, gid: int) -> dict[str, Any] | None:
        try:
            return self.read_encoded(gid)
        except CorruptSampleError as err:
            if self.on_corrupt == "stop":
                raise
            log.warning("skipping a bad sample: %s", err)
            return None

    def encoded(self, ids: list[int]) -> EncodedBatch:
        """The samples ``ids`` (PAD: a masked padding slot), read in file order, left encoded."""
        real = sorted({g for g in ids if g != PAD}, key=lambda g: (self.index.shard_of[g], self.index.start[g]))
        if self.index.remote:  # the batch's ranges fetched in parallel
            self._remote().prefetch(self._span(g) for g in real)
        samples = {g: self._encoded_or_skip(g) for g in real}
        good = [s for s in samples.values() if s is not None]
        fill = good[0][self.input_field] if good else self.fill_bytes()
        data, targets, keys, mask = [], [], [], []
        for g in ids:
            sample = samples.get(g)
            data.append(sample[self.input_field] if sample is not None else fill)
            targets.append(self._label(g, sample) if sample is not None else 0)
            keys.append(self.index.keys[g] if g != PAD else "")
            mask.append(sample is not None)
        return EncodedBatch(data, targets, keys, list(ids), None if all(mask) else mask)

    def fill_bytes(self) -> np.ndarray:
        """The first readable sample's encoded image: what a batch of only padding repeats."""
        if self._fill_bytes is None:
            for gid in range(len(self.index)):
                sample = self._encoded_or_skip(gid)
                if sample is not None:
                    self._fill_bytes = sample[self.input_field]
                    break
            else:
                raise CorruptSampleError(f"{self.index.root}: no sample of split {self.index.split} can be read")
        return self._fill_bytes


# ---------------------------------------------------------------- the augmentation plan


@dataclass(frozen=True)
class Augment:
    """Training augmentations (validation: the deterministic centre crop of ``val_crop`` of the
    shorter side, resized to ``size``). ``size``: random resized crop to ``size`` x ``size``
    (area fraction in ``scale``, aspect ratio log-uniform in ``ratio``); None = the image's own
    size, no crop. ``flip``: horizontal flip with probability 1/2."""

    size: int | None = None
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = False
    val_crop: float = 0.875

    def __post_init__(self) -> None:
        lo, hi = self.scale
        r0, r1 = self.ratio
        if self.size is not None and self.size <= 0:
            raise UserError(f"augment size={self.size} must be > 0")
        if not (0 < lo <= hi <= 1) or not (0 < r0 <= r1) or not (0 < self.val_crop <= 1):
            raise UserError(f"augment scale={self.scale} must be 0 < lo <= hi <= 1, ratio={self.ratio} 0 < lo <= hi, "
                            f"val_crop={self.val_crop} in (0, 1]")

    @property
    def active(self) -> bool:
        return self.size is not None or self.flip


@dataclass(frozen=True)
class Plan:
    """What a decoder does to one batch: per slot a crop box ``(x, y, w, h)`` in pixels (None: the
    whole image), a horizontal flip (None: none), and the output ``size`` (None: the box's)."""

    boxes: np.ndarray | None = None  # (B, 4) int64
    flips: np.ndarray | None = None  # (B,) bool
    size: int | None = None


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over uint64 arrays (a bijection that scrambles every bit)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_uniforms(seed: int, epoch: int, ids: list[int], n: int) -> np.ndarray:
    """(len(ids), n) uniforms in [0, 1) that depend on (seed, epoch, sample id) alone: counter-based,
    so no generator state is carried from batch to batch (nothing to save, nothing to replay)."""
    key = _splitmix(np.array([seed & (2**64 - 1)], dtype=np.uint64) ^ np.uint64(_AUG_TAG))
    key = _splitmix(key ^ np.uint64(epoch & (2**64 - 1)))
    gid = np.array(ids, dtype=np.int64).astype(np.uint64)[:, None]
    bits = _splitmix(_splitmix(key ^ gid) ^ np.arange(n, dtype=np.uint64)[None, :])
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _random_boxes(u: np.ndarray, height: int, width: int, aug: Augment) -> np.ndarray:
    """Random resized crop boxes from uniforms ``u`` (B, 4 * attempts): the first of the attempts
    whose box fits the image, else the centre crop at the nearest allowed aspect ratio."""
    u = u.reshape(len(u), _ATTEMPTS, 4)
    area = height * width * (aug.scale[0] + (aug.scale[1] - aug.scale[0]) * u[..., 0])
    log_r0, log_r1 = math.log(aug.ratio[0]), math.log(aug.ratio[1])
    aspect = np.exp(log_r0 + (log_r1 - log_r0) * u[..., 1])
    w, h = np.rint(np.sqrt(area * aspect)).astype(np.int64), np.rint(np.sqrt(area / aspect)).astype(np.int64)
    fits = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    first, rows = fits.argmax(axis=1), np.arange(len(u))
    w, h = w[rows, first], h[rows, first]
    x = np.floor(u[rows, first, 2] * (width - w + 1)).astype(np.int64)
    y = np.floor(u[rows, first, 3] * (height - h + 1)).astype(np.int64)
    boxes = np.stack([x, y, w, h], axis=1)
    boxes[~fits.any(axis=1)] = _centre_box(height, width, aug)
    return boxes


def _centre_box(height: int, width: int, aug: Augment) -> np.ndarray:
    """The whole image, cut to the allowed aspect ratios, centred (the fallback of a failed draw)."""
    w, h = width, height
    if width / height < aug.ratio[0]:
        h = round(width / aug.ratio[0])
    elif width / height > aug.ratio[1]:
        w = round(height * aug.ratio[1])
    return np.array([(width - w) // 2, (height - h) // 2, w, h], dtype=np.int64)


def plan_batch(aug: Augment | None, ids: list[int], *, train: bool, seed: int, epoch: int,
               height: int, width: int) -> Plan:
    """The batch's crops and flips: drawn per sample from (seed, epoch, id) in training, the fixed
    centre crop in validation; the same for a sample whatever batch, rank or worker it is in."""
    if aug is None or not aug.active:
        return Plan()
    if not train:
        if aug.size is None:
            return Plan()
        side = max(1, round(min(height, width) * aug.val_crop))
        box = np.array([(width - side) // 2, (height - side) // 2, side, side], dtype=np.int64)
        return Plan(boxes=np.tile(box, (len(ids), 1)), size=aug.size)
    u = sample_uniforms(seed, epoch, ids, 4 * _ATTEMPTS + 1)
    boxes = _random_boxes(u[:, :-1], height, width, aug) if aug.size is not None else None
    flips = u[:, -1] < 0.5 if aug.flip else None
    return Plan(boxes, flips, aug.size)


# ---------------------------------------------------------------- decoders


class BatchDecoder(Protocol):
    """Encoded images and their :class:`Plan` -> uint8 NCHW pixels (on the decoder's device)."""

    def __call__(self, data: list[np.ndarray], plan: Plan) -> torch.Tensor: ...


class DaliDecoder:
    """A DALI pipeline over ``external_source``: decode (``mixed`` on a GPU, ``cpu`` otherwise),
    the plan's crop (``decoders.image_slice``: only the box is decoded where the codec can),
    resize, flip and HWC -> CHW (``crop_mirror_normalize`` in uint8). One pipeline per plan shape,
    built on first use; synchronous (``exec_pipelined=False``), so each output is exactly the batch
    just fed, whatever came before."""

    def __init__(self, batch_size: int, *, gray: bool, backend: Backend = "auto", device_id: int | None = None,
                 num_threads: int | None = None) -> None:
        self.dali = require_dali()
        if backend == "auto":
            backend = "gpu" if torch.cuda.is_available() else "cpu"
        self.backend, self.batch_size, self.gray = backend, batch_size, gray
        self.device_id = (device_id if device_id is not None else torch.cuda.current_device()) if backend == "gpu" \
            else None
        self.num_threads = num_threads or max(1, min(4, len(os.sched_getaffinity(0))))
        self._pipes: dict[tuple[bool, bool, int | None], Any] = {}

    def _pipe(self, crop: bool, flip: bool, size: int | None) -> Any:
        key = (crop, flip, size)
        if key not in self._pipes:
            self._pipes[key] = self._build(crop, flip, size)
        return self._pipes[key]

    def _build(self, crop: bool, flip: bool, size: int | None) -> Any:
        import nvidia.dali.fn as fn  # type: ignore[import-not-found,import-untyped,unused-ignore]
        import nvidia.dali.types as types  # type: ignore[import-not-found,import-untyped,unused-ignore]

        pipe = self.dali.Pipeline(batch_size=self.batch_size, num_threads=self.num_threads, device_id=self.device_id,
                                  exec_pipelined=False, exec_async=False, prefetch_queue_depth=1)
        decode = "mixed" if self.backend == "gpu" else "cpu"
        colour = types.GRAY if self.gray else types.RGB
        with pipe:
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            if crop:
                anchor = fn.external_source(name="anchor", dtype=types.FLOAT, ndim=1)
                shape = fn.external_source(name="shape", dtype=types.FLOAT, ndim=1)
                img = fn.decoders.image_slice(encoded, anchor, shape, device=decode, output_type=colour,
                                              normalized_anchor=False, normalized_shape=False, axis_names="WH")
            else:
                img = fn.decoders.image(encoded, device=decode, output_type=colour)
            if size is not None:
                img = fn.resize(img, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR)
            mirror = fn.external_source(name="flip", dtype=types.INT32, ndim=0) if flip else 0
            pipe.set_outputs(fn.crop_mirror_normalize(img, dtype=types.UINT8, output_layout="CHW", mirror=mirror))
        pipe.build()
        return pipe

    def __call__(self, data: list[np.ndarray], plan: Plan) -> torch.Tensor:
        from nvidia.dali.plugin.pytorch import feed_ndarray  # type: ignore[import-not-found,import-untyped,unused-ignore]

        pipe = self._pipe(plan.boxes is not None, plan.flips is not None, plan.size)
        pipe.feed_input("encoded", data)
        if plan.boxes is not None:
            pipe.feed_input("anchor", [b[:2].astype(np.float32) for b in plan.boxes])
            pipe.feed_input("shape", [b[2:].astype(np.float32) for b in plan.boxes])
        if plan.flips is not None:
            pipe.feed_input("flip", [np.array(f, dtype=np.int32) for f in plan.flips])
        (out,) = pipe.run()
        if self.backend == "gpu":
            tensor = out.as_tensor()
            pixels = torch.empty(tensor.shape(), dtype=torch.uint8, device=f"cuda:{self.device_id}")
            feed_ndarray(tensor, pixels, cuda_stream=torch.cuda.current_stream(self.device_id))
            return pixels
        return torch.from_numpy(np.array(out.as_tensor()))  # a copy: DALI reuses its buffers on the next run


# ---------------------------------------------------------------- decoding batches in the training process


@dataclass(frozen=True)
class Decoding:
    """How the training process turns an :class:`EncodedBatch` into a :class:`Batch`: the plan
    (crops, flips) for its sample ids, the decoder, then the manifest's scale/mean/std."""

    decoder: BatchDecoder
    dataset: EncodedShardDataset
    augment: Augment | None
    train: bool
    seed: int
    height: int
    width: int

    def __call__(self, batch: EncodedBatch, epoch: int) -> Batch:
        plan = plan_batch(self.augment, batch.ids, train=self.train, seed=self.seed, epoch=epoch,
                          height=self.height, width=self.width)
        try:
            pixels = self.decoder(batch.data, plan)
        except Exception as err:  # noqa: BLE001 - DALI raises RuntimeError for a bad image: find which ones
            pixels = self.decoder(self._without_bad(batch, err).data, plan)
        mask = None if batch.mask is None else torch.tensor(batch.mask, dtype=torch.bool)
        if mask is not None:  # masked slots hold zeros, as the native decoder's batches do
            pixels[~mask.to(pixels.device)] = 0
        conversion = self.dataset._conversion  # the native decoder's, applied where the pixels lie
        return Batch(conversion.scaled(pixels), torch.tensor(batch.targets, dtype=torch.int64), batch.keys, mask)

    def _without_bad(self, batch: EncodedBatch, err: Exception) -> EncodedBatch:
        """The samples the native decoder refuses too: the run stops naming the first, or (data.on_corrupt=skip)
        they are masked, their slots filled with a good sample's bytes (``batch`` changed in place)."""
        bad = [i for i, data in enumerate(batch.data) if not _decodes(data)]
        if not bad:  # DALI alone refuses what PIL reads: not the sample's fault, a decoder limitation
            raise CorruptSampleError(f"DALI cannot decode a batch that the native decoder reads ({_line(err)}); "
                                     "hint: data.decoder=native") from None
        first = self.dataset._where(batch.ids[bad[0]])
        if self.dataset.on_corrupt == "stop":
            raise CorruptSampleError(f"{first}: cannot decode ({_line(err)}); hint: hpctrain data verify "
                                     f"{self.dataset.index.root}; data.on_corrupt=skip skips bad samples") from None
        good = next((d for i, d in enumerate(batch.data) if i not in bad), None)
        fill = good if good is not None else self.dataset.fill_bytes()
        mask = batch.mask or [True] * len(batch.data)
        for i in bad:
            log.warning("skipping a bad sample: %s: cannot decode", self.dataset._where(batch.ids[i]))
            batch.data[i], mask[i] = fill, False
        batch.mask = mask
        return batch


def _decodes(data: np.ndarray) -> bool:
    try:
        decode_image(data.tobytes())
    except Exception:  # noqa: BLE001 - any failure of the native decoder: a bad image
        return False
    return True


def _line(err: Exception) -> str:
    """The first line of DALI's error (its messages carry a C++ stack below it)."""
    return str(err).strip().split("\n")[0]


class _DecodedBatches:
    """A DataLoader's :class:`EncodedBatch` items decoded in this process (worker errors passed on
    as they are, for :func:`~hpctrain.data.workers.raise_worker_errors`)."""

    def __init__(self, loader: torch.utils.data.DataLoader, decoding: Decoding, epoch: Callable[[], int]) -> None:
        self.loader, self.decoding, self.epoch = loader, decoding, epoch

    def __iter__(self) -> Iterator[Batch | WorkerError]:
        epoch = self.epoch()  # the pass's epoch: fixed when iter() began (the loader's _begin_pass)
        for item in self.loader:
            yield item if isinstance(item, WorkerError) else self.decoding(item, epoch)

    def __len__(self) -> int:
        return len(self.loader)


def _decoding(dataset: EncodedShardDataset, decoder: Callable[[int, bool], BatchDecoder] | None,
              where: tuple[Backend, int | None], batch_size: int, augment: Augment | None, *, train: bool,
              seed: int) -> Decoding:
    """The decoding of ``dataset``'s batches, sized by its first readable image (a split holds one
    size and mode: the shard writer's check)."""
    first = decode_image(dataset.fill_bytes().tobytes())
    gray = first.ndim == 2
    made = decoder(batch_size, gray) if decoder is not None else \
        DaliDecoder(batch_size, gray=gray, backend=where[0], device_id=where[1])
    return Decoding(made, dataset, augment, train, seed, first.shape[0], first.shape[1])


class DaliShardedLoader(ShardedLoader):
    """A :class:`ShardedLoader` (the same order, split, position, ``state_dict`` and skip counting)
    whose workers read encoded images and whose batches a :class:`BatchDecoder` decodes here.
    ``decoder``: a callable ``(batch_size, gray) -> BatchDecoder``; default :class:`DaliDecoder`
    on ``backend``."""

    def __init__(self, root: str | Path, env: ClusterEnv, batch_size: int, *, augment: Augment | None = None,
                 decoder: Callable[[int, bool], BatchDecoder] | None = None, backend: Backend = "auto",
                 device_id: int | None = None, seed: int = 0, num_workers: int = 0, prefetch_factor: int = 2,
                 persistent_workers: bool = True,
                 **kwargs: Any) -> None:
        if decoder is None:
            require_dali()  # before any shard is opened
        super().__init__(root, env, batch_size, seed=seed, num_workers=num_workers, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers, **kwargs)
        # the native dataset's DataLoader started no worker yet: swap in the encoded one
        self.encoded = self.dataset = EncodedShardDataset(self.index, on_corrupt=self.dataset.on_corrupt,
                                                          readahead=self.dataset.readahead)
        self.decoding = _decoding(self.encoded, decoder, (backend, device_id), batch_size, augment, train=True,
                                  seed=seed)
        # pin_memory off: the workers send encoded bytes; the pixels come from DALI (on the GPU there)
        inner = make_loader(self.encoded, self._sampler, num_workers, prefetch_factor, False, persistent_workers)
        self._loader = _DecodedBatches(inner, self.decoding, lambda: self.epoch)  # type: ignore[assignment]

    def input_shape(self) -> tuple[int, ...]:
        """One decoded input's shape (C, H, W): the augmentation's size where it crops."""
        return tuple(self.template().inputs.shape[1:])

    def template(self) -> Batch:
        return self.decoding(self.encoded.encoded([0]), 0)


class DaliShardedEvalLoader(ShardedEvalLoader):
    """A :class:`ShardedEvalLoader` (each rank's contiguous share, in file order) decoded by a
    :class:`BatchDecoder`; with an :class:`Augment` of a ``size``: its deterministic centre crop."""

    def __init__(self, root: str | Path, env: ClusterEnv, batch_size: int, *, augment: Augment | None = None,
                 decoder: Callable[[int, bool], BatchDecoder] | None = None, backend: Backend = "auto",
                 device_id: int | None = None, num_workers: int = 0, prefetch_factor: int = 2,
                 **kwargs: Any) -> None:
        if decoder is None:
            require_dali()
        super().__init__(root, env, batch_size, num_workers=num_workers, prefetch_factor=prefetch_factor, **kwargs)
        self.encoded = self.dataset = EncodedShardDataset(self.index, on_corrupt=self.dataset.on_corrupt)
        self.decoding = _decoding(self.encoded, decoder, (backend, device_id), batch_size, augment, train=False, seed=0)
        sampler = cast(Sampler, self._loader.batch_sampler)  # the rank's batches, set by ShardedEvalLoader
        inner = make_loader(self.encoded, sampler, num_workers, prefetch_factor, False, False)
        self._loader = _DecodedBatches(inner, self.decoding, lambda: 0)  # type: ignore[assignment]

    def template(self) -> Batch:
        return self.decoding(self.encoded.encoded([0]), 0)


# ---------------------------------------------------------------- from the config (hpctrain.data.build)


def check_dali(data: DataConfig, *, shards: bool) -> None:
    """``data.decoder=dali`` refused before the run starts (exit 2): DALI missing, or a source
    that is not image shards (in-memory data, tables, your own datasets)."""
    if data.decoder != "dali":
        return
    if not shards:
        raise UserError(f"data.decoder=dali decodes image shards, and data.name={data.name} is not read from "
                        "shards; hint: hpctrain data shard SOURCE DIR, then data.name=shards data.path=DIR "
                        "(or data.decoder=native)")
    require_dali()


def _backend(device: torch.device) -> tuple[Backend, int | None]:
    return ("gpu", device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else ("cpu", None)


def dali_train_loader(data: DataConfig, env: ClusterEnv, device: torch.device, *, seed: int, root: Path,
                      augment: Augment | None = None) -> DaliShardedLoader:
    """The training loader of ``data.decoder=dali``: ``ShardedLoader``'s arguments, DALI on ``device``'s kind."""
    backend, device_id = _backend(device)
    return DaliShardedLoader(root, env, data.batch_size, augment=augment, backend=backend, device_id=device_id,
                             split="train", seed=seed, shuffle=data.shuffle, shuffle_window=data.shuffle_window,
                             drop_last=data.drop_last, num_workers=data.num_workers,
                             prefetch_factor=data.prefetch_factor, persistent_workers=data.persistent_workers,
                             on_corrupt=data.on_corrupt, max_samples=data.max_train_samples)


def dali_val_loader(data: DataConfig, env: ClusterEnv, device: torch.device, *, root: Path, batch_size: int,
                    augment: Augment | None = None) -> DaliShardedEvalLoader:
    """The validation loader of ``data.decoder=dali`` (``data.val_split``, each sample once over the ranks)."""
    backend, device_id = _backend(device)
    return DaliShardedEvalLoader(root, env, batch_size, augment=augment, backend=backend, device_id=device_id,
                                 split=data.val_split, on_corrupt=data.on_corrupt, max_samples=data.max_val_samples,
                                 num_workers=data.num_workers, prefetch_factor=data.prefetch_factor)
