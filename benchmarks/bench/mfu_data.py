"""The token windows ``hpctrain bench mfu`` trains on, the same for hpctrain and torchtitan.

A window is ``seq_len + 1`` token ids read along one fixed random cycle through the whole
vocabulary, starting at a place drawn per window, with a tenth of the positions replaced by
random tokens. The next token is thus mostly a function of the current one (a bigram table
the model can learn), so the loss falls and an fp8 run's loss can be held against bf16's,
where uniform random tokens would sit at ln(vocab) whatever the precision did. Window ``i``
depends only on (seed, i): both trainers read the same windows in the same order, and no
file is needed on a GPU node that cannot download one.

``hpctrain train data.name=bench.mfu_data:windows data.path=SPEC.json`` reads the
vocabulary, length and count from the JSON file the bench writes (:func:`write_spec`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

NOISE = 0.1  # share of positions replaced by a uniformly random token


@dataclass(frozen=True)
class WindowSpec:
    vocab: int
    seq_len: int
    samples: int
    seed: int = 0


class TokenWindows(Dataset[torch.Tensor]):
    """``samples`` windows of ``seq_len + 1`` int64 token ids (see the module's docstring)."""

    def __init__(self, spec: WindowSpec, *, offset: int = 0) -> None:
        self.spec, self.offset = spec, offset  # offset: a validation split disjoint from training's
        self.cycle = torch.randperm(spec.vocab, generator=torch.Generator().manual_seed(spec.seed))

    def __len__(self) -> int:
        return self.spec.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        s = self.spec
        gen = torch.Generator().manual_seed(s.seed * 1_000_003 + self.offset + index)
        start = int(torch.randint(s.vocab, (1,), generator=gen))
        tokens = self.cycle[(start + torch.arange(s.seq_len + 1)) % s.vocab]
        noisy = torch.rand(s.seq_len + 1, generator=gen) < NOISE
        return torch.where(noisy, torch.randint(s.vocab, (s.seq_len + 1,), generator=gen), tokens)

    def batch(self, first: int, size: int) -> torch.Tensor:
        """Windows ``first .. first + size - 1`` (wrapping around), stacked: ``(size, seq_len + 1)``."""
        return torch.stack([self[(first + i) % len(self)] for i in range(size)])


def write_spec(path: Path, spec: WindowSpec) -> Path:
    path.write_text(json.dumps(asdict(spec)) + "\n")
    return path


def read_spec(path: str | Path) -> WindowSpec:
    return WindowSpec(**json.loads(Path(path).read_text()))


def windows(path: str) -> dict[str, Any]:
    """The ``data.name=...:windows`` mapping: training windows, a small disjoint validation set."""
    spec = read_spec(path)
    val = WindowSpec(spec.vocab, spec.seq_len, max(1, spec.samples // 64), spec.seed)
    return {"train": TokenWindows(spec), "val": TokenWindows(val, offset=spec.samples), "task": "causal_lm",
            "vocab_size": spec.vocab}
