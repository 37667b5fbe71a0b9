"""Image shards of any size for the cases that need them (amp at a small input, workers).

Packed the way ``hpctrain data shard npz:PATH`` packs (its source reader and writer), from
the library's synthetic images; labels cycle through all ten classes so every split,
however small, names the same classes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpctrain.data.sources import open_source
from hpctrain.data.synthetic import synthetic
from hpctrain.data.writer import write_shards


def image_shards(root: Path, shape: tuple[int, ...], sizes: dict[str, int], shards: int = 16) -> Path:
    """``root`` holding one split per entry of ``sizes`` (samples), each in about ``shards`` files."""
    root.mkdir(parents=True, exist_ok=True)
    for split, count in sizes.items():
        arrays = root.parent / f"{root.name}-{split}.npz"
        images = synthetic(split, count, shape).inputs.numpy()
        np.savez(arrays, x=images, y=np.arange(count) % 10)
        source = open_source(f"npz:{arrays}", split)
        write_shards(source.samples, root, split, samples_per_shard=max(1, -(-count // shards)), meta=source.meta)
        arrays.unlink()
    return root
