"""Data as users have it: ``data.name=package.module:NAME``, and the file sources that read into
the same shape (``csv:``, ``parquet:``, ``jsonl:``, ``hf:``, ``imagefolder:``).

``NAME`` is a mapping, or a callable returning one (given ``path=data.path`` and/or ``seed``
when its signature takes them), with the key ``train`` and optionally ``val`` (or
``validation``) and ``test``; its values are:

* map-style ``torch.utils.data.Dataset``\\ s (items ``(input, target)``, or dicts read by
  ``data.input_key`` / ``data.label_key``; ``data.collate`` replaces the default collate),
  including Hugging Face ``datasets.Dataset``: split by rank and worker by a
  :class:`~hpctrain.data.loader.MapStyleLoader`, exactly as tar shards are;
* ``IterableDataset``\\ s with ``__len__``: read by a :class:`StreamLoader`.

Optional keys: ``num_classes`` (else the dataset's ``classes`` / ``num_classes`` / Hugging Face
``ClassLabel``, else ``model.num_classes``) and ``task`` (``classification``, or ``causal_lm``
for token windows: an item is a window of ``seq_len + 1`` token ids).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from hpctrain.config.data import DataConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.core.section import load_import_path
from hpctrain.data.batch import (
    COMPANION_KEYS,
    INPUT_KEYS,
    LABEL_KEYS,
    ArrayDataset,
    Batch,
    BatchedDataset,
    ItemDataset,
    ItemSpec,
    batched,
)
from hpctrain.data.errors import DataFormatError
from hpctrain.data.position import EpochSplit, Position

log = logging.getLogger("hpctrain")
CLASSIFICATION, CAUSAL_LM = "classification", "causal_lm"
VAL_ALIASES = {"val": ("val", "validation", "valid"), "test": ("test",)}


@dataclass
class UserData:
    """The splits a source gives, and what it says about them."""

    name: str  # data.name, for messages
    train: Any
    val: Any = None
    num_classes: int | None = None
    task: str = CLASSIFICATION
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- data.name=package.module:NAME


def imported_splits(data: DataConfig, arg: str, seed: int) -> UserData:
    """Source hook: the mapping ``package.module:NAME`` gives (``arg`` is the whole import path)."""
    obj = load_import_path("data.name", arg, DataFormatError)
    if callable(obj) and not isinstance(obj, Mapping):
        # data.path unset: the factory's own path= default stays (None would overwrite it)
        offered: dict[str, Any] = {"seed": seed} if data.path is None else {"path": data.path, "seed": seed}
        obj = _call(arg, obj, offered)
    return from_mapping(arg, obj, data.val_split)


def _call(name: str, fn: Any, offered: dict[str, Any]) -> Any:
    try:
        params = dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = {}  # a builtin or C callable: no arguments
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_all or k in params}
    try:
        return fn(**kwargs)
    except Exception as err:  # noqa: BLE001 - the user's code failed: their message, named, no traceback
        raise DataFormatError(f"data.name={name} raised {type(err).__name__}: {err}; hint: call it yourself "
                              "in Python to see the traceback") from None


def from_mapping(name: str, splits: Any, val_split: str) -> UserData:
    """A source's ``{train: ..., val: ...}`` mapping as :class:`UserData`; a wrong shape is refused."""
    if not isinstance(splits, Mapping) or "train" not in splits:
        got = f"a mapping with keys {sorted(map(str, splits))}" if isinstance(splits, Mapping) else (
            f"a {type(splits).__name__}")
        raise DataFormatError(f"data.name={name} gave {got}; hint: return {{'train': dataset, 'val': dataset}} "
                              "(val optional), each a map-style Dataset, an IterableDataset or a datasets.Dataset")
    val = next((splits[k] for k in VAL_ALIASES[val_split] if splits.get(k) is not None), None)
    task = str(splits.get("task", CLASSIFICATION))
    if task not in (CLASSIFICATION, CAUSAL_LM):
        raise DataFormatError(f"data.name={name}: task={task!r} is not one of {CLASSIFICATION}, {CAUSAL_LM}")
    for split, dataset in (("train", splits["train"]), (val_split, val)):
        if dataset is not None and not isinstance(dataset, Dataset) and not _is_hf(dataset):
            raise DataFormatError(f"data.name={name}: {split} is a {type(dataset).__name__}, not a "
                                  "torch.utils.data.Dataset, IterableDataset or datasets.Dataset; hint: wrap it, "
                                  "e.g. torch.utils.data.TensorDataset(inputs, labels)")
    count = splits.get("num_classes") or splits.get("vocab_size")
    return UserData(name, splits["train"], val, int(count) if count else None, task)


# ---------------------------------------------------------------- what the data says about itself


def _is_hf(dataset: Any) -> bool:
    """A Hugging Face ``datasets.Dataset`` / ``IterableDataset`` (checked without importing datasets)."""
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "with_format")


def spec_for(user: UserData, data: DataConfig, split: str, num_classes: int | None,
             targets: str = "class") -> ItemSpec:
    """How ``split``'s items become batches (keys, collate, inputs by name, the targets to check:
    ``targets`` is the task's kind, hpctrain.data.batch.TARGET_KINDS)."""
    collate = load_import_path("data.collate", data.collate, DataFormatError) if data.collate else None
    labelled = user.task == CLASSIFICATION
    return ItemSpec(f"data.name={user.name} {split}", data.input_key, data.label_key, collate, num_classes,
                    labelled=labelled, targets=targets if labelled else "tokens",
                    input_columns=tuple(data.input_columns or ()))


def hf_view(dataset: Any, data: DataConfig) -> Any:
    """A Hugging Face dataset as torch tensors, only the columns a batch reads (strings stay out):
    data.input_columns, or the input key and its companions (attention_mask, token_type_ids,
    ...), and the label."""
    columns = list(dataset.column_names or [])
    chosen = [c for c in (*(data.input_columns or ()), data.input_key, data.label_key) if c is not None]
    for key, candidates in ((data.input_key, INPUT_KEYS), (data.label_key, LABEL_KEYS)):
        if key is None and not (candidates is INPUT_KEYS and data.input_columns):
            chosen += [c for c in candidates if c in columns][:1]
    if not data.input_columns:
        chosen += [c for c in COMPANION_KEYS if c in columns]
    return dataset.with_format("torch", columns=[c for c in dict.fromkeys(chosen) if c in columns] or None)


def class_count(user: UserData, data: DataConfig, model_classes: int | None) -> int | None:
    """The class count: the mapping's, the dataset's own (``classes``, ``num_classes``, a Hugging
    Face ``ClassLabel``), or the model's."""
    if user.num_classes:
        return user.num_classes
    train = user.train
    if isinstance(train, ArrayDataset):
        return train.num_classes
    classes = getattr(train, "classes", None)
    if isinstance(classes, (list, tuple)) and classes:
        return len(classes)
    own = getattr(train, "num_classes", None)
    if isinstance(own, int) and own > 0:
        return own
    features = getattr(train, "features", None)
    label = data.label_key or next((k for k in LABEL_KEYS if features is not None and k in features), None)
    feature = features.get(label) if features is not None and label is not None else None
    count = getattr(feature, "num_classes", None)  # a Hugging Face ClassLabel
    return int(count) if count else model_classes


def map_style(dataset: Any, data: DataConfig, spec: ItemSpec) -> BatchedDataset:
    """A map-style split read a batch at a time (a UserError for one that is not)."""
    if _is_hf(dataset):
        dataset = hf_view(dataset, data)
    if isinstance(dataset, ArrayDataset):
        return dataset
    return batched(dataset, spec)


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


# ---------------------------------------------------------------- IterableDataset


ENDLESS = 2**53  # samples of a stream without __len__ until bound_stream sizes it (a JSON-safe int)


class StreamLoader(Position):
    """Training batches of an ``IterableDataset``: an epoch is its ``__len__`` samples, or, for a
    stream without one, ``data.max_train_samples`` or the run's ``train.max_steps`` (:func:`bound_stream`).

    Every rank reads the same stream in the training process: global step ``s`` takes its items
    ``[s*B*W, (s+1)*B*W)`` and rank ``r`` the ``r``-th block of ``B``, the plan the shards follow
    with the stream's own order. A ``Stateful`` stream (``state_dict`` / ``load_state_dict``,
    e.g. a Hugging Face ``IterableDataset``) resumes exactly, also at another world size (its
    state is at a global step boundary on every rank); any other restarts its epoch on resume,
    and the run says so once. ``set_epoch`` is passed on when the stream has one."""

    def __init__(self, dataset: IterableDataset, items: ItemDataset, env: ClusterEnv, batch_size: int, *,
                 drop_last: bool = True, max_samples: int | None = None, name: str = "data") -> None:
        self.endless = not hasattr(dataset, "__len__") and not max_samples  # sized later by bound_stream
        total = len(dataset) if hasattr(dataset, "__len__") else (max_samples or ENDLESS)
        self.dataset, self.items, self.env, self.name = dataset, items, env, name
        self.batch_size, self.drop_last = batch_size, drop_last
        self.num_samples = min(total, max_samples or total)
        self.stateful = is_stateful(dataset)
        # position: stream items this epoch consumed by all ranks (restored: where the stream resumes)
        self._split = EpochSplit(self.num_samples, batch_size, env.world_size, drop_last)
        self._resuming = False  # a Stateful stream was restored: the next pass continues it
        if len(self) == 0:
            raise DataFormatError(f"{name} has {self.num_samples} samples: fewer than one global batch of "
                                  f"{batch_size} x {env.world_size} ranks; hint: lower data.batch_size")

    def bound(self, max_steps: int | None, grad_accum: int) -> int:
        """A stream without ``__len__``: one epoch is the run's ``max_steps`` optimizer steps
        (their samples); without max_steps the run would never end, so it is refused."""
        if max_steps is None:
            raise DataFormatError(f"{self.name}: the IterableDataset {type(self.dataset).__name__} has no __len__, "
                                  "so the run cannot know when to stop; hint: set train.max_steps (or "
                                  "data.max_train_samples as the samples of one epoch, or define __len__)")
        self.num_samples = max_steps * grad_accum * self.batch_size * self.env.world_size
        self._split = EpochSplit(self.num_samples, self.batch_size, self.env.world_size, self.drop_last)
        self.endless = False
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if not self._resuming:  # a stream cannot continue a pass it left: only a restored one resumes
            self._rewind()

    def __iter__(self) -> Iterator[Batch]:
        token = self._begin_pass()
        if not self._resuming:
            self._rewind()
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
        self._resuming = False
        return self._pass_batches(token)

    def _pass_batches(self, token: int) -> Iterator[Batch]:
        step, rank, size = self.batch_size * self.env.world_size, self.env.rank, self.batch_size
        stream = iter(self.dataset)
        while self.batches_done < len(self):
            first = self.position
            chunk = list(islice(stream, min(step, self.num_samples - first)))
            if not chunk or not self._current(token):
                return
            mine = list(range(rank * size, min((rank + 1) * size, len(chunk))))
            self.batches_done += 1
            yield self._batch(chunk, mine, first)
        self._end_pass(token)

    def _batch(self, chunk: list[Any], mine: list[int], first: int) -> Batch:
        """This rank's block of a global step; the last, short step padded with masked copies."""
        slots = mine + [mine[-1] if mine else 0] * (self.batch_size - len(mine))
        batch = self.items.collate([chunk[i] for i in slots], torch.tensor([first + i for i in slots]))
        if len(mine) == self.batch_size:
            return batch
        mask = torch.tensor([k < len(mine) for k in range(self.batch_size)])
        return Batch(batch.inputs, batch.targets, batch.keys, mask)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {**self.position_state(), "num_samples": self.num_samples}
        if self.stateful:
            state["stream"] = self.dataset.state_dict()  # type: ignore[attr-defined]  # Stateful: checked
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_epoch(int(state["epoch"]))
        if self.stateful and "stream" in state and int(state.get("position", 0)) > 0:
            self.dataset.load_state_dict(state["stream"])  # type: ignore[attr-defined]  # Stateful: checked
            self.seek(int(state["position"]))
            self._resuming = True
        elif int(state.get("position", 0)) > 0 and self.env.rank == 0:
            log.warning("%s: the IterableDataset %s is not Stateful (no state_dict/load_state_dict): the resumed "
                        "run restarts epoch %d from its first sample; hint: make it Stateful to resume exactly",
                        self.name, type(self.dataset).__name__, self.epoch)
        self._place()


def bound_stream(loader: object, max_steps: int | None, grad_accum: int) -> int | None:
    """The training samples of a stream without ``__len__`` once sized by ``train.max_steps``
    (:meth:`StreamLoader.bound`); None for any other loader."""
    if isinstance(loader, StreamLoader) and loader.endless:
        return loader.bound(max_steps, grad_accum)
    return None


def materialize(dataset: IterableDataset, limit: int | None = None) -> list[Any]:
    """A validation stream read whole (or its first ``limit`` items) into memory, so that every
    rank evaluates its own slice exactly once (each rank reads the stream)."""
    return list(islice(dataset, limit))


class ListDataset(Dataset):
    """Items in a list, map-style (a materialized validation stream)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


def is_stateful(obj: object) -> bool:
    """torch's ``Stateful`` protocol (``state_dict`` and ``load_state_dict``), checked here:
    importing it would load torch.distributed.checkpoint and DTensor (0.6 s) in every run."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
