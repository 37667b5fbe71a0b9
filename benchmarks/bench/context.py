"""What every case gets: the size to run at, a scratch directory and the user's overrides."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Context:
    quick: bool               # a reduced size that runs in seconds (CI)
    work: Path                # scratch directory of the case's runs (removed afterwards)
    procs: int | None = None  # scaling: the most processes
    repeats: int | None = None  # runs per point, in alternating order

    @property
    def device(self) -> torch.device:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def pick(self, quick: int, cpu: int, gpu: int) -> int:
        """A size by mode: quick, or full on a CPU, or full on a GPU."""
        return quick if self.quick else gpu if self.gpu else cpu
