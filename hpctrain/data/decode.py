"""Decoding a sample's fields (images, ``.npy`` arrays, labels, JSON, text) and converting a batch
of stacked raw inputs to the model's input (:class:`InputConversion`)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpctrain.data.batch import as_model_input
from hpctrain.data.manifest import IMAGE_EXTS, LABEL_EXTS

_NPY_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], bool]] = {}


def decode_npy(data: bytes) -> np.ndarray:
    """np.load costs ~47 us per small array here; the header is parsed once per distinct header."""
    if data[:6] != b"\x93NUMPY":
        raise ValueError("not an .npy payload")
    hlen = int.from_bytes(data[8:10], "little") if data[6] == 1 else int.from_bytes(data[8:12], "little")
    body = 10 + hlen if data[6] == 1 else 12 + hlen
    head = data[:body]
    parsed = _NPY_HEADERS.get(head)
    if parsed is None:
        fh = io.BytesIO(head)
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)  # numpy's own header parser
        parsed = _NPY_HEADERS.setdefault(head, (dtype, shape, fortran))
    dtype, shape, fortran = parsed
    arr = np.frombuffer(data, dtype=dtype, offset=body)
    return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)


_PIL_FORMATS = ("PNG", "JPEG")


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _spng() -> Any:
    """``pyspng`` (libspng) when installed: ~3x faster than PIL on small PNGs, same pixels."""
    global _SPNG
    if _SPNG is None:
        try:
            import pyspng  # type: ignore[import-untyped,import-not-found]  # optional, no stubs

            _SPNG = pyspng.load
        except ImportError:
            _SPNG = False
    return _SPNG


_SPNG: Any = None


def decode_image(data: bytes) -> np.ndarray:
    """uint8 HxW (grayscale) or HxWx3 pixels; anything but 8-bit gray/RGB is converted to RGB by PIL."""
    # IHDR: bit depth at byte 24, colour type at 25 (0 = gray, 2 = RGB); those decode as they are
    if data[:8] == _PNG_SIGNATURE and data[24:26] in (b"\x08\x00", b"\x08\x02") and (spng := _spng()):
        return spng(data)
    from PIL import Image

    # No ``with``: the image holds only this in-memory buffer, and closing it costs ~4 us a sample.
    img: Image.Image = Image.open(io.BytesIO(data), formats=_PIL_FORMATS)  # no probing of every plugin
    if img.mode not in ("L", "RGB"):
        img = img.convert("RGB")
    # the pixels PIL decoded, as np.asarray(img) gives them, without its array-interface detour
    shape = (img.height, img.width) if img.mode == "L" else (img.height, img.width, 3)
    return np.frombuffer(img.tobytes(), dtype=np.uint8).reshape(shape)


@dataclass(frozen=True)
class InputConversion:
    """How a batch of stacked raw inputs becomes the model's input, from the manifest's decode
    info: HWC images to NCHW, then ``/ scale`` and ``(x - mean) / std`` when given. Arrays of
    integers other than uint8 (token ids, integer features) stay integers, as int64. A value,
    not a method, so that a worker's :class:`PackedBatch` carries it to the main process."""

    image: bool
    scale: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @classmethod
    def of(cls, info: dict[str, Any], input_field: str) -> InputConversion:
        mean, std = info.get("mean"), info.get("std")
        return cls(image=input_field.rsplit(".", 1)[-1] in IMAGE_EXTS or info.get("layout") == "hwc",
                   scale=float(info["scale"]) if info.get("scale") else None,
                   mean=None if mean is None else tuple(mean), std=None if std is None else tuple(std))

    def __call__(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if self.image:  # NCHW in uint8 first: a quarter of the bytes to move as float (same values)
            t = (t.unsqueeze(1) if t.ndim == 3 else t.permute(0, 3, 1, 2)).contiguous()
        return self.scaled(t)

    def scaled(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (images: NCHW uint8, e.g. DALI's, on any device) as the model's input: the same
        operations in the same order whichever decoder made the pixels, so the same values."""
        if not (self.image or self.scale or self.mean is not None):
            return as_model_input(t).contiguous()
        x = t.float()
        if self.scale:
            x = x.div_(self.scale)
        if self.mean is not None and self.std is not None:
            shape = (1, -1) + (1,) * (x.ndim - 2)
            mean, std = (torch.tensor(v, device=x.device).view(shape) for v in (self.mean, self.std))
            x = (x - mean) / std
        return x.contiguous()


def decode_field(ext: str, data: bytes) -> Any:
    """png/jpg -> uint8 HxW[xC] array; npy -> array; cls -> int; json -> object; txt -> str; else bytes."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last in IMAGE_EXTS:
        return decode_image(data)
    if last == "npy":
        return decode_npy(data)
    if last in LABEL_EXTS:
        return int(data.decode().strip())
    if last == "json":
        return json.loads(data)
    if last in ("txt", "text"):
        return data.decode()
    return data
