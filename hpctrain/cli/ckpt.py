"""``hpctrain ckpt list RUN_DIR | verify PATH | export PATH OUT``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.checkpoint import confine, layout
from hpctrain.checkpoint.view import manifest_format, view_class
from hpctrain.core.safe_pickle import UnsafePickleError, check_torch_archive
from hpctrain.parallel import checkpoint_formats  # noqa: F401  # the formats' registry lines (torch-free)

if TYPE_CHECKING:
    from hpctrain.weights.export import Source


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("ckpt", help="list, verify or export checkpoints")
    actions = p.add_subparsers(dest="action", required=True)
    a = actions.add_parser("list", help="committed checkpoints of a run directory")
    a.add_argument("run_dir")
    a.add_argument("--verify", action="store_true", help="also check every file's size and checksum (and what "
                   "the pickles and tensor headers hold); exit 1 when one is corrupt, 2 when one is refused")
    a.set_defaults(func=cmd_list)
    a = actions.add_parser("verify", help="check sizes, checksums and what the pickles may hold; exit 1 on any "
                                          "corrupt file, 2 on a crafted one; unreadable: 2 (permissions) or 1 (I/O)")
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
    code, notes = 0, []
    for step, path in entries:
        try:
            m = layout.read_manifest(path)
        except layout.CheckpointError as err:  # a bad manifest is shown as such; the others are still listed
            status, exit_code = ("UNREADABLE", err.exit_code) if isinstance(err, layout.UnreadableCheckpointError) \
                else ("CORRUPT", 1)
            code, m = max(code, exit_code), {}
            notes.append(f"{path.name}: {err}")
        else:
            status, _, exit_code = _verify_one(path) if args.verify else ("committed", [], 0)
            code = max(code, exit_code)
        size = f"{sum(f['size'] for f in m['files'].values()) / 1e6:>9.1f}" if m else f"{'?':>9}"
        mark = "  best" if step == best else ""
        print(f"{path.name:<16} {step:>9} {m.get('epoch', '?'):>6} {m.get('world_size', '?'):>5} {size}  "
              f"{m.get('created', '?'):<20} {status}{mark}")
    for note in notes:
        print(f"  {note}")
    return code


def cmd_verify(args: argparse.Namespace) -> int:
    targets = _targets(Path(args.path))
    if not targets:
        print(f"hpctrain ckpt verify: error: {args.path} holds no committed checkpoint; hint: give a checkpoint "
              "or run directory (`hpctrain ckpt list RUN_DIR`)", file=sys.stderr)
        return 2  # wrong input; 1 means a checkpoint is corrupt
    code = 0
    for path in targets:
        status, problems, exit_code = _verify_one(path)
        code = max(code, exit_code)
        print(f"{path}: {status}")
        for problem in problems:
            print(f"  {problem}")
    return code


def _verify_one(path: Path) -> tuple[str, list[str], int]:
    """(ok | CORRUPT | UNREADABLE | REFUSED, problems, exit code) of one checkpoint."""
    try:
        problems = layout.verify(path)
        if problems:
            return "CORRUPT", problems, 1
        unsafe = _unsafe_contents(path)
    except layout.UnreadableCheckpointError as err:  # not corrupt: its permissions or its disk are the problem
        return "UNREADABLE", [str(err)], err.exit_code
    return ("REFUSED", unsafe, 2) if unsafe else ("ok", [], 0)


def _unsafe_contents(path: Path) -> list[str]:
    """Checksums cannot tell a crafted file from a real one (whoever wrote it can rewrite the
    manifest): every pickle a resume would load is checked as the resume checks it: each
    torch.save file against safe_pickle's limits (nesting, size, zip bomb; no torch needed),
    and the files of the manifest's format as its view checks them before a resume reads them
    (a sharded checkpoint's metadata with only its own classes admitted, and its items)."""
    manifest = layout.read_manifest(path)
    problems = []
    for name in sorted(n for n in manifest["files"] if "/" not in n and n.endswith(".pt")):  # skeleton, per rank
        try:
            fh, _ = confine.open_regular(path / name, path)
            with fh:
                check_torch_archive(fh, str(path / name))
        except UnsafePickleError as err:
            problems.append(str(err))
        except OSError as err:
            raise layout.unreadable(path / name, err) from err
    problems += _bad_tensor_headers(path, manifest)
    view = view_class(manifest_format(manifest))
    if view.files_dir is not None:
        try:
            view.check_files(path)
        except layout.UnreadableCheckpointError:
            raise
        except layout.CheckpointError as err:
            problems.append(str(err))
    return problems


def _bad_tensor_headers(path: Path, manifest: dict[str, Any]) -> list[str]:
    """A tensor file's header is checked as a resume checks it before allocating anything (a
    length within the file, no deep nesting, known dtypes, non-negative shapes whose bytes are
    the offsets' span): a checksum rewritten to match proves none of that."""
    from hpctrain.checkpoint import tensorfile  # torch: only verify reads tensor headers, `ckpt list` loads none

    problems = []
    for name in sorted(n for n in manifest["files"] if n.endswith(".safetensors")):
        try:
            tensorfile.read_header(path / name, path)
        except (tensorfile.TensorFileError, layout.CheckpointError) as err:
            problems.append(str(err))
        except OSError as err:
            raise layout.unreadable(path / name, err) from err
    return problems


def cmd_export(args: argparse.Namespace) -> int:
    # Here, not at the top: export needs torch, and list and verify (a login node's) do not.
    from hpctrain.checkpoint.tensorfile import TensorFileError
    from hpctrain.weights.export import SUFFIXES, ExportError, write_stream

    out = Path(args.out)
    if out.suffix not in SUFFIXES:
        print(f"hpctrain ckpt export: {out} must end in .pt or .safetensors", file=sys.stderr)
        return 2
    try:
        path = layout.resolve(args.path)
        problems = layout.verify(path)
        if problems:
            raise layout.CheckpointError(f"{path} is corrupt: {'; '.join(problems)}")
        written = write_stream(out, checkpoint_source(path))
    except (layout.CheckpointError, ExportError, UnsafePickleError, TensorFileError) as err:
        print(f"hpctrain ckpt export: error: {err}", file=sys.stderr)
        # 2: no checkpoint there, or a crafted one refused; 1: a corrupt one, or the output cannot be written
        return err.exit_code
    assert written is not None  # write=True
    print(f"wrote {out} ({written.tensors} tensors, {written.nbytes / 1e6:.1f} MB, step "
          f"{layout.read_manifest(path).get('step')}) from {path}")
    return 0


def checkpoint_source(path: Path) -> Source:
    """A committed checkpoint's model tensors, without a process group, from the view class of
    its manifest's format (a sharded checkpoint's read one at a time, never the optimizer state)."""
    source: Source = view_class(manifest_format(layout.read_manifest(path))).export(path)
    return source
