"""The fixed token stream of the prepared GPU run (``benchmarks/gpu_run.py``), read alike by
hpctrain (``data.name=gpu_data:stream``) and by torchtitan (``benchmarks/gpu_titan.py``).

The stream is written once, here, by ``scripts/gpu_carry.sh`` (``python -m gpu_data --write``)
and carried to the GPU as a file, so both trainers read the same bytes in the same order and
the run's JSON can name them by their sha256. Its tokens walk one fixed random cycle through
Llama 3's vocabulary (128,256 ids) and jump to a random id at a tenth of the positions: the next
token is mostly a function of the current one, so the loss falls and fp8's loss can be held
against bf16's (uniform random ids would sit at ln(vocab) whatever the precision did).

Window ``i`` is tokens ``[i*seq_len, i*seq_len + seq_len + 1)``: windows overlap by one token, as
GPT-style pretraining cuts a stream. A model whose vocabulary is smaller than the stream's (the
rehearsal's tiny shapes) reads the ids modulo its vocabulary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

VOCAB = 128_256     # Llama 3's
TOKENS = 1 << 20    # 4 MiB as uint32: 128 windows of 8,192 tokens, more than any row reads before wrapping
NOISE = 0.1         # share of positions that jump to a random id
SEED = 0


def make_stream(n: int = TOKENS, vocab: int = VOCAB, seed: int = SEED) -> np.ndarray:
    """``n`` uint32 ids along the cycle (see the module's docstring), the same for the same arguments."""
    rng = np.random.default_rng(seed)
    cycle = rng.permutation(vocab).astype(np.uint32)
    jumps = rng.random(n) < NOISE
    jumps[0] = True
    targets = rng.integers(vocab, size=n)
    index = np.arange(n)
    starts = np.maximum.accumulate(np.where(jumps, index, 0))  # where the current run along the cycle began
    return cycle[(targets[starts] + index - starts) % vocab]


@dataclass(frozen=True)
class StreamSpec:
    """What ``data.path`` names (a JSON file): the stream, the window length, the model's vocabulary."""

    tokens: str
    seq_len: int
    vocab: int
    samples: int  # training windows; validation reads the next max(1, samples // 64)


class StreamWindows(Dataset[torch.Tensor]):
    """``count`` windows of ``seq_len + 1`` int64 ids from window ``first`` on, wrapping at the stream's end."""

    def __init__(self, spec: StreamSpec, count: int, first: int = 0) -> None:
        self.spec, self.count, self.first = spec, count, first
        self.ids = np.load(spec.tokens, mmap_mode="r")
        self.windows = (len(self.ids) - 1) // spec.seq_len
        if self.windows < 1:
            raise ValueError(f"{spec.tokens}: {len(self.ids)} tokens hold no window of {spec.seq_len + 1}")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.count:
            raise IndexError(index)
        start = ((self.first + index) % self.windows) * self.spec.seq_len
        window = np.asarray(self.ids[start : start + self.spec.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(window % self.spec.vocab)

    def batch(self, first: int, size: int) -> torch.Tensor:
        """Windows ``first .. first + size - 1`` (wrapping), stacked: ``(size, seq_len + 1)``."""
        return torch.stack([self[(first + i) % self.count] for i in range(size)])


def write_spec(path: Path, spec: StreamSpec) -> Path:
    path.write_text(json.dumps(asdict(spec)) + "\n")
    return path


def read_spec(path: str | Path) -> StreamSpec:
    return StreamSpec(**json.loads(Path(path).read_text()))


def stream(path: str) -> dict[str, Any]:
    """The ``data.name=gpu_data:stream`` mapping: training windows, then a small disjoint validation set."""
    spec = read_spec(path)
    val = max(1, spec.samples // 64)
    return {"train": StreamWindows(spec, spec.samples), "val": StreamWindows(spec, val, first=spec.samples),
            "task": "causal_lm", "vocab_size": spec.vocab}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(folder: Path) -> dict[str, Any]:
    """Every file of a carry folder with its bytes and sha256 (written as MANIFEST.json)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    return {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="write the token stream (uint32 .npy) here")
    parser.add_argument("--manifest", type=Path, help="write FOLDER/MANIFEST.json of a carry folder")
    args = parser.parse_args(argv)
    if args.write:
        np.save(args.write, make_stream())
    if args.manifest:
        (args.manifest / "MANIFEST.json").write_text(json.dumps(manifest(args.manifest), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
