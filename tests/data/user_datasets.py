"""Datasets as users write them, for ``data.name=tests.data.user_datasets:NAME`` (tests only)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

FEATURES, CLASSES = 6, 3


def _sample(i: int) -> tuple[torch.Tensor, int]:
    """Sample ``i``: features that tell its class (learnable), and the class."""
    g = torch.Generator().manual_seed(i)
    label = i % CLASSES
    x = torch.randn(FEATURES, generator=g) * 0.5
    x[1 + label] += 2.0
    return x, label


class Pairs(Dataset):
    """A plain map-style dataset of (tensor, int) items, as in the PyTorch tutorials."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return _sample(self.offset + i)


class Records(Pairs):
    """Dict items, as Hugging Face-style code gives them."""

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        x, y = super().__getitem__(i)
        return {"features": x, "label": y, "note": "text the loader must ignore"}


class Tokens(Pairs):
    """Integer token ids: they must reach the model as int64, never as floats."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.arange(i, i + 5, dtype=torch.int32) % 50, i % CLASSES


class Stream(IterableDataset):
    """A stream of ``n`` samples with a length; no state."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        for i in range(self.n):
            yield _sample(i)


class StatefulStream(Stream):
    """A stream that says where it is (torch.distributed.checkpoint's Stateful) and resumes there."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.next, self._resume = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = self.next = int(state["next"])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        start, self._resume = self._resume, 0
        for i in range(start, self.n):
            self.next = i + 1
            yield _sample(i)
        self.next = 0


def make() -> dict[str, Any]:
    """The usual shape: train and val map-style datasets and the class count."""
    return {"train": Pairs(50), "val": Pairs(21, offset=1000), "num_classes": CLASSES}


def make_records() -> dict[str, Any]:
    return {"train": Records(40), "val": Records(9, offset=1000), "num_classes": CLASSES}


def make_tokens() -> dict[str, Any]:
    return {"train": Tokens(32), "num_classes": CLASSES}


def make_stream() -> dict[str, Any]:
    return {"train": StatefulStream(40), "val": Stream(11), "num_classes": CLASSES}


def make_plain_stream() -> dict[str, Any]:
    return {"train": Stream(40), "num_classes": CLASSES}


# ---------------------------------------------------------------- models for these datasets


class _Slow(torch.nn.Module):
    """Sleeps in a training forward, so that a signal lands mid-run (same weights as the inner model)."""

    def __init__(self, inner: torch.nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        if self.training:
            time.sleep(self.seconds)
        return self.inner(x)


def mlp(num_classes: int = CLASSES) -> torch.nn.Module:
    """FEATURES -> 16 -> classes, no dropout: deterministic at any world size."""
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, num_classes))


def slow_mlp(num_classes: int = CLASSES) -> torch.nn.Module:
    return _Slow(mlp(num_classes), 0.03)


def token_model(num_classes: int = CLASSES) -> torch.nn.Module:
    """Token ids in: an embedding fails on float inputs, so this proves they arrive as int64."""
    return torch.nn.Sequential(torch.nn.Embedding(50, 4), torch.nn.Flatten(), torch.nn.Linear(20, num_classes))


# ---------------------------------------------------------------- more shapes, and bad data


def collate_pairs(items: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A user's collate over dict items: doubles the features (so a test can tell it ran)."""
    return torch.stack([it["features"] * 2 for it in items]), torch.tensor([it["label"] for it in items])


def make_hf() -> dict[str, Any]:
    """Hugging Face datasets with a ClassLabel (the class count comes from it)."""
    import datasets

    def table(n: int, offset: int) -> Any:
        rows = [_sample(offset + i) for i in range(n)]
        features = datasets.Features({"x": datasets.Sequence(datasets.Value("float32")),
                                      "label": datasets.ClassLabel(num_classes=CLASSES),
                                      "text": datasets.Value("string")})
        return datasets.Dataset.from_dict({"x": [r[0].tolist() for r in rows], "label": [r[1] for r in rows],
                                           "text": ["ignored"] * n}, features=features)
    return {"train": table(30, 0), "validation": table(7, 1000)}


class _Strings(Pairs):
    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        return f"sample {i}"


class _BadLabel(Pairs):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = super().__getitem__(i)
        return x, 7 if i == 5 else y


def make_strings() -> dict[str, Any]:
    return {"train": _Strings(20), "num_classes": CLASSES}


def make_bad_label() -> dict[str, Any]:
    return {"train": _BadLabel(20), "num_classes": CLASSES}


def make_no_classes() -> dict[str, Any]:
    return {"train": Pairs(20)}


class _Logged(Pairs):
    """Pairs that append each index read to ``DIR/reads-PID.txt`` (one file per rank process)."""

    def __init__(self, n: int, log_dir: str) -> None:
        super().__init__(n)
        self.log_dir = log_dir

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import os

        with open(os.path.join(self.log_dir, f"reads-{os.getpid()}.txt"), "a") as out:
            out.write(f"{i}\n")
        return super().__getitem__(i)


def make_logged(path: str) -> dict[str, Any]:
    """``make`` whose training reads are logged under ``path`` (data.path)."""
    return {"train": _Logged(50, path), "val": Pairs(21, offset=1000), "num_classes": CLASSES}
