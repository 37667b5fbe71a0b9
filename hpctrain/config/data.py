"""The ``data`` config section, and how a global batch splits over ranks and micro-steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hpctrain.config.mix import check_mix
from hpctrain.core.section import ConfigError, at_least, opt, positive
from hpctrain.core.storage import check_storage_options, is_url, parse_url

SPLITS = ("train", "val", "test")  # what a source may be asked for; data.val_split names one of the last two


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    name: str = opt("mnist", "Dataset: mnist | fashion_mnist | synthetic_cifar | synthetic_tiny | shards (tar shards from `hpctrain data shard`, at data.path) | csv:PATH | parquet:PATH | jsonl:PATH | hf:PATH (datasets' save_to_disk) | imagefolder:PATH | package.module:NAME (your own: a callable or mapping giving {train: dataset, val: dataset}; docs/own-data.md).")
    path: str | None = opt(None, "Data location for sources that read files (default: the installed package); for shards: the shard directory, or an object-store URL (s3://BUCKET/PREFIX, or any fsspec URL whose filesystem is installed; docs/data.md).")
    storage_options: dict[str, Any] = opt({}, "Shards on object storage: endpoint_url (a MinIO/Ceph endpoint, default AWS_ENDPOINT_URL), addressing_style (path|virtual|auto), region, profile, anon (true: a public bucket), retries (default 4); e.g. data.storage_options.endpoint_url=http://minio:9000. Credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance role), never from the config.")
    batch_size: int = opt(64, "Samples per rank per micro-step (global batch = batch_size x world_size x train.grad_accum); with data.global_batch_size set: the largest micro-batch per rank.")
    global_batch_size: int | None = opt(None, "Samples per optimizer step over all ranks, kept at any world size (elastic resume keeps batch and sample order): per rank global_batch_size / world_size samples (must divide), in the fewest equal micro-batches of at most data.batch_size; train.grad_accum is then derived (leave it at 1).")
    eval_batch_size: int | None = opt(None, "Samples per rank per validation batch; default: 2 x batch_size.")
    num_workers: int = opt(0, "DataLoader worker processes per rank (0 = load in the training process).")
    prefetch_factor: int = opt(2, "Batches each worker keeps ready (only with num_workers > 0).")
    pin_memory: bool = opt(True, "Pin host memory for faster host-to-GPU copies (ignored on CPU).")
    persistent_workers: bool = opt(True, "Keep workers alive between epochs (only with num_workers > 0).")
    max_train_samples: int | None = opt(None, "Use only the first N training samples (quick runs, tests).")
    max_val_samples: int | None = opt(None, "Use only the first N validation samples.")
    val_split: Literal["val", "test"] = opt("val", "Which held-out split validates: val (MNIST's 10k validation) or test.")
    synthetic_size: int = opt(20000, "Samples in a synthetic training set (synthetic_* datasets).")
    drop_last: bool = opt(True, "Drop the last incomplete training batch so every step has the same global batch (shards: false pads the last step with masked samples instead).")
    shuffle: Literal["global", "shard", "window", "none"] = opt("shard", "Shards: order within an epoch; global = one permutation of all samples, shard = shards and samples within each shard shuffled, window = shuffled windows of shuffle_window samples (near-sequential reads), none = file order.")
    shuffle_window: int = opt(1000, "Shards: samples per window for shuffle=window.")
    stage_dir: str | None = opt(None, "Shards: node-local directory to copy the shards to first (local rank 0 copies, verifies, others wait); default $SLURM_TMPDIR when set; off = read data.path directly. With data.path on object storage: the node-local cache (the first run downloads, a restart or later epoch reads locally); off = ranged reads with prefetch.")
    image_size: int | None = opt(None, "Image folders: resize every image to image_size x image_size pixels (hpctrain data shard --image-size N); None = every image must have the same size, and mixed sizes are refused naming a file.")
    decoder: Literal["native", "dali"] = opt("native", "Image shards (png/jpg): who decodes. native = libspng (pyspng) or PIL in the loader's workers; dali = NVIDIA DALI in the training process, on the GPU (mixed) under CUDA, on its CPU backend elsewhere, fed the bytes hpctrain's workers read: the order, rank x worker split, resume and validation stay hpctrain's, and PNG pixels are bit-identical (pip install 'hpctrain[dali]'; docs/data.md).")
    on_corrupt: Literal["stop", "skip"] = opt("stop", "Shards: a truncated or corrupt sample stops the run (naming shard and key), or is skipped, logged and counted.")
    input_key: str | None = opt(None, "Your own data with dict items: the input's key; None = the first of input, inputs, input_ids, x, image, img, pixel_values, features.")
    label_key: str | None = opt(None, "Your own data with dict items: the label's key; None = the first of label, labels, target, targets, y.")
    collate: str | None = opt(None, "Your own data: package.module:fn turning a list of items into (inputs, labels) (or a dict); None = torch's default_collate.")
    input_columns: list[str] | None = opt(None, "The inputs: tables (csv:, parquet:, jsonl:, hf:): the input columns, e.g. [x1,x2] (numbers: one vector per row) or [input_ids,attention_mask] (lists: a dict of named tensors, the model called as model(**inputs)); dict items (your own data, datasets.Dataset): the keys passed to the model by name. None = tables: every numeric column but the labels (text columns skipped); dict items: data.input_key plus attention_mask / token_type_ids / position_ids where present.")
    label_column: str = opt("label", "Tables (csv:, parquet:, jsonl:, hf:): the target column: class ids 0..C-1 (classification), a number (regression) or a list per row (a vector: regression, multilabel).")
    label_columns: list[str] | None = opt(None, "Tables: several target columns, stacked into one vector per row, e.g. [y1,y2] (regression with two outputs) or [cat,dog,bird] (multilabel 0/1 columns); overrides data.label_column.")
    packing: Literal["windows", "documents"] = opt("windows", "Causal-LM text (tables' text column, shakespeare): windows = each document cut on its own into windows of model.seq_len + 1 tokens, its short tail dropped; documents = documents packed one after another into windows, each token with its document id, attention and loss kept within a document (docs/data.md). Shards carry the packing they were written with (hpctrain data shard --packing).")
    tokenizer: str | None = opt(None, "Causal-LM text: a Hugging Face tokenizer directory (save_pretrained; read offline), whose vocabulary the model must hold; None = bytes (byte-level, vocabulary 256). Shards carry theirs (hpctrain data shard --tokenizer).")
    mix: list[dict[str, Any]] | None = opt(None, "A weighted mixture of sources instead of data.name: a list of {name: NAME and/or path: DIR, weight: W, label: TEXT, and any other data key for this source alone}, e.g. [{name: mnist, weight: 3}, {path: s3://bucket/web, weight: 1}]; the shares are the weights over their sum (docs/data.md, Mixtures).", none_text=("off", "none"))

    def __post_init__(self) -> None:
        positive("data", self, "batch_size", "global_batch_size", "eval_batch_size", "max_train_samples",
                 "max_val_samples", "prefetch_factor", "synthetic_size", "shuffle_window", "image_size")
        at_least("data", self, "num_workers", 0)
        check_places(self)
        check_mix(self)


def check_places(data: DataConfig) -> None:
    """``data.path`` and ``data.storage_options``, and each mixture entry's (named ``data.mix[i].KEY``):
    an object-store URL parsed as the client will take it and options of their types, refused here
    (exit 2, one line) before any client is made. (Entries that are not mappings: check_mix's to name.)"""
    check_storage_options("data.storage_options", data.storage_options)
    if is_url(data.path):
        parse_url(str(data.path), "data.path")
    for i, entry in enumerate(data.mix or []):
        if not isinstance(entry, dict):
            continue
        if "storage_options" in entry:
            check_storage_options(f"data.mix[{i}].storage_options", entry["storage_options"])
        if is_url(entry.get("path")):
            parse_url(str(entry["path"]), f"data.mix[{i}].path")


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's samples are split: ``micro_batch`` per rank per micro-step,
    ``grad_accum`` micro-steps, ``world_size`` ranks."""

    micro_batch: int
    grad_accum: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size


def batch_split(data: DataConfig, grad_accum: int, world_size: int) -> BatchSplit:
    """The split at this world size. Without ``data.global_batch_size``: as configured. With it:
    per rank G / world samples, in the fewest equal micro-batches of at most ``data.batch_size``
    (so the global batch, and with it the sample order per step, is the same at any world size)."""
    if data.global_batch_size is None:
        return BatchSplit(data.batch_size, grad_accum, world_size)
    per_rank, rest = divmod(data.global_batch_size, world_size)
    if rest or per_rank == 0:
        raise ConfigError(
            f"data.global_batch_size ({data.global_batch_size}) is not a multiple of world_size ({world_size}); "
            f"hint: choose a multiple of every world size the job may run at (e.g. {_suggest(data, world_size)})")
    accum = -(-per_rank // data.batch_size)
    while per_rank % accum:  # equal micro-batches: every micro-step has the same size on every rank
        accum += 1
    return BatchSplit(per_rank // accum, accum, world_size)


def _suggest(data: DataConfig, world_size: int) -> int:
    g = data.global_batch_size or world_size
    return max(world_size, round(g / world_size) * world_size)
