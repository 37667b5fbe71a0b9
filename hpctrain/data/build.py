"""The data of a run, built from the ``data`` section plus runtime values: this rank's place
(``ClusterEnv``), the device, the seed, and what the model says (its context length, its
class count). Also what the data tells the model and the loop: classes, input shape and
dtype, and the task, decided here and nowhere else (:func:`data_layout`).

Each ``data.name`` maps (:mod:`hpctrain.data.sources`) to loaders that follow two small
protocols, :class:`TrainLoader` and :class:`EvalBatches`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from hpctrain.config import _build as build_section  # the config's own coercion and messages, for data.mix's keys
from hpctrain.config.data import DataConfig
from hpctrain.config.mix import RUN_ONLY, MixEntry, mix_entries
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import HpctrainError
from hpctrain.core.section import ConfigError
from hpctrain.data.batch import ArrayDataset, Batch, BatchedDataset, ItemDataset, batched, main_input
from hpctrain.data.dali import check_dali, dali_train_loader, dali_val_loader  # imports no DALI itself
from hpctrain.data.in_memory import EvalLoader, MemoryLoader
from hpctrain.data.loader import IndexedBatches, MapStyleLoader, ShardedEvalLoader, ShardedLoader
from hpctrain.data.manifest import manifest_path
from hpctrain.data.mixture import MixedEval, MixSource, MixtureLoader, Reader, source_seed
from hpctrain.data.shard_dataset import ShardDataset
from hpctrain.data.sources import hook, load_split, resolve_source
from hpctrain.data.stage import resolve_stage_dir, stage_shards
from hpctrain.data.text import TextLayout, text_layout, tokens_of
from hpctrain.data.user import (
    CAUSAL_LM,
    ListDataset,
    StreamLoader,
    UserData,
    class_count,
    is_stateful,
    is_stream,
    map_style,
    materialize,
    spec_for,
)

log = logging.getLogger("hpctrain")
CLASSIFICATION = "classification"  # hpctrain.tasks names (and CAUSAL_LM)


class TrainLoader(Protocol):
    """What the trainer and the checkpointer need of a training loader (MemoryLoader, ShardedLoader)."""

    batches_done: int  # batches of the current epoch already yielded (restored by load_state_dict)

    def set_epoch(self, epoch: int) -> None: ...
    def __len__(self) -> int: ...  # batches per rank per epoch
    def __iter__(self) -> Iterator[Batch]: ...  # the rest of the epoch, from batches_done on
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class EvalBatches(Protocol):
    """What evaluate() needs of an evaluation loader (EvalLoader, ShardedEvalLoader)."""

    def __len__(self) -> int: ...  # this rank's batches
    def __iter__(self) -> Iterator[Batch]: ...  # this rank's share; no sample on two ranks
    def template(self) -> Batch: ...  # a one-sample batch, for masked padding steps


@dataclass(frozen=True)
class DataLayout:
    """What the data tells the model and the loop."""

    num_classes: int  # classes, or the vocabulary of token data
    input_shape: tuple[int, ...]  # one sample's
    input_dtype: torch.dtype = torch.float32  # the model's input: torch.long for token ids
    task: str = CLASSIFICATION  # what the data asks of the loop (hpctrain.tasks): causal_lm for text
    class_targets: bool = True  # are the targets class ids (one integer per sample)? else values, vectors


@dataclass
class DataBundle:
    """A run's loaders and sample counts; ``num_classes`` .. ``task`` are its :class:`DataLayout`."""

    train_loader: TrainLoader
    val_loader: EvalBatches | None
    num_classes: int
    input_shape: tuple[int, ...]
    train_size: int
    val_size: int
    input_dtype: torch.dtype = torch.float32
    task: str = CLASSIFICATION
    class_targets: bool = True  # DataLayout.class_targets


@dataclass
class ValData:
    """The evaluation loader of ``data.val_split`` and what its data tells the model (``hpctrain eval``)."""

    loader: EvalBatches
    size: int
    layout: DataLayout  # classes, input shape and dtype, task


def data_layout(text: TextLayout | None = None, *, num_classes: int = 0, input_shape: tuple[int, ...] = (),
                input_dtype: torch.dtype = torch.float32) -> DataLayout:
    """The one rule for the task: token windows (a text manifest, or a source that says
    ``task: causal_lm``) are causal_lm, with the model seeing ``(seq_len,)`` int64 ids; anything
    else is classification, with inputs of the data's dtype (int64 for integer features)."""
    if text is not None:
        return DataLayout(text.vocab, (text.seq_len,), torch.long, CAUSAL_LM)
    return DataLayout(num_classes, input_shape, input_dtype)


def build_data(data: DataConfig, env: ClusterEnv, device: torch.device, *, seed: int, seq_len: int | None = None,
               num_classes: int | None = None, with_val: bool = True, targets: str = "class") -> DataBundle:
    """This rank's training loader (and validation loader) for ``data.name``.

    ``env``: the data-parallel place of this rank; ``seed``: the sample order (and synthetic
    data); ``seq_len``: the model's context length (``data.name=shakespeare`` is sharded at
    it); ``num_classes``: the model's class count, for shards whose manifest lists none;
    ``targets``: what the labels of tables and users' datasets must be (the task's kind,
    :func:`hpctrain.tasks.data_targets`): class ids, float values, 0/1 vectors, or any.
    With ``data.mix``: one loader over the weighted sources (:func:`_mixture_data`).
    """
    if data.mix is not None:
        _no_dali_mix(data)
        return _mixture_data(data, env, device, seed, seq_len, num_classes, with_val, targets)
    source, arg = resolve_source(data.name)
    check_dali(data, shards=source.shards is not None)
    if source.splits is not None:
        user = _splits(source.splits, data, arg, seed, targets, seq_len)
        return _user_data(data, env, device, seed, user, num_classes, with_val, targets)
    if source.shards is not None:
        root = _shard_root(source.shards, data, env, seq_len)
        return _shard_data(data, env, device, seed, root, num_classes, with_val)
    train_set = load_split(data, "train", seed).subset(data.max_train_samples)
    loader = MemoryLoader(train_set, env, data.batch_size, seed=seed, drop_last=data.drop_last,
                          num_workers=data.num_workers, prefetch_factor=data.prefetch_factor,
                          pin_memory=_pin(data, device), persistent_workers=data.persistent_workers)
    val = _memory_val(data, env, seed) if with_val else None
    return _bundle(loader, len(train_set), _memory_layout(train_set), val.loader if val else None,
                   val.size if val else 0)


def build_val_loader(data: DataConfig, env: ClusterEnv, *, seed: int, seq_len: int | None = None,
                     num_classes: int | None = None, targets: str = "class") -> ValData:
    """The evaluation loader of ``data.val_split`` for any ``data.name``, and its layout (``hpctrain eval``)."""
    if data.mix is not None:
        _no_dali_mix(data)
        return _mixture_val(data, env, seed, seq_len, num_classes, targets)
    source, arg = resolve_source(data.name)
    check_dali(data, shards=source.shards is not None)
    if source.splits is not None:
        user: UserData = _splits(source.splits, data, arg, seed, targets, seq_len)
        classes = class_count(user, data, num_classes)
        val = _user_val(data, env, user, classes, targets)
        if val is None:
            raise ConfigError(f"data.name={data.name} has no {data.val_split} split to evaluate")
        return val
    if source.shards is None:
        return _memory_val(data, env, seed)
    root = _shard_root(source.shards, data, env, seq_len)
    loader = _shard_val_loader(data, env, root)
    if loader is None:
        raise ConfigError(f"data.path={data.path} has no {data.val_split} split to evaluate")
    layout = _shard_layout(text_layout(root, data.val_split), loader.dataset, num_classes)
    return ValData(loader, loader.num_samples, layout)


def load_val_set(data: DataConfig, *, seed: int) -> ArrayDataset:
    """``data.val_split`` of an in-memory source, limited to ``data.max_val_samples``."""
    return load_split(data, data.val_split, seed).subset(data.max_val_samples)


def eval_batch_size(data: DataConfig) -> int:
    return data.eval_batch_size or 2 * data.batch_size


def _pin(data: DataConfig, device: torch.device) -> bool:
    return data.pin_memory and device.type == "cuda"


def _bundle(loader: TrainLoader, size: int, layout: DataLayout, val: EvalBatches | None, val_size: int) -> DataBundle:
    return DataBundle(loader, val, layout.num_classes, layout.input_shape, size, val_size, layout.input_dtype,
                      layout.task, layout.class_targets)


def _splits(target: str, data: DataConfig, arg: str, seed: int, targets: str, seq_len: int | None = None) -> UserData:
    """A source's splits; a hook that takes ``targets`` (the tables') reads its labels as the task
    wants, one that takes ``seq_len`` (text columns) cuts windows of the model's context."""
    fn = hook(target)
    try:
        params = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = set()
    offered = {"targets": targets, "seq_len": seq_len}
    user: UserData = fn(data, arg, seed, **{k: v for k, v in offered.items() if k in params})
    return user


# ---------------------------------------------------------------- in memory


def _memory_layout(dataset: ArrayDataset) -> DataLayout:
    return data_layout(num_classes=dataset.num_classes, input_shape=dataset.input_shape,
                       input_dtype=dataset.inputs.dtype)


def _memory_val(data: DataConfig, env: ClusterEnv, seed: int) -> ValData:
    dataset = load_val_set(data, seed=seed)
    return ValData(EvalLoader(dataset, env, eval_batch_size(data)), len(dataset), _memory_layout(dataset))


# ---------------------------------------------------------------- tar shards


def _shard_root(shards: str, data: DataConfig, env: ClusterEnv, seq_len: int | None) -> Path:
    """The directory the source's ``shards`` hook gives, or its node-local copy when staging is
    on (data.stage_dir / $SLURM_TMPDIR)."""
    root: Path = hook(shards)(data, env, seq_len)
    return stage_shards(root, resolve_stage_dir(data.stage_dir), env, ["train", data.val_split])


def _no_dali_mix(data: DataConfig) -> None:
    if data.decoder == "dali":
        raise ConfigError("data.decoder=dali with data.mix: a mixture reads its sources through the native "
                          "decoder; hint: data.decoder=native, or one image-shard data.path")


def _dali_data(data: DataConfig, env: ClusterEnv, device: torch.device, seed: int, root: Path,
               num_classes: int | None, with_val: bool) -> DataBundle:
    """Image shards decoded by DALI (data.decoder=dali): hpctrain's order, split and resume, DALI's decode."""
    loader = dali_train_loader(data, env, device, seed=seed, root=root)
    val = None
    if with_val and _has_val(data, root):
        val = dali_val_loader(data, env, device, root=root, batch_size=eval_batch_size(data))
    layout = data_layout(num_classes=_num_classes(loader.dataset, num_classes), input_shape=loader.input_shape(),
                         input_dtype=torch.float32)
    return _bundle(loader, loader.num_samples, layout, val, val.num_samples if val else 0)


def _shard_data(data: DataConfig, env: ClusterEnv, device: torch.device, seed: int, root: Path,
                num_classes: int | None, with_val: bool) -> DataBundle:
    if data.decoder == "dali":
        return _dali_data(data, env, device, seed, root, num_classes, with_val)
    text = text_layout(root)
    loader = ShardedLoader(root, env, data.batch_size, split="train", seed=seed, shuffle=data.shuffle,
                           shuffle_window=data.shuffle_window, drop_last=data.drop_last, num_workers=data.num_workers,
                           prefetch_factor=data.prefetch_factor, pin_memory=_pin(data, device),
                           persistent_workers=data.persistent_workers, on_corrupt=data.on_corrupt,
                           max_samples=data.max_train_samples, transform=tokens_of if text else None)
    val = _shard_val_loader(data, env, root) if with_val else None
    return _bundle(loader, loader.num_samples, _shard_layout(text, loader.dataset, num_classes), val,
                   val.num_samples if val else 0)


def _has_val(data: DataConfig, root: Path) -> bool:
    if manifest_path(root, data.val_split).is_file():
        return True
    log.warning("no %s split in %s: training without validation (hint: hpctrain data shard SOURCE %s --split %s)",
                data.val_split, root, data.path, data.val_split)
    return False


def _shard_val_loader(data: DataConfig, env: ClusterEnv, root: Path) -> ShardedEvalLoader | None:
    if not _has_val(data, root):
        return None
    return ShardedEvalLoader(root, env, eval_batch_size(data), split=data.val_split, on_corrupt=data.on_corrupt,
                             max_samples=data.max_val_samples,
                             transform=tokens_of if text_layout(root, data.val_split) else None)


def _shard_layout(text: TextLayout | None, dataset: ShardDataset, num_classes: int | None) -> DataLayout:
    if text is not None:
        return data_layout(text)
    inputs = dataset.batch([0]).inputs
    return data_layout(num_classes=_num_classes(dataset, num_classes), input_shape=tuple(inputs.shape[1:]),
                       input_dtype=inputs.dtype)


def _num_classes(dataset: ShardDataset, num_classes: int | None) -> int:
    if dataset.index.classes:
        return len(dataset.index.classes)
    if num_classes:
        return num_classes
    raise ConfigError(f"the manifest in {dataset.index.root} lists no classes; hint: set model.num_classes")


# ---------------------------------------------------------------- datasets as users have them


def _user_data(data: DataConfig, env: ClusterEnv, device: torch.device, seed: int, user: UserData,
               num_classes: int | None, with_val: bool, targets: str = "class") -> DataBundle:
    """Loaders over the splits of ``data.name=package.module:NAME`` (or csv:, parquet:, ...):
    map-style splits in the shards' order and split (:class:`MapStyleLoader`), streams by :class:`StreamLoader`."""
    # classes None: unknown to the data; the model's output width tells (models.registry.resolve_num_classes)
    classes = class_count(user, data, num_classes)
    spec = spec_for(user, data, "train", classes if targets in ("class", "multilabel") else None, targets)
    loader: TrainLoader
    if is_stream(user.train):
        items = ItemDataset(user.train, spec)
        loader = StreamLoader(user.train, items, env, data.batch_size, drop_last=data.drop_last,
                              max_samples=data.max_train_samples, name=f"data.name={data.name} train")
        template = _stream_template(user.train, items)
    else:
        batches = IndexedBatches(map_style(user.train, data, spec))
        loader = MapStyleLoader(batches, [len(batches)], env, data.batch_size, seed=seed, shuffle=data.shuffle,
                                shuffle_window=data.shuffle_window, drop_last=data.drop_last,
                                num_workers=data.num_workers, prefetch_factor=data.prefetch_factor,
                                pin_memory=_pin(data, device), persistent_workers=data.persistent_workers,
                                max_samples=data.max_train_samples, what=f"data.name={data.name} train")
        template = batches.template()
    val = _user_val(data, env, user, classes, targets) if with_val else None
    return _bundle(loader, loader.num_samples, _user_layout(user, template, classes, targets),
                   val.loader if val else None, val.size if val else 0)


def _user_val(data: DataConfig, env: ClusterEnv, user: UserData, classes: int | None,
              targets: str = "class") -> ValData | None:
    """The validation split, each sample on exactly one rank (a stream is read whole first)."""
    if user.val is None:
        if env.is_main:
            log.warning("data.name=%s has no %s split: training without validation", data.name, data.val_split)
        return None
    spec = spec_for(user, data, data.val_split, classes if targets in ("class", "multilabel") else None, targets)
    val = ListDataset(materialize(user.val, data.max_val_samples)) if is_stream(user.val) else user.val
    dataset = _first(map_style(val, data, spec), data.max_val_samples)
    loader = EvalLoader(dataset, env, eval_batch_size(data), targets=targets)
    return ValData(loader, len(dataset), _user_layout(user, loader.template(), classes, targets))


def _first(dataset: BatchedDataset, limit: int | None) -> BatchedDataset:
    """The first ``limit`` samples (data.max_val_samples)."""
    if limit is None or limit >= len(dataset):
        return dataset
    if isinstance(dataset, ArrayDataset):
        return dataset.subset(limit)
    return ItemDataset(torch.utils.data.Subset(dataset.dataset, range(limit)), dataset.spec)


def _stream_template(stream: Any, items: ItemDataset) -> Batch:
    """The first item of a stream as a one-sample batch (a Stateful stream's state is kept)."""
    saved = stream.state_dict() if is_stateful(stream) else None
    first = next(iter(stream), None)
    if saved is not None:
        stream.load_state_dict(saved)
    if first is None:
        raise ConfigError(f"{items.spec.name}: the stream gave no sample")
    return items.collate([first], torch.zeros(1, dtype=torch.long))


def _user_layout(user: UserData, template: Batch, classes: int | None, targets: str = "class") -> DataLayout:
    first = main_input(template.inputs)
    shape = tuple(first.shape[1:])
    if user.task == CAUSAL_LM:  # a window of seq_len + 1 tokens: the model sees seq_len of them
        return data_layout(TextLayout(shape[0] - 1, classes or 0))
    y = template.targets
    is_class = y.ndim == 1 and not y.is_floating_point()
    # the model's output width: the class count, else the values per sample (regression, multilabel)
    width = classes if classes and (is_class or targets == "multilabel") else int(y[0].numel())
    if targets == "float":
        width = int(y[0].numel())
    if targets == "class" and is_class and not classes:
        width = 0  # unknown: the model's output width is the class count
    if targets == "any" and is_class and not classes:
        raise ConfigError(f"data.name={user.name}: the number of classes is unknown; hint: set model.num_classes, "
                          "or give num_classes in the mapping (or a classes list on the dataset)")
    layout = data_layout(num_classes=width or 0, input_shape=shape, input_dtype=first.dtype)
    return DataLayout(layout.num_classes, layout.input_shape, layout.input_dtype, layout.task, is_class)


# ---------------------------------------------------------------- weighted mixtures (data.mix)


def _mixture_data(data: DataConfig, env: ClusterEnv, device: torch.device, seed: int, seq_len: int | None,
                  num_classes: int | None, with_val: bool, targets: str) -> DataBundle:
    """Each source built as ``data.name``/``data.path`` alone would be (:func:`build_data`, so every
    source form works), then one :class:`MixtureLoader` over their samples and one validation
    loader over their validation splits, each source's metrics reported too."""
    built = []
    for entry in mix_entries(data.mix or [], [f.name for f in dataclasses.fields(data)]):
        cfg = _source_config(data, entry)
        try:
            bundle = build_data(cfg, env, device, seed=seed, seq_len=seq_len, num_classes=num_classes,
                                with_val=with_val, targets=targets)
        except HpctrainError as err:
            raise _named(err, entry) from None
        built.append((entry, cfg, bundle))
    layout = _agreed_layout([(entry, bundle) for entry, _, bundle in built])
    sources = [_mix_source(entry, cfg, bundle.train_loader, seed) for entry, cfg, bundle in built]
    loader = MixtureLoader(sources, env, data.batch_size, seed=seed, drop_last=data.drop_last,
                           num_workers=data.num_workers, prefetch_factor=data.prefetch_factor,
                           pin_memory=_pin(data, device), persistent_workers=data.persistent_workers)
    vals = [(entry.label, bundle.val_loader) for entry, _, bundle in built if bundle.val_loader is not None]
    val = MixedEval(vals) if vals else None
    return _bundle(loader, loader.num_samples, layout, val, sum(b.val_size for _, _, b in built))


def _mixture_val(data: DataConfig, env: ClusterEnv, seed: int, seq_len: int | None, num_classes: int | None,
                 targets: str) -> ValData:
    """``hpctrain eval`` of a mixture: every source's validation split, each reported too."""
    bundle = _mixture_data(data, env, torch.device("cpu"), seed, seq_len, num_classes, True, targets)
    if bundle.val_loader is None:
        raise ConfigError(f"data.mix: no source has a {data.val_split} split to evaluate")
    layout = DataLayout(bundle.num_classes, bundle.input_shape, bundle.input_dtype, bundle.task, bundle.class_targets)
    return ValData(bundle.val_loader, bundle.val_size, layout)


def _source_config(data: DataConfig, entry: MixEntry) -> DataConfig:
    """The run's data section as this source alone: its own keys over the run's; one sample per
    batch (a small source need not hold a global batch: the mixture's loader makes the batches)."""
    raw = {f.name: getattr(data, f.name) for f in dataclasses.fields(data) if f.name not in RUN_ONLY}
    raw.update(entry.options, eval_batch_size=eval_batch_size(data), batch_size=1, num_workers=0)
    raw["path"] = entry.options.get("path")  # the run's data.path belongs to data.name, not to this source
    cfg: DataConfig = build_section(DataConfig, raw, f"data.mix[{entry.index}].")
    return cfg


def _named(err: HpctrainError, entry: MixEntry) -> HpctrainError:
    """The error, of its own kind (its exit code), naming the source it came from."""
    try:
        return type(err)(f"{entry.key}: {err}")
    except Exception:  # noqa: BLE001 - an error class with another signature: as it is
        return err


def _mix_source(entry: MixEntry, cfg: DataConfig, loader: TrainLoader, seed: int) -> MixSource:
    """A source's samples by id and the sizes its own order shuffles, from its training loader."""
    seed_s = source_seed(seed, entry.label)
    if isinstance(loader, MapStyleLoader):  # tar shards, map-style datasets of users and tables
        reader = cast(Reader, loader.dataset)  # build_data's: an IndexedBatches or a ShardDataset, both read by id
        return MixSource(entry.label, entry.weight, reader, loader.sizes, loader.num_samples, seed_s,
                         loader.shuffle, loader.shuffle_window)
    if isinstance(loader, MemoryLoader):
        memory = IndexedBatches(batched(loader.dataset))
        return MixSource(entry.label, entry.weight, memory, [len(memory)], len(memory), seed_s, cfg.shuffle,
                         cfg.shuffle_window)
    raise ConfigError(f"{entry.key} is a stream (an IterableDataset): a mixture reads its sources' samples by "
                      "index; hint: give a map-style dataset, or shard it first (hpctrain data shard)")


def _agreed_layout(built: list[tuple[MixEntry, DataBundle]]) -> DataLayout:
    """The one layout of the mixture: every source must give the model the same inputs and task."""
    first, ref = built[0]
    classes = max(b.num_classes for _, b in built)
    for entry, b in built[1:]:
        for what, mine, theirs in (("task", b.task, ref.task), ("input shape", b.input_shape, ref.input_shape),
                                   ("input dtype", b.input_dtype, ref.input_dtype),
                                   ("class targets", b.class_targets, ref.class_targets),
                                   ("classes (vocabulary)", b.num_classes, ref.num_classes)):
            if mine != theirs and not (what.startswith("classes") and 0 in (mine, theirs) and ref.task != CAUSAL_LM):
                raise ConfigError(f"{entry.key} has {what} {mine}, but {first.key} has {theirs}; hint: the sources "
                                  "of a mixture must agree on the task, the input shape and dtype, and the classes "
                                  "(the vocabulary of token data)")
    return DataLayout(classes, ref.input_shape, ref.input_dtype, ref.task, ref.class_targets)
