"""Pickles from files someone else may have written, read without running their code.

``pickle.load`` calls whatever a file names (``os.system`` included). Two files hpctrain
reads are pickles that ``torch.load(weights_only=True)`` does not cover: DCP's
``.metadata`` (and the non-tensor values of a DCP checkpoint) and the MNIST
``mnist.pkl.gz``. :func:`load` reads them with an unpickler that admits only the globals
the file's kind needs, and refuses anything else with :class:`UnsafePickleError`, naming
the file and the global, before that global is ever looked up.

Imports nothing but the standard library: callers bring torch or numpy when they need them.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable
from typing import Any, Protocol

from hpctrain.errors import UserError

Allowed = Callable[[str, str], bool]


class Readable(Protocol):
    """What ``pickle.Unpickler`` reads from: a gzip stream, a file, DCP's stream."""

    def read(self, size: int = ..., /) -> bytes: ...

    def readline(self, size: int = ..., /) -> bytes: ...


class UnsafePickleError(UserError):
    """The file names a global its kind of file never holds: refused, nothing of it was run."""


class _Restricted(pickle.Unpickler):
    def __init__(self, file: Readable, allowed: Allowed, what: str, **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._allowed, self._what = allowed, what

    def find_class(self, module: str, name: str) -> Any:
        if not self._allowed(module, name):
            raise UnsafePickleError(
                f"{self._what} refers to {module}.{name}, which a file of its kind never holds: refused "
                f"without running it; hint: the file was not written by this program (crafted or from "
                f"another tool): do not use it")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._what} holds a persistent reference, which a file of its kind never "
                                f"holds: refused; hint: the file was not written by this program")


def load(file: Readable, allowed: Allowed, what: str, **kwargs: Any) -> Any:
    """Unpickle ``file`` admitting only the globals ``allowed(module, name)`` accepts.
    ``what`` names the file in errors. A file that is not a pickle at all, or is cut short,
    is an :class:`UnsafePickleError` too: it cannot be what the caller expects."""
    try:
        return _Restricted(file, allowed, what, **kwargs).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            RecursionError, MemoryError) as err:
        raise UnsafePickleError(f"{what} is not a readable pickle ({type(err).__name__}: {err}); hint: the file "
                                f"is damaged or of another kind") from err


def _is_class_in(module: str, name: str) -> bool:
    """``module.name`` exists and is a class (not a function that could do anything)."""
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(value, type)


def dcp_metadata_allowed(module: str, name: str) -> bool:
    """What torch's DCP metadata (``.metadata``) and its small non-tensor values hold: the
    metadata classes, tensor sizes, dtypes and layouts, storage paths; plain containers."""
    if module == "torch.distributed.checkpoint.metadata":
        return _is_class_in(module, name) or name == "_MEM_FORMAT_ENCODING"
    if module == "torch.distributed.checkpoint.filesystem":
        return name == "_StorageInfo"
    if module == "torch":
        return name == "Size" or name in _torch_dtype_names()
    if module == "torch.serialization":
        return name == "_get_layout"  # maps a layout's name (e.g. "torch.strided") to the layout
    if module == "pathlib":
        return name in {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}
    if module == "collections":
        return name == "OrderedDict"
    return False


def _torch_dtype_names() -> set[str]:
    import torch

    return {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


NUMPY_ARRAY_GLOBALS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                       ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                       ("numpy._core.multiarray", "scalar"),
                       ("_codecs", "encode")}  # protocol 2 stores an array's bytes as encode(text, "latin1")


def numpy_arrays_allowed(module: str, name: str) -> bool:
    """What a pickle of numpy arrays (and tuples of them) holds, nothing more."""
    return (module, name) in NUMPY_ARRAY_GLOBALS
