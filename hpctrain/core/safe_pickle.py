"""Pickles from files someone else may have written, read without running their code.

``pickle.load`` calls whatever a file names (``os.system`` included). Two files hpctrain
reads are pickles that ``torch.load(weights_only=True)`` does not cover: DCP's
``.metadata`` (and the non-tensor values of a DCP checkpoint) and the MNIST
``mnist.pkl.gz``. :func:`load` reads them with an unpickler that admits only the globals
the file's kind needs, and refuses anything else with :class:`UnsafePickleError`, naming
the file and the global, before that global is ever looked up.

Admitting only harmless types is not enough: a 5 KB pickle of lists that share lists unfolds
into 2**64 objects for whoever walks it, and a 20,000-deep nesting ends in ``RecursionError``.
:func:`check_limits` reads a pickle's operations (``pickletools``, nothing is built) and
refuses one that nests deeper than :data:`MAX_DEPTH` or unfolds into more objects than
:func:`object_limit` allows; :func:`check_torch_archive` does so for the ``data.pkl`` of a
``torch.save`` zip after refusing members whose declared size is absurd (a zip bomb).

Imports nothing but the standard library: callers bring torch or numpy when they need them.
"""

from __future__ import annotations

import importlib
import io
import pickle
import pickletools
import zipfile
from collections.abc import Callable
from typing import IO, Any, Protocol

from hpctrain.core.errors import UserError

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
    """Unpickle ``file`` admitting only the globals ``allowed(module, name)`` accepts, once
    :func:`check_limits` passed (the file is read into memory first: one decompression of a
    gzip stream, not two). ``what`` names the file in errors. A file that is not a pickle at
    all, or is cut short, is an :class:`UnsafePickleError` too: it cannot be what the caller
    expects."""
    data = file.read()
    check_limits(data, what)
    try:
        return _Restricted(io.BytesIO(data), allowed, what, **kwargs).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            RecursionError, MemoryError) as err:
        raise UnsafePickleError(f"{what} is not a readable pickle ({type(err).__name__}: {err}); hint: the file "
                                f"is damaged or of another kind") from err


# ---------------------------------------------------------------- limits, checked before unpickling

# A state dict nests a dozen levels (optimizer -> state -> param -> exp_avg -> tensor's rebuild
# arguments); Python's recursion limit is 1000. Shared objects are counted at every reference
# (that is what a walk over the unpickled tree meets): a pickle may unfold into at most
# OBJECTS_PER_OP objects per operation it spells out, plus MIN_OBJECTS, so real files (whose
# shared objects are strings and numbers) pass and sharing that multiplies level by level does not.
MAX_DEPTH = 100
OBJECTS_PER_OP = 4
MIN_OBJECTS = 1_000_000
# torch.save stores zip members uncompressed; deflate reaches about 1000x on zeros.
MAX_ZIP_RATIO = 100
_REFUSED = ("refused before unpickling; hint: the file was not written by this program (crafted or damaged): "
            "do not use it")
_IN_PLACE = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})
_LEAF: tuple[()] = ()  # numbers, strings, globals: nothing inside


def object_limit(operations: int) -> int:
    """How many objects (shared ones counted at each reference) a pickle of ``operations`` may unfold into."""
    return OBJECTS_PER_OP * operations + MIN_OBJECTS


def check_limits(file: bytes | IO[bytes] | Readable, what: str) -> None:
    """Refuse a pickle that nests deeper than :data:`MAX_DEPTH`, unfolds into more than
    :func:`object_limit` objects, or refers to itself, with :class:`UnsafePickleError`. Reads
    the operations only (``pickletools.genops``): no object of the file is built, no global is
    looked up; time and memory stay proportional to the file's size."""
    try:
        root, operations = _graph(file)
    except (ValueError, IndexError, KeyError, TypeError, EOFError) as err:
        raise UnsafePickleError(f"{what} is not a readable pickle ({type(err).__name__}: {err}); hint: the file "
                                f"is damaged or of another kind") from err
    limit = object_limit(operations)
    depth, objects = _measure(root, limit, what)
    if depth > MAX_DEPTH:
        raise UnsafePickleError(f"{what} nests {depth} levels deep, more than the {MAX_DEPTH} allowed: {_REFUSED}")
    if objects > limit:
        raise UnsafePickleError(f"{what} unfolds into more than {limit:,} objects (shared ones counted at each "
                                f"reference) from {operations:,} pickle operations: {_REFUSED}")


def _graph(file: bytes | IO[bytes] | Readable) -> tuple[Any, int]:
    """The pickle's objects as a graph of child lists (an atom is ``_LEAF``), built by running
    its operations on stand-ins; and the number of operations."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}
    operations = 0
    for op, arg, _ in pickletools.genops(file):  # type: ignore[arg-type]  # bytes or a binary stream
        operations += 1
        name = op.name
        if name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "MARK":
            marks.append(len(stack))
        elif name == "DUP":
            stack.append(stack[-1])
        elif name == "STOP":
            return stack.pop(), operations
        else:
            _apply(op, stack, marks)
    raise EOFError("no STOP operation")


def _apply(op: pickletools.OpcodeInfo, stack: list[Any], marks: list[int]) -> None:
    """One operation that consumes its inputs from the stack (``op.stack_before``) and pushes
    its result: a new object holding them, or (APPEND, SETITEM, BUILD, ...) the container it
    changes, now holding them too."""
    before = op.stack_before
    popped: list[Any] = []
    if pickletools.markobject in before:
        start = marks.pop()
        popped, stack[start:] = stack[start:], []
        before = before[: before.index(pickletools.markobject)]
    if before:
        if len(stack) < len(before):
            raise IndexError(f"{op.name} on a stack of {len(stack)}")
        popped = stack[-len(before):] + popped
        del stack[-len(before):]
    if not op.stack_after:  # POP, POP_MARK, PROTO, FRAME
        return
    if op.name in _IN_PLACE:
        container = popped[0]
        if not isinstance(container, list):
            raise TypeError(f"{op.name} on an object that holds nothing")
        container.extend(popped[1:])
        stack.append(container)
    elif op.name.startswith("EMPTY_") or popped:
        stack.append(popped)  # a new container, or an object made from its inputs
    else:
        stack.append(_LEAF)


def _measure(root: Any, limit: int, what: str) -> tuple[int, int]:
    """(depth, objects) of the tree the graph unfolds into, without unfolding it: each node
    once, children first. Counts stop growing past ``limit``; a cycle is refused."""
    depth: dict[int, int] = {}
    size: dict[int, int] = {}
    open_: set[int] = set()
    todo: list[tuple[Any, bool]] = [(root, False)]
    while todo:
        node, children_done = todo.pop()
        key = id(node)
        if children_done:
            open_.discard(key)
            depth[key] = 1 + max((depth[id(c)] for c in node), default=0)
            size[key] = min(1 + sum(size[id(c)] for c in node), limit + 1)
        elif key in open_:
            raise UnsafePickleError(f"{what} holds an object that contains itself: {_REFUSED}")
        elif key not in size:
            open_.add(key)
            todo.append((node, True))
            todo.extend((child, False) for child in node)
    return depth[id(root)], size[id(root)]


def check_torch_archive(file: bytes | IO[bytes] | io.IOBase, what: str) -> None:
    """A ``torch.save`` file (a zip) before ``torch.load`` reads it: no member may declare more
    than :data:`MAX_ZIP_RATIO` times its compressed size, nor all of them together more than
    that times the archive's size (torch would allocate what they declare); then
    :func:`check_limits` on its ``data.pkl``. Raises :class:`UnsafePickleError`."""
    stream = io.BytesIO(file) if isinstance(file, bytes) else file
    try:
        archive_size = stream.seek(0, io.SEEK_END)
        stream.seek(0)
        with zipfile.ZipFile(stream) as archive:
            members = archive.infolist()
            _check_sizes(members, archive_size, what)
            pickles = [m for m in members if m.filename.rsplit("/", 1)[-1] == "data.pkl"]
            if len(pickles) != 1:
                raise UnsafePickleError(f"{what} holds {len(pickles)} data.pkl records, not the one of a torch.save "
                                        f"file: {_REFUSED}")
            with archive.open(pickles[0]) as fh:
                check_limits(fh, f"{what} ({pickles[0].filename})")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError, EOFError) as err:
        raise UnsafePickleError(f"{what} is not a readable torch.save file (a zip archive; {type(err).__name__}: "
                                f"{err}); hint: the file is damaged or of another kind") from err


def _check_sizes(members: list[zipfile.ZipInfo], archive_size: int, what: str) -> None:
    for member in members:
        if member.file_size > MAX_ZIP_RATIO * max(member.compress_size, 1024):
            raise UnsafePickleError(
                f"{what}: member {member.filename} declares {member.file_size:,} bytes from {member.compress_size:,} "
                f"compressed, more than {MAX_ZIP_RATIO}x (a zip bomb): refused before reading; hint: the file was "
                "not written by torch.save: do not use it")
    declared = sum(m.file_size for m in members)
    if declared > MAX_ZIP_RATIO * max(archive_size, 1024):
        raise UnsafePickleError(
            f"{what}: its members declare {declared:,} bytes in all, more than {MAX_ZIP_RATIO}x the file's "
            f"{archive_size:,} (a zip bomb): refused before reading; hint: the file was not written by torch.save: "
            "do not use it")


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
