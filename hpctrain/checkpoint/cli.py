"""``hpctrain ckpt list RUN_DIR | verify PATH | export PATH OUT``."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint import layout, tensorfile
from hpctrain.checkpoint.state import SHARDED_DIR


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("ckpt", help="list, verify or export checkpoints")
    actions = p.add_subparsers(dest="action", required=True)
    a = actions.add_parser("list", help="committed checkpoints of a run directory")
    a.add_argument("run_dir")
    a.add_argument("--verify", action="store_true", help="also check every file's size and checksum")
    a.set_defaults(func=cmd_list)
    a = actions.add_parser("verify", help="check sizes and checksums; exit 1 on any corruption")
    a.add_argument("path", help="a checkpoint directory, or a run directory (all its checkpoints)")
    a.set_defaults(func=cmd_verify)
    a = actions.add_parser("export", help="consolidated model weights as .pt or .safetensors")
    a.add_argument("path", help="a checkpoint directory, or a run directory (its newest intact checkpoint)")
    a.add_argument("out", help="output file: *.pt or *.safetensors")
    a.set_defaults(func=cmd_export)


def _targets(path: Path) -> list[Path]:
    if (path / layout.MANIFEST).is_file():
        return [path]
    for root in (layout.checkpoints_dir(path), path):
        found = [p for _, p in layout.committed(root)]
        if found:
            return found
    return []


def cmd_list(args: argparse.Namespace) -> int:
    if not Path(args.run_dir).is_dir():
        print(f"hpctrain ckpt list: error: run directory {args.run_dir} does not exist (or is not a directory)",
              file=sys.stderr)
        return 2
    root = layout.checkpoints_dir(Path(args.run_dir))
    entries = layout.committed(root)
    if not entries:
        print(f"no committed checkpoints in {root}")
        return 0
    best = layout.best_step(root)
    print(f"{'checkpoint':<16} {'step':>9} {'epoch':>6} {'world':>5} {'size MB':>9}  {'created':<20} status")
    for step, path in entries:
        m = layout.read_manifest(path)
        size = sum(f["size"] for f in m["files"].values()) / 1e6
        status = ("ok" if not layout.verify(path) else "CORRUPT") if args.verify else "committed"
        mark = "  best" if step == best else ""
        print(f"{path.name:<16} {step:>9} {m.get('epoch', '?'):>6} {m.get('world_size', '?'):>5} {size:>9.1f}  "
              f"{m.get('created', '?'):<20} {status}{mark}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    targets = _targets(Path(args.path))
    if not targets:
        print(f"hpctrain ckpt verify: error: {args.path} holds no committed checkpoint; hint: give a checkpoint "
              "or run directory (`hpctrain ckpt list RUN_DIR`)", file=sys.stderr)
        return 2  # wrong input; 1 means a checkpoint is corrupt
    bad = 0
    for path in targets:
        problems = layout.verify(path)
        bad += bool(problems)
        print(f"{path}: {'ok' if not problems else 'CORRUPT'}")
        for problem in problems:
            print(f"  {problem}")
    return 1 if bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix not in (".pt", ".safetensors"):
        print(f"hpctrain ckpt export: {out} must end in .pt or .safetensors", file=sys.stderr)
        return 2
    try:
        path = layout.resolve(args.path)
        problems = layout.verify(path)
        if problems:
            raise layout.CheckpointError(f"{path} is corrupt: {'; '.join(problems)}")
        weights = consolidated_model(path)
    except layout.CheckpointError as err:
        print(f"hpctrain ckpt export: error: {err}", file=sys.stderr)
        return err.exit_code  # 2: no checkpoint there; 1: a corrupt one
    write_weights(weights, out)
    print(f"wrote {out} ({len(weights)} tensors, step {layout.read_manifest(path).get('step')}) from {path}")
    return 0


def consolidated_model(path: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint, sharded (DCP) or not, without a process group."""
    manifest = layout.read_manifest(path)
    if manifest.get("format") != "dcp":
        from hpctrain.checkpoint.checkpointer import load_replicated

        return dict(load_replicated(path)["model"])
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(path / SHARDED_DIR), str(full))
        return dict(torch.load(full, map_location="cpu", weights_only=True)["model"])


def write_weights(weights: dict[str, torch.Tensor], out: Path) -> None:
    """``.safetensors`` (written by tensorfile: no extra package needed) or ``.pt``, atomically."""
    import os

    from hpctrain.rundir import replace_durably

    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in weights.items()}  # no shared storage
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if out.suffix == ".safetensors":
        tensorfile.write(tmp, tensors)
    else:
        layout.save_file(tensors, tmp)
    replace_durably(tmp, out)
