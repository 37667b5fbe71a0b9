"""``hpctrain ckpt list RUN_DIR | verify PATH | export PATH OUT``; each also takes the URL of a
remote tier (``s3://BUCKET/PREFIX``, checkpoint.remote) or of one checkpoint in it
(``s3://BUCKET/PREFIX/step-N``): listed from the store, verified and exported from a download
into a temporary directory (``$TMPDIR``)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.checkpoint import confine, layout, remote
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
    if remote.is_remote(args.run_dir):
        return _list_remote(args.run_dir, args.verify)
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
    return _print_rows([(path.name, step, lambda p=path: layout.read_manifest(p),
                         (lambda p=path: _verify_one(p)) if args.verify else None, step == best)
                        for step, path in entries])


Row = tuple[str, int, Any, Any, bool]  # name, step, read its manifest, verify it (None: not asked), best


def _print_rows(rows: list[Row]) -> int:
    print(f"{'checkpoint':<16} {'step':>9} {'epoch':>6} {'world':>5} {'size MB':>9}  {'created':<20} status")
    code, notes = 0, []
    for name, step, read, verify, best in rows:
        try:
            m = read()
        except layout.CheckpointError as err:  # a bad manifest is shown as such; the others are still listed
            status, exit_code = ("UNREADABLE", err.exit_code) if isinstance(err, layout.UnreadableCheckpointError) \
                else ("CORRUPT", 1)
            code, m = max(code, exit_code), {}
            notes.append(f"{name}: {err}")
        else:
            status, problems, exit_code = verify() if verify is not None else ("committed", [], 0)
            code = max(code, exit_code)
            notes += [f"{name}: {problem}" for problem in problems]
        size = f"{sum(f['size'] for f in m['files'].values()) / 1e6:>9.1f}" if m else f"{'?':>9}"
        mark = "  best" if best else ""
        print(f"{name:<16} {step:>9} {m.get('epoch', '?'):>6} {m.get('world_size', '?'):>5} {size}  "
              f"{m.get('created', '?'):<20} {status}{mark}")
    for note in notes:
        print(f"  {note}")
    return code


def _remote_tier(url: str) -> tuple[Any, list[tuple[int, str]]]:
    """(store, committed checkpoints as (step, name)) of a tier URL, or of one checkpoint's URL
    (endpoint and credentials from the environment: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)."""
    return remote.resolve_url(url, key="hpctrain ckpt")


@contextmanager
def _downloaded(store: Any, name: str) -> Iterator[Path]:
    """Remote checkpoint ``name`` downloaded (and checked against its manifest) into a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="hpctrain-ckpt-") as tmp:
        yield remote.download(store, name, Path(tmp))


def _verify_remote(store: Any, name: str) -> tuple[str, list[str], int]:
    try:
        with _downloaded(store, name) as path:
            return _verify_one(path, hashed=True)
    except layout.UnreadableCheckpointError as err:
        return "UNREADABLE", [str(err)], err.exit_code
    except layout.CheckpointError as err:  # a file missing, or not matching its manifest
        return "CORRUPT", [str(err)], 1


def _list_remote(url: str, verify: bool) -> int:
    store, entries = _remote_tier(url)
    if not entries:
        print(f"no committed checkpoints in {url}")
        return 0
    return _print_rows([(name, step, lambda n=name: remote.read_manifest(store, n),
                         (lambda n=name: _verify_remote(store, n)) if verify else None, False)
                        for step, name in entries])


def cmd_verify(args: argparse.Namespace) -> int:
    if remote.is_remote(args.path):
        store, entries = _remote_tier(args.path)
        if not entries:
            print(f"hpctrain ckpt verify: error: {args.path} holds no committed checkpoint; hint: `hpctrain ckpt list "
                  f"{args.path}`", file=sys.stderr)
            return 2
        return max(_report(f"{store.url}/{name}", _verify_remote(store, name)) for _, name in entries)
    targets = _targets(Path(args.path))
    if not targets:
        print(f"hpctrain ckpt verify: error: {args.path} holds no committed checkpoint; hint: give a checkpoint "
              "or run directory (`hpctrain ckpt list RUN_DIR`)", file=sys.stderr)
        return 2  # wrong input; 1 means a checkpoint is corrupt
    return max(_report(str(path), _verify_one(path)) for path in targets)


def _report(where: str, outcome: tuple[str, list[str], int]) -> int:
    status, problems, exit_code = outcome
    print(f"{where}: {status}")
    for problem in problems:
        print(f"  {problem}")
    return exit_code


def _verify_one(path: Path, *, hashed: bool = False) -> tuple[str, list[str], int]:
    """(ok | CORRUPT | UNREADABLE | REFUSED, problems, exit code) of one checkpoint; ``hashed``: its
    files were already checked against the manifest (a download does that) and are not read twice."""
    try:
        problems = [] if hashed else layout.verify(path)
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
        with _export_source(args.path) as (path, where):
            written = write_stream(out, checkpoint_source(path))
            step = layout.read_manifest(path).get("step")
    except (layout.CheckpointError, ExportError, UnsafePickleError, TensorFileError) as err:
        print(f"hpctrain ckpt export: error: {err}", file=sys.stderr)
        # 2: no checkpoint there, or a crafted one refused; 1: a corrupt one, or the output cannot be written
        return err.exit_code
    assert written is not None  # write=True
    print(f"wrote {out} ({written.tensors} tensors, {written.nbytes / 1e6:.1f} MB, step {step}) from {where}")
    return 0


@contextmanager
def _export_source(spec: str) -> Iterator[tuple[Path, str]]:
    """(a local checkpoint directory, what to call it): a local path's, or the newest remote
    checkpoint of a URL that downloads intact (corrupt ones are said and skipped)."""
    if not remote.is_remote(spec):
        path = layout.resolve(spec)
        problems = layout.verify(path)  # a download is checked against its manifest as it lands
        if problems:
            raise layout.CheckpointError(f"{path} is corrupt: {'; '.join(problems)}")
        yield path, str(path)
        return
    store, entries = _remote_tier(spec)
    with tempfile.TemporaryDirectory(prefix="hpctrain-ckpt-") as tmp:
        fetched = remote.fetch_newest(store, entries, Path(tmp))  # corrupt ones are skipped, said in the log
        if fetched is None:
            raise layout.NoCheckpointError(f"{spec} holds no intact committed checkpoint; "
                                           f"hint: `hpctrain ckpt list {spec}`")
        yield fetched, f"{store.url}/{fetched.name}"


def checkpoint_source(path: Path) -> Source:
    """A committed checkpoint's model tensors, without a process group, from the view class of
    its manifest's format (a sharded checkpoint's read one at a time, never the optimizer state)."""
    source: Source = view_class(manifest_format(layout.read_manifest(path))).export(path)
    return source
