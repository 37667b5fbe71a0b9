"""``hpctrain ckpt list PATH | verify PATH | export PATH OUT | --adapters DIR | --merged FILE``: PATH is
a run directory, its ``checkpoints/`` folder or one checkpoint (:mod:`hpctrain.weights.locate`,
each command says which it read; nothing committed there: exit 2). Each also takes the URL of a
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
from typing import Any

from hpctrain.checkpoint import confine, layout, remote
from hpctrain.checkpoint.view import manifest_format, view_class
from hpctrain.core.errors import UserError
from hpctrain.core.safe_pickle import UnsafePickleError, check_torch_archive
from hpctrain.parallel import checkpoint_formats  # noqa: F401  # the formats' registry lines (torch-free)
from hpctrain.weights.locate import checkpoint_source, locate, newest_intact

__all__ = ["add_parser", "checkpoint_source"]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("ckpt", help="list, verify or export checkpoints")
    actions = p.add_subparsers(dest="action", required=True)
    a = actions.add_parser("list", help="committed checkpoints of a run directory")
    a.add_argument("run_dir", help=WHERE)
    a.add_argument("--verify", action="store_true", help="also check every file's size and checksum (and what "
                   "the pickles and tensor headers hold); exit 1 when one is corrupt, 2 when one is refused")
    a.set_defaults(func=cmd_list)
    a = actions.add_parser("verify", help="check sizes, checksums and what the pickles may hold; exit 1 on any "
                                          "corrupt file, 2 on a crafted one; unreadable: 2 (permissions) or 1 (I/O)")
    a.add_argument("path", help=f"{WHERE} (each of its checkpoints)")
    a.set_defaults(func=cmd_verify)
    a = actions.add_parser("export", help="consolidated model weights as .pt or .safetensors; a LoRA checkpoint's "
                                          "adapters as PEFT's folder (--adapters) or merged into the base (--merged)")
    a.add_argument("path", help=f"{WHERE} (its newest intact checkpoint)")
    a.add_argument("out", nargs="?", help="output file: *.pt or *.safetensors")
    a.add_argument("--adapters", metavar="DIR", help="a PEFT model's checkpoint: adapter_model.safetensors + "
                   "adapter_config.json, as PeftModel.from_pretrained(base, DIR) loads them")
    a.add_argument("--merged", metavar="FILE", help="a PEFT model's checkpoint: the base with the adapters merged "
                   "in (merge_and_unload), as *.safetensors or *.pt")
    a.add_argument("--base", metavar="DIR", help="--merged: the base model's folder (default: the adapter config's "
                   "base_model_name_or_path); checked against the checkpoint's digest of its base")
    a.set_defaults(func=cmd_export)


WHERE = "a run directory, its checkpoints/ folder or one checkpoint (RUN/checkpoints/step-N)"


def cmd_list(args: argparse.Namespace) -> int:
    if remote.is_remote(args.run_dir):
        return _list_remote(args.run_dir, args.verify)
    try:
        found = locate(args.run_dir)  # a run dir, its checkpoints/ folder or one checkpoint
    except layout.CheckpointError as err:  # nothing there (2), or a folder that cannot be listed
        print(f"hpctrain ckpt list: error: {err}", file=sys.stderr)
        return err.exit_code
    print(found.describe())
    best = layout.best_step(found.root)
    return _print_rows([(path.name, step, lambda p=path: layout.read_manifest(p),
                         (lambda p=path: _verify_one(p)) if args.verify else None, step == best)
                        for step, path in found.checkpoints])


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
    try:
        found = locate(args.path)
    except layout.CheckpointError as err:  # nothing there: wrong input (2); 1 means a checkpoint is corrupt
        print(f"hpctrain ckpt verify: error: {err}", file=sys.stderr)
        return err.exit_code
    print(found.describe())
    return max(_report(str(path), _verify_one(path)) for _, path in found.checkpoints)


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
            # torch: the weights-only load a resume makes, the one check a crafted pickle with right hashes meets
            from hpctrain.checkpoint.checkpointer import load_file
            load_file(path / name, manifest["files"])
        except (UnsafePickleError, layout.CheckpointError) as err:
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
    from hpctrain.weights.export import SUFFIXES, ExportError

    wanted = [flag for flag in ("out", "adapters", "merged") if getattr(args, flag)]
    if len(wanted) != 1:
        print("hpctrain ckpt export: error: give one of OUT, --adapters DIR or --merged FILE"
              f"{' (got ' + ', '.join(wanted) + ')' if wanted else ''}", file=sys.stderr)
        return 2
    target = Path(args.out or args.merged or "")
    if not args.adapters and target.suffix not in SUFFIXES:
        print(f"hpctrain ckpt export: {target} must end in .pt or .safetensors", file=sys.stderr)
        return 2
    try:
        with _export_source(args.path) as (path, where):
            said = _export(args, path)
            step = layout.read_manifest(path).get("step")
    except (layout.CheckpointError, ExportError, UnsafePickleError, TensorFileError, UserError) as err:
        print(f"hpctrain ckpt export: error: {err}", file=sys.stderr)
        # 2: no checkpoint there, or a crafted one refused; 1: a corrupt one, or the output cannot be written
        return err.exit_code
    print(f"wrote {said}, step {step}, from {where}")
    return 0


def _export(args: argparse.Namespace, path: Path) -> str:
    """Write what ``args`` asks of the checkpoint at ``path``; returns what was written, in words."""
    # torch: export only (list and verify, a login node's, do not load it)
    from hpctrain.weights import adapters, frozen
    from hpctrain.weights.export import Written, write_stream

    if args.adapters:
        files = adapters.write_adapters(path, Path(args.adapters))
        return ", ".join(f"{w.path} ({w.tensors} tensors, {w.nbytes / 1e6:.3f} MB) + adapter_config.json"
                         for w in files)
    written: Written | None
    if args.merged:
        written = adapters.write_merged(path, Path(args.merged), Path(args.base) if args.base else None)
    else:
        if frozen.read_base_record(path) is not None:
            raise UserError(f"checkpoint {path} holds only the trained parameters of a frozen base (LoRA): alone "
                            "they are no model; hint: --adapters DIR (PEFT's adapter folder) or --merged FILE (the "
                            "base with them merged in)")
        written = write_stream(Path(args.out), checkpoint_source(path))
    assert written is not None  # write=True
    return f"{written.path} ({written.tensors} tensors, {written.nbytes / 1e6:.1f} MB)"


@contextmanager
def _export_source(spec: str) -> Iterator[tuple[Path, str]]:
    """(a local checkpoint directory, what to call it): a local path's, or the newest remote
    checkpoint of a URL that downloads intact (corrupt ones are said and skipped)."""
    if not remote.is_remote(spec):
        found = newest_intact(locate(spec))  # a download is checked against its manifest as it lands
        if found.problems:
            raise layout.CheckpointError(f"{found.path} is corrupt: {'; '.join(found.problems)}")
        yield found.path, str(found.path)
        return
    store, entries = _remote_tier(spec)
    with tempfile.TemporaryDirectory(prefix="hpctrain-ckpt-") as tmp:
        fetched = remote.fetch_newest(store, entries, Path(tmp))  # corrupt ones are skipped, said in the log
        if fetched is None:
            raise layout.NoCheckpointError(f"{spec} holds no intact committed checkpoint; "
                                           f"hint: `hpctrain ckpt list {spec}`")
        yield fetched, f"{store.url}/{fetched.name}"
