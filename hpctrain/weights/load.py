"""Reading a weights file someone may have handed over (``hpctrain eval --weights``).

``torch.load(weights_only=True)`` runs no code, but it allocates whatever a zip member declares
(a 1 MB file can declare gigabytes) and builds whatever the pickle nests. The file is checked
against :mod:`hpctrain.safe_pickle`'s limits first, so a crafted one ends in a clear error
(:class:`~hpctrain.safe_pickle.UnsafePickleError`, exit 2) before anything is read into memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hpctrain import safe_pickle
from hpctrain.errors import UserError


class UnreadableWeightsError(UserError):
    """The weights file exists but cannot be read (permissions, an I/O error)."""


def load_weights_file(path: Path) -> Any:
    """What ``torch.save`` stored in ``path`` (a zip: torch >= 1.6), on the CPU, tensors and plain
    data only, once its members' declared sizes and its pickle's nesting and size passed."""
    try:
        with open(path, "rb") as fh:
            safe_pickle.check_torch_archive(fh, f"weights file {path}")
    except OSError as err:
        raise UnreadableWeightsError(f"weights file {path} cannot be read ({err.strerror or err}); hint: check its "
                                     f"permissions (`ls -l {path}`)") from err
    return torch.load(path, map_location="cpu", weights_only=True)
