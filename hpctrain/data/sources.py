"""The data sources by name: what ``data.name`` and ``hpctrain data shard SOURCE`` accept, in one table.

A source gives any of three things, each named by an import path (``package.module:function``)
and imported only when used, so listing and checking names imports no torch:

* ``memory``: a split in memory, ``fn(data: DataConfig, split, seed) -> ArrayDataset``, for
  ``data.name=NAME`` (read by :class:`~hpctrain.data.in_memory.MemoryLoader`);
* ``shards``: the directory of tar shards to stream, ``fn(data: DataConfig, env, seq_len) -> Path``,
  for ``data.name=NAME`` (read by :class:`~hpctrain.data.loader.ShardedLoader`);
* ``pack``: a split's samples to write as shards, ``fn(arg, split, options: PackOptions) -> PackSource``,
  for ``hpctrain data shard NAME[:ARG]``.

A new source is its functions plus one entry here, or :func:`register_source` from the user's
own code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpctrain.config.data import DataConfig
from hpctrain.core.section import ConfigError
from hpctrain.data.errors import ShardError
from hpctrain.data.pack import DEFAULT_PACK, PackOptions, PackSource

if TYPE_CHECKING:
    from hpctrain.data.batch import ArrayDataset


@dataclass(frozen=True)
class Source:
    """One named source; see the module doc for what each hook is called with."""

    memory: str | None = None
    shards: str | None = None
    pack: str | None = None
    splits: str | None = None  # data.name=NAME:ARG read as datasets: fn(data, arg, seed) -> hpctrain.data.user.UserData
    pack_arg: str = ""  # what ``hpctrain data shard NAME:ARG`` needs after the colon ("PATH", "N"); "" = optional
    pack_splits: tuple[str, ...] = ("train",)  # the splits ``hpctrain data shard`` writes without --split
    note: str = ""  # shown after the name in data.name's list of choices


_SOURCES: dict[str, Source] = {
    "mnist": Source(memory="hpctrain.data.mnist:mnist_split", pack="hpctrain.data.mnist:mnist_source"),
    "fashion_mnist": Source(memory="hpctrain.data.mnist:fashion_split", pack="hpctrain.data.mnist:fashion_source"),
    "synthetic_cifar": Source(memory="hpctrain.data.synthetic:cifar_split",
                              pack="hpctrain.data.synthetic:synthetic_cifar_source", pack_arg="N"),
    "synthetic_tiny": Source(memory="hpctrain.data.synthetic:tiny_split"),
    "imagefolder": Source(pack="hpctrain.data.files:imagefolder_source", pack_arg="PATH",
                          splits="hpctrain.data.images:imagefolder_splits"),
    "npz": Source(pack="hpctrain.data.files:npz_source", pack_arg="PATH"),
    "jsonl": Source(pack="hpctrain.data.tables:jsonl_pack", pack_arg="PATH",
                    splits="hpctrain.data.text:table_text_splits"),
    "csv": Source(pack="hpctrain.data.tables:csv_pack", pack_arg="PATH", splits="hpctrain.data.text:table_text_splits"),
    "parquet": Source(pack="hpctrain.data.tables:parquet_pack", pack_arg="PATH",
                      splits="hpctrain.data.text:table_text_splits"),
    "hf": Source(pack="hpctrain.data.tables:hf_pack", pack_arg="PATH", splits="hpctrain.data.text:table_text_splits"),
    "text": Source(pack="hpctrain.data.text:text_pack", pack_arg="PATH", pack_splits=("train", "val")),
    "shakespeare": Source(shards="hpctrain.data.text:shakespeare_shards", pack="hpctrain.data.text:shakespeare_pack",
                          pack_splits=("train", "val"), note="text, sharded on first use"),
    "shards": Source(shards="hpctrain.data.remote:shards_root", note="with data.path"),
}


def register_source(name: str, source: Source) -> None:
    """Make ``name`` a source (``data.name=name`` and/or ``hpctrain data shard name``)."""
    _SOURCES[name] = source


def hook(target: str) -> Any:
    """The function at ``package.module:function``."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


IMPORTED = Source(splits="hpctrain.data.user:imported_splits")  # data.name=package.module:NAME


def data_choices() -> list[str]:
    """What ``data.name`` accepts, with a note where one helps."""
    plain = [n + (f" ({s.note})" if s.note else "") for n, s in _SOURCES.items() if s.memory or s.shards]
    return plain + [f"{n}:PATH" for n, s in _SOURCES.items() if s.splits] + ["package.module:NAME (your own)"]


def resolve_source(name: str) -> tuple[Source, str]:
    """The source ``data.name`` names and its argument: ``NAME``, ``NAME:ARG`` (a source that reads
    datasets, e.g. ``csv:PATH``), or ``package.module:NAME`` (the whole name is the argument)."""
    source = _SOURCES.get(name)
    if source is not None and (source.memory or source.shards):
        return source, ""
    key, sep, arg = name.partition(":")
    known = _SOURCES.get(key)
    if sep and arg and known is not None and known.splits:
        return known, arg
    if sep and key and arg and known is None and "/" not in arg:  # an import path never holds a slash; a file does
        return IMPORTED, name
    hint = f"; hint: {key}:PATH" if known is not None and known.splits else ""
    raise ConfigError(f"data.name={name!r} is unknown; choose one of: {', '.join(data_choices())}{hint}")


def pack_choices() -> list[str]:
    """What ``hpctrain data shard`` accepts: ``NAME`` or ``NAME:ARG``."""
    return [n + (f":{s.pack_arg}" if s.pack_arg else "") for n, s in _SOURCES.items() if s.pack]


def data_source(name: str) -> Source:
    """The source ``data.name`` names (see :func:`resolve_source`)."""
    return resolve_source(name)[0]


def pack_source(spec: str) -> tuple[Source, str]:
    """The source ``hpctrain data shard SPEC`` names (``NAME`` or ``NAME:ARG``), and its argument."""
    name, _, arg = spec.partition(":")
    source = _SOURCES.get(name)
    if source is None or source.pack is None or (source.pack_arg and not arg):
        raise ShardError(f"unknown source {spec!r}; choose one of: {', '.join(pack_choices())}")
    return source, arg


def load_split(data: DataConfig, split: str, seed: int) -> ArrayDataset:
    """``data.name``'s split in memory (``data.path``, ``data.synthetic_size`` as the source reads them)."""
    source = data_source(data.name)
    if source.memory is None:
        raise ConfigError(f"data.name={data.name} streams tar shards; it has no in-memory split "
                          "(hint: hpctrain.data.build_data reads it)")
    dataset: ArrayDataset = hook(source.memory)(data, split, seed)
    return dataset


def load_dataset(name: str, split: str, path: str | None = None, synthetic_size: int = 20000,
                 seed: int = 0) -> ArrayDataset:
    """Dataset by config name (``data.name``), in memory."""
    return load_split(DataConfig(name=name, path=path, synthetic_size=synthetic_size), split, seed)


def open_source(spec: str, split: str, options: PackOptions = DEFAULT_PACK) -> PackSource:
    """A split of ``spec`` (``mnist``, ``npz:PATH``, ``synthetic_cifar:N``, ``text:PATH``, ...) to pack."""
    source, arg = pack_source(spec)
    assert source.pack is not None  # pack_source returns packable sources only
    packed: PackSource = hook(source.pack)(arg, split, options)
    return packed

