"""Reading a weights file someone may have handed over (``hpctrain eval --weights``).

``torch.load(weights_only=True)`` runs no code, but it allocates whatever a zip member declares
(a 1 MB file can declare gigabytes) and builds whatever the pickle nests. The file is checked
against :mod:`hpctrain.core.safe_pickle`'s limits first, so a crafted one ends in a clear error
(:class:`~hpctrain.core.safe_pickle.UnsafePickleError`, exit 2) before anything is read into memory.
A FIFO, a device or a directory given as the file is refused without blocking.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint import confine
from hpctrain.core import safe_pickle
from hpctrain.core.errors import UserError


class UnreadableWeightsError(UserError):
    """The weights file exists but cannot be read (permissions, an I/O error), or is no regular file."""


def load_weights_file(path: Path) -> Any:
    """What ``torch.save`` stored in ``path`` (a zip: torch >= 1.6), on the CPU, tensors and plain
    data only, once its members' declared sizes and its pickle's nesting and size passed. Only a
    regular file is read, opened non-blocking (a FIFO or a device is refused, never waited on);
    the checks and the load read the same open file."""
    try:
        raw, _ = confine.open_regular(Path(path))
    except confine.MissingFileError:
        raise UnreadableWeightsError(f"weights file {path} does not exist; hint: check the path") from None
    except confine.CheckpointError:  # a FIFO, a device, a directory
        raise UnreadableWeightsError(f"weights file {path} is not a regular file (a FIFO, a device or a directory): "
                                     f"refused without reading it; hint: give the path of a .pt file") from None
    except OSError as err:
        raise UnreadableWeightsError(f"weights file {path} cannot be read ({err.strerror or err}); hint: check its "
                                     f"permissions (`ls -l {path}`)") from err
    with io.BufferedReader(raw) as fh:
        try:
            safe_pickle.check_torch_archive(fh, f"weights file {path}")
            fh.seek(0)
            return torch.load(fh, map_location="cpu", weights_only=True)
        except safe_pickle.UnsafePickleError:
            raise
        except OSError as err:
            raise UnreadableWeightsError(f"weights file {path} cannot be read ({err.strerror or err}); hint: check "
                                         f"its permissions and the disk") from err
        except pickle.UnpicklingError as err:  # weights_only refused what the file names
            raise safe_pickle.UnsafePickleError(
                f"weights file {path} holds objects a weights file never holds: refused without running them; hint: "
                "the file was not written by torch.save of a state dict") from err
        except (RuntimeError, ValueError, EOFError) as err:  # a damaged record (torch's zip reader, its CRC)
            raise UnreadableWeightsError(f"weights file {path} cannot be loaded ({type(err).__name__}: "
                                         f"{str(err).splitlines()[0] if str(err) else ''}); hint: the file is "
                                         "damaged or not a torch.save file") from err
