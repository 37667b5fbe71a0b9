"""``hpctrain data shard|verify|inspect|index``: pack a dataset into tar shards and check them."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpctrain.core.errors import UserError
from hpctrain.core.storage import check_storage_options, is_url, parse_url
from hpctrain.data.errors import CorruptSampleError, ShardError
from hpctrain.data.indexing import index_existing
from hpctrain.data.manifest import summarize
from hpctrain.data.pack import DEFAULT_SEQ_LEN, VAL_FRACTION, PackOptions
from hpctrain.data.remote import mirror, other_classes, uploading, verify_remote
from hpctrain.data.sources import open_source, pack_choices, pack_source
from hpctrain.data.verify import Problem, class_mismatches, unlisted_shards, verify
from hpctrain.data.writer import parse_size, write_shards


def cmd_shard(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    splits = _shard_splits(args)
    remote = _is_remote(args)
    storage = _storage_options(args)
    known = other_classes(args.out_dir, storage, splits) if remote else _other_classes(Path(args.out_dir), splits)
    options = PackOptions(args.seq_len, args.glob, _val_fraction(args), num_classes=args.num_classes,
                          image_size=args.image_size, classes=known,
                          allow_missing_classes=args.allow_missing_classes, input_columns=args.input_column,
                          label_column=args.label_column, packing=args.packing, tokenizer=args.tokenizer)
    # every split's source before any is written: a bad one leaves no half-written directory
    sources = {split: open_source(args.source, split, options) for split in splits}
    max_bytes = parse_size(args.shard_size) if args.shard_size else None
    # object storage: each file is uploaded when finished (tars, indexes, the manifest last), from a scratch dir
    scratch, upload, cleanup = uploading(args.out_dir, storage) if remote else (Path(args.out_dir), None, None)
    try:
        for split, source in sources.items():
            with tqdm(total=source.size, unit="sample", desc=f"{split} shards", dynamic_ncols=True,
                      disable=args.quiet, file=sys.stderr) as bar:
                manifest = write_shards(source.samples, scratch, split, samples_per_shard=args.samples_per_shard,
                                        max_bytes=max_bytes, meta=source.meta, progress=bar.update, on_file=upload)
            _wrote(manifest, args.out_dir, split)
    finally:
        if cleanup is not None:
            cleanup()
    return 0


def _wrote(manifest: dict[str, Any], out: str, split: str) -> None:
    total = sum(s["bytes"] for s in manifest["shards"])
    print(f"wrote {manifest['total_samples']} samples in {len(manifest['shards'])} shards "
          f"({total / 1e6:.1f} MB) to {out} (split {split})")


def _is_remote(args: argparse.Namespace) -> bool:
    """Whether OUT_DIR is an object-store URL; one that names no object is refused here (exit 2),
    before any client is made."""
    if not is_url(args.out_dir):
        return False
    parse_url(args.out_dir, "OUT_DIR")
    return True


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """--storage-option NAME=VALUE (repeatable), checked like data.storage_options (true/false and
    whole numbers typed as the config's YAML would type them)."""
    raw: dict[str, Any] = {}
    for item in args.storage_option or []:
        name, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--storage-option {item!r} is not NAME=VALUE; example: --storage-option "
                            "endpoint_url=http://minio:9000")
        number = value.isascii() and value.isdigit()
        raw[name] = {"true": True, "false": False}.get(value.lower(), int(value) if number else value)
    return check_storage_options("--storage-option", raw)


def _shard_splits(args: argparse.Namespace) -> tuple[str, ...]:
    """--split, else the source's own splits (text: a corpus's split folders, else train and val by
    document; train only with --val-fraction 0)."""
    if args.split:
        return (args.split,)
    if args.source.startswith("text:"):
        from hpctrain.data.text import split_folders  # imports torch: only for text sources

        folders = split_folders(args.source.removeprefix("text:"))
        if folders:
            return tuple(folders)
        if args.val_fraction == 0:
            return ("train",)
    return pack_source(args.source)[0].pack_splits


def _val_fraction(args: argparse.Namespace) -> float:
    """--val-fraction; for ``text:PATH --split S`` without it, PATH is all of S (the corpus's own
    split: re-splitting it would drop a share of S's documents)."""
    if args.val_fraction is not None:
        return float(args.val_fraction)
    if args.source.startswith("text:") and args.split in ("train", "val"):
        return 0.0 if args.split == "train" else 1.0
    return VAL_FRACTION


def _other_classes(root: Path, writing: Sequence[str]) -> tuple[str, ...] | None:
    """The class names of a split already in ``root`` that this command does not rewrite (train's
    first): an image folder numbers its labels by them, so a class has one label in every split."""
    others = sorted((p for p in root.glob("*.manifest.json") if p.name[: -len(".manifest.json")] not in writing),
                    key=lambda p: p.name != "train.manifest.json")
    for path in others:
        try:
            classes = json.loads(path.read_text()).get("classes")
        except (OSError, json.JSONDecodeError, AttributeError):
            continue  # not a manifest to follow; `hpctrain data verify` names it
        if classes:
            return tuple(str(c) for c in classes)
    return None


def _splits(root: Path, split: str | None, unlisted: list[Problem]) -> list[str]:
    if split:
        return [split]
    found = sorted(p.name[: -len(".manifest.json")] for p in root.glob("*.manifest.json"))
    if not found and not unlisted:
        raise ShardError(f"{root} holds no *.manifest.json; hint: hpctrain data shard SOURCE {root}")
    return found


def cmd_verify(args: argparse.Namespace) -> int:
    if _is_remote(args):
        return 1 if verify_remote(args.out_dir, _storage_options(args), args.split, not args.quick, _report) else 0
    root = Path(args.out_dir)
    unlisted = [] if args.split else unlisted_shards(root)  # shards whose manifest is gone fail too
    splits = _splits(root, args.split, unlisted)
    unlisted += [] if args.split else class_mismatches(root, splits)
    bad = 0
    for split in splits:
        problems = verify(root, split, deep=not args.quick)
        for p in problems:
            print(f"FAIL {split}: {p}", file=sys.stderr)
        bad += len(problems)
        if not problems:
            print(f"ok   {split}: every shard matches the manifest and its index")
    for p in unlisted:
        print(f"FAIL {p}", file=sys.stderr)
    return 1 if bad or unlisted else 0


def _report(split: str, problems: list[Problem]) -> None:
    for p in problems:
        print(f"FAIL {split}: {p}", file=sys.stderr)
    if not problems:
        print(f"ok   {split}: every shard matches the manifest and its index")


def cmd_inspect(args: argparse.Namespace) -> int:
    # on object storage: the manifests as mirrored (what a run reads)
    rows = summarize(mirror(args.out_dir, _storage_options(args)) if _is_remote(args) else args.out_dir)
    if not rows:
        raise ShardError(f"{args.out_dir} holds no *.manifest.json; hint: hpctrain data shard SOURCE {args.out_dir}")
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        lo, hi = r["samples_per_shard"]
        classes = r["classes"]
        shown = ", ".join(classes[:12]) + (" ..." if len(classes) > 12 else "")
        print(f"split {r['split']}: {r['samples']} samples in {r['shards']} shards, {r['bytes'] / 1e6:.1f} MB "
              f"({lo}-{hi} samples per shard); fields {r['fields']}; source {r['source']}")
        print(f"  {len(classes)} classes: {shown}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    manifest = index_existing(args.dir, args.split, args.pattern)
    print(f"indexed {manifest['total_samples']} samples in {len(manifest['shards'])} shards; "
          f"wrote {args.split}.manifest.json in {args.dir}")
    return 0


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (UserError, CorruptSampleError, FileNotFoundError) as err:  # ShardError, a missing package, ...
            print(f"hpctrain data {args.data_command}: error: {err}", file=sys.stderr)
            return 2
    return run


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``hpctrain data ...`` on the main parser's subcommands."""
    parser = subparsers.add_parser("data", help="pack data into tar shards (WebDataset layout), verify, inspect")
    sub = parser.add_subparsers(dest="data_command", required=True)

    p = sub.add_parser("shard", help="write SOURCE as OUT_DIR/<split>-NNNNNN.tar + index + manifest")
    p.add_argument("source", help=" | ".join(pack_choices()) + " (text:PATH: a file, a directory or a tar.gz)")
    p.add_argument("out_dir")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--samples-per-shard", type=int, help="samples per shard")
    size.add_argument("--shard-size", help="bytes per shard, e.g. 256MB (default when neither is given)")
    p.add_argument("--split", choices=["train", "val", "test"],
                   help="the split to write (default: train; text: both train and val, split by document)")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                   help="text: tokens per sample (windows of seq-len + 1)")
    p.add_argument("--glob", help="text: which files of a directory or tar are documents (default *.txt)")
    p.add_argument("--val-fraction", type=float, default=None,
                   help=f"text: share of documents held out as val (default {VAL_FRACTION}; 0: all train, 1: all val; "
                        "text:PATH --split S without it: all of PATH is S; train/ and val/ folders: kept; one "
                        "document: the share of its tokens held out, its tail)")
    p.add_argument("--num-classes", type=int,
                   help="labelled sources: refuse labels outside [0, N) (default: N = the largest label + 1)")
    p.add_argument("--image-size", type=int, metavar="N",
                   help="imagefolder: resize every image to N x N (default: all images must share one size)")
    p.add_argument("--allow-missing-classes", action="store_true",
                   help="imagefolder: write a split that lacks some classes of the split already in OUT_DIR "
                        "(labels still follow the class names)")
    p.add_argument("--input-column", action="append", metavar="NAME",
                   help="csv/parquet/jsonl/hf: an input column (repeat for several; default: every column but "
                        "the label); jsonl: packs the records as a table")
    p.add_argument("--label-column", default="label", metavar="NAME",
                   help="csv/parquet/jsonl/hf: the column of class ids 0..C-1 (default: label)")
    p.add_argument("--packing", choices=["windows", "documents"], default="windows",
                   help="text: windows = each document cut on its own (default); documents = documents packed "
                        "into windows with their boundaries kept (docs/data.md)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="text: a Hugging Face tokenizer directory (save_pretrained), read offline (default: bytes)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _storage_flag(p)
    p.set_defaults(func=_guarded(cmd_shard))

    p = sub.add_parser("verify", help="check every shard against the manifest and its index (exit 1 on a mismatch)")
    p.add_argument("out_dir")
    p.add_argument("--split", help="one split (default: every manifest in OUT_DIR)")
    p.add_argument("--quick", action="store_true", help="sizes only (no sha256, no per-sample check)")
    _storage_flag(p)
    p.set_defaults(func=_guarded(cmd_verify))

    p = sub.add_parser("inspect", help="print counts, classes and sizes per split")
    p.add_argument("out_dir")
    p.add_argument("--json", action="store_true")
    _storage_flag(p)
    p.set_defaults(func=_guarded(cmd_inspect))

    p = sub.add_parser("index", help="index tars written by another tool (e.g. webdataset.ShardWriter)")
    p.add_argument("dir")
    p.add_argument("--split", default="train")
    p.add_argument("--pattern", help="glob of the tars (default: <split>-*.tar)")
    p.set_defaults(func=_guarded(cmd_index))
    return parser


def _storage_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", metavar="NAME=VALUE",
                   help="OUT_DIR on object storage (s3://BUCKET/PREFIX): endpoint_url, addressing_style, region, "
                        "profile, anon, retries, as data.storage_options (credentials: AWS_ACCESS_KEY_ID / "
                        "AWS_SECRET_ACCESS_KEY or AWS_PROFILE in the environment)")
