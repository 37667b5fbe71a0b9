"""The fault suite (issue 17, point 7): every fault probe, N trials each, one table of counts.

    python benchmarks/faults.py [--trials N | --trials PROBE=N ...] [--only PROBE[,PROBE]] [--seed S] [--json OUT]

Run from the repository root (the probes train the tiny models of tests/), as root: the
disk-full probes mount a small tmpfs (``--disk-full inject`` where mounting is not permitted:
``ENOSPC`` raised at the checkpoint commit instead, as tests/checkpoint/test_durability.py does).
Launches run one after another. Per probe the table counts, over its trials: the exit codes
seen, tracebacks ("Traceback (most recent call last)" in any output), hangs (a command past its
time-out, then killed), data lost (a checkpoint committed before the fault missing or corrupt
afterwards, or a restart whose final ``params_sha256`` is not the uninterrupted run's) and
other failed expectations (a wrong exit code, a rank left alive, the wrong rank named). All
are expected to be zero; the script exits 1 otherwise.

Probes (default trials in brackets):

* ``disk_full_sync`` / ``disk_full_async`` / ``disk_full_final`` [1 each]: the run directory on
  an 8 MB tmpfs, filled to 32 KB free (a checkpoint needs 64 KB) at a random step, or at step
  100 of 128 for the final save, so the next sync save, async save or the final save fails:
  exit 1, every earlier checkpoint intact; the space freed, the same command resumes and ends
  bit-identical to the uninterrupted run.
* ``sigkill_async`` [4]: async saves every 4 steps; the launcher and every rank SIGKILLed at
  once at a random step, mostly while a save is in flight (``.partial-*`` on disk); committed
  checkpoints intact, the restart bit-identical. World size 1 and 2 alternate.
* ``shard_fuzz`` [200 mutations]: tests/test_fault_suite.py's fuzz (1-8 random bytes of a
  training shard), same seed, same first mutations: ``data verify`` exit 1, ``train`` exit 1
  or 2, each naming the shard; where only bytes outside every sample changed (the tar's
  end-of-archive blocks), training ends 0 bit-identical to training on the intact shards. In a
  worker process of its own, so a hang is seen.
* ``crafted_deep`` / ``crafted_dag`` / ``crafted_zip_bomb`` [1 each]: tests/checkpoint/
  test_crafted.py's files planted as the newest checkpoint: ``ckpt verify`` exit 2, then
  ``resume=auto`` skips it with the reason and trains on from the older one (exit 0).
* ``read_<kind>`` [1 each] (issue 25): tests/checkpoint/test_crafted_reads.py's crafted checkpoints
  (a FIFO or a symlink to ``/dev/urandom`` as a DCP file, manifests naming ``..`` and absolute
  paths, a 1 TiB sparse rank file, tensor-file headers 2^50 long, 200,000 deep or with negative
  dimensions, a 64 GiB tensor in a sparse file, manifests of the wrong types) as the newest
  checkpoint: ``ckpt verify`` and ``ckpt list --verify`` exit 1 or 2 naming it (not for the
  64 GiB file, whose hash is bounded but long), then ``resume=auto`` skips it with the reason and
  trains on from the older one (exit 0, step 8). Each command under a time-out: a hang counts.
* ``checkpoint_fuzz`` [3000 cases]: tests/checkpoint/test_fuzz_checkpoint.py (manifests, tensor-file
  headers; DCP metadata a third as many) with that many cases (the suite runs 300), one trial per fuzzer:
  its property failures are counted as failures, a case past its alarm as a hang.
* ``two_runs`` [2]: run A is SIGSTOPped at a random step (maybe mid-save) and a second run on
  its run.dir (``hpctrain train``, then ``hpctrain run -n 2``) must exit 2 naming A's pid; A
  then goes on and ends bit-identical, every metrics row there once, every checkpoint intact.
* ``launcher_kill`` [2]: SIGKILL of ``hpctrain run -n 2``'s process group at a random step: no
  rank alive 5 s later, the restart bit-identical.
* ``stalled_rank`` [2]: one random rank SIGSTOPped under ``--hang-timeout 3`` (2, then 3
  ranks): exit 4 within hang-timeout + 30 s, that rank named in ``hang-*/summary.txt``.

Issue 25's other classes, each through ``python -m hpctrain`` as a user runs it (the cases are
those of the tests named, imported from them):

* ``foreign_run_dir`` [1]: tests/test_rundir_safety.py. A run.dir holding another tool's
  ``config.yaml``, ``model.pt``, ``status.json``, ``metrics.jsonl``, ``checkpoints/best.json`` and
  ``checkpoints/epoch=3-step=1000.ckpt``, with ``resume=auto`` and with ``run.overwrite=true
  resume=never``: exit 2 naming what is there, every file byte-identical after (else data lost);
  ``run.dir=/`` and ``run.dir=~``: exit 2, nothing written there.
* ``nonfinite`` [1]: tests/train/test_nonfinite.py. ``optim.lr`` of 1e5, 1e6 or 1e8 with a
  validation each step: exit 1 naming the step and train.nonfinite=stop; every kept checkpoint
  before that step, intact and finite (its manifest and its tensors), best one of them,
  status.json "failed". An fp16 loss that overflows every step, under train.nonfinite=stop and
  skip (patience 3): exit 1 naming the loss scale, with the hint precision=bf16.
* ``config_fuzz`` [100 cases]: tests/test_config_fuzz.py. The attack's 13 cases first (a 700-byte
  alias bomb at the top and in optim.kwargs, through ``config show`` and ``train``: exit 2 at once;
  a non-UTF-8 byte: exit 2 naming it; ``model.name=`id```, ``run.dir=@x``, ``data.path=[x`` and
  others: exit 0, kept verbatim; ``optim.lr=`x``: exit 2), then its generators' mutated files and
  random overrides by turns through ``config show``: exit 0, or 2 with one line; never a traceback,
  never past 60 s.
* ``shard_crafted`` [1]: tests/data/test_shard_confine.py. A ``.cls`` member declaring 100 GB
  (``data index`` and ``train``: exit 2 naming it), a negative index range (``data verify`` exit 1,
  ``train`` 1 or 2, naming the shard), manifests naming ``../outside/train-000000.tar`` and
  ``../../outside.tar``, both real shards (``data verify``, ``train`` and ``train`` staging under
  ``$SLURM_TMPDIR``: exit 2 naming the name). An audit hook in the hpctrain process records every
  ``open`` of the outside files: any is data read outside data.path (counted as lost).
* ``shard_index_fuzz`` [48 cases]: tests/data/test_shard_fuzz.py's generators by turns: a mutated
  shard index, a mutated shard manifest (``data verify``; ``train`` on every 4th case but the
  tars), a tar with one lie (``data index``, ``data verify``); a copy of the shards beside
  data.path is the bait the mutations name. Exit 0, 1 or 2, at most one error line (exit 2
  naming a file of data.path), no traceback, no hang, no open of the bait.
* ``slurm_render`` [1]: tests/launch/test_slurm_mounts_env.py. ``hpctrain slurm --dry-run`` with
  ``,`` and ``:`` in data.path and --mount (Apptainer and Pyxis) and ``--env MAX_REQUEUES=``,
  ``SLURM_RESTART_COUNT=``, ``RUN_DIR=``: exit 2 naming the value (and the runtime's option),
  nothing rendered, nothing written; the same command without them renders (exit 0).
* ``stalled_in_agreement`` [4]: a rank SIGSTOPped under ``--hang-timeout 8``, outside any save or
  validation: exit 4 naming it within 8 + 12 s of the stall, judged after under 16 s of silence
  (the long phases' allowance, 3 x, would be 24 s). Even trials: ``hpctrain train`` (2 ranks,
  checkpoints off), a random rank stopped at a random step; odd trials: tests/launch/
  test_hang_phases.py's loop, rank 1 stopping itself right before the preemption agreement.
* ``killed_rank`` [2]: rank 0, then rank 1, of a 2-rank ``hpctrain train`` SIGKILLed at a random
  step (tests/launch/test_first_cause.py): exit 1, the survivor's error "rank N ended with signal 9
  (SIGKILL), so this rank failed too", the launcher's "... first", status.json's error the same;
  no "internal error"; the checkpoints committed before intact.

Issue 42's new surfaces, against tests/s3_server.py's moto server where a store is needed (one
server for the suite, a bucket per trial, ``HPCTRAIN_CACHE`` inside the trial). Every command:
an expected exit code, at most one error line, no "internal error", no traceback, within its
time-out; the test secret access key in no output and no file of the trial (else data lost):

* ``s3_keys`` [24]: by turns (1) a URL with ``..``, ``//``, a space, ``?`` or a control character
  through ``data verify``, ``ckpt list``, ``train data.path=`` or ``checkpoint.remote=``: exit 2;
  (2) ``region=`` naming a host (``x@127.0.0.1:PORT/#`` ...) on a listening socket: exit 2 and no
  connection reached it; (3) 1-3 stray keys with such segments under a prefix of good shards:
  ``data verify`` and ``train`` exit 0 (the keys skipped and named).
* ``s3_manifests`` [10]: ``HPCTRAIN_MAX_JSON_BYTES`` of 64 KiB; by turns a manifest past it, an
  index past it without ``index_sha256``, a fuzzed manifest, a tar deleted between the listing
  and its read (a wrapper deletes it when ``hpctrain.data.remote.mirror`` returns), a manifest
  without shards: exit 1 or 2 naming the limit / the tar's URL (the fuzzed one: 0, 1 or 2), never
  "0 of the 0 shards", no JSON past the limit in the cache.
* ``tokenizer_folders`` [8]: ``data shard --tokenizer`` on an ``auto_map`` folder with "y" on
  stdin (exit 2 naming auto_map, its code never run, no ``[y/N]`` prompt), a FIFO or /dev/zero as
  tokenizer.json, a FIFO tokenizer.model, ids 3,000,000,000 and 2^31-1 (exit 2, or 0 with a
  vocab_size above the id), a backtracking ``(a+)+$`` pre-tokenizer, a jsonl record that is no
  UTF-8 (naming the file); 60 s each.
* ``mix_fuzz`` [60]: a random ``data.mix`` of 1 to 3,000 sources (weights good, 0, tiny, 1e308,
  +-inf, nan, negative, a 401-digit integer, true, a string, null, a list) through ``config
  show``: exit 0 exactly when the weights make a mixture (at most 1024 sources, finite, >= 0, a
  finite sum > 0, each positive one >= 1e-6 of it), else 2 (naming the count past 1024); every 4th
  good one of <= 8 sources trains 2 steps, its summary counting 16 samples over every source.
* ``remote_ckpt`` [6]: run A uploads steps 4 and 8; then, by turns, a crafted newer checkpoint
  (named 99 with a manifest of 8; files ``x`` and ``x/y``; a 300-character file name; a rank file
  with a ``__reduce__`` payload and right hashes; stray ``..``/``//`` keys beside an intact newer
  one): ``resume=auto`` in a new run dir exit 0 from step 8 (or the intact newer one), the payload
  never run, ``ckpt list`` 0/1, ``ckpt verify`` of it 1/2 (the payload's: any); or two runs: B on A's prefix while A is
  SIGSTOPped: exit 2 "is in use by run", the tier's keys unchanged, A then ends 0 with step 128 up.
* ``estimator_inputs`` [58]: ``estimate --hf-config`` on the intact llama-2-7b config.json (exit
  0) and on crafted ones (10^30, 5,000 digits, 200,000 deep, 1e12 experts, NaN, negative heads,
  wrong types, a FIFO, /dev/zero, a 4 GiB sparse file, not UTF-8, an array) and ``estimate``/``plan``
  flags beyond physical sense (``--params 1e400``/``nan``, 10^12 GPUs, ``-n 1e9 --nodes 1e9``, ``data.batch_size=1e11``,
  ``model.n_layers=1e9 model.hidden=1e9``, ``--gpu-memory-gb nan``): exit 0 printing no nan/inf,
  or 2, within 30 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpctrain.checkpoint import layout  # noqa: E402
from hpctrain.config import key_names  # noqa: E402
from hpctrain.core.rundir import MARKER  # noqa: E402
from hpctrain.data.manifest import manifest_path  # noqa: E402
from tests import test_config_fuzz as config_fuzz_tests  # noqa: E402
from tests import test_rundir_safety as rundir_safety  # noqa: E402
from tests.checkpoint import test_crafted as crafted  # noqa: E402
from tests.checkpoint import test_crafted_reads as crafted_reads  # noqa: E402
from tests.checkpoint import test_preempt as preempt  # noqa: E402
from tests.ckpt_models import SLOW_RUN_ARGS  # noqa: E402
from tests.data import test_shard_confine as shard_confine  # noqa: E402
from tests.data import test_shard_fuzz as shard_fuzz_tests  # noqa: E402
from tests.dist_utils import _descendants, launch_env  # noqa: E402
from tests.launch import test_hang as hang  # noqa: E402
from tests.launch import test_hang_phases as hang_phases  # noqa: E402
from tests.launch import test_slurm_mounts_env as slurm_tests  # noqa: E402
from tests.test_fault_suite import FUZZ_TRAIN, TRACEBACK, make_fuzz_shards  # noqa: E402
from tests.train import test_nonfinite as nonfinite_tests  # noqa: E402

RUN_TIMEOUT = 300  # s for one hpctrain command: far beyond a healthy one on 2 loaded cores
HEADROOM = 32 << 10  # what a full disk leaves: the metrics rows fit, no SLOW_RUN_ARGS checkpoint (64 KB) does
FUZZ_CASE_TIMEOUT = 60  # s for one mutation's verify + train
KEEP_LAST = 3  # the default checkpoint.keep_last: older committed ones are retention's to delete
CONFIG_TIMEOUT = 60  # s for one config case (`config show` returns in about a second)


# ---------------------------------------------------------------- trials and their counts


@dataclass
class Trial:
    """What one trial saw: every command's exit code, and what went wrong."""

    codes: list[int] = field(default_factory=list)
    traceback: bool = False
    hang: bool = False
    lost: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ranks: list[tuple[int, str | None]] = field(default_factory=list)  # (pid, start time): to make sure of at the end

    def record(self, code: int | None, out: str) -> None:
        if code is None:
            self.hang = True
        else:
            self.codes.append(code)
        self.traceback |= TRACEBACK in out

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failed.append(what)
        return ok

    def cleanup(self) -> None:
        """No process of this trial outlives it (a stopped one included)."""
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
        for pid, started in self.ranks:
            if started is not None and start_time(pid) == started:  # that process still, not a reused pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def watch(self, pid: int) -> int:
        """Remember rank ``pid`` for :meth:`cleanup`."""
        self.ranks.append((pid, start_time(pid)))
        return pid


@dataclass
class Tally:
    """One probe's row: counts over its trials."""

    trials: int = 0
    codes: Counter[int] = field(default_factory=Counter)
    tracebacks: int = 0
    hangs: int = 0
    lost: int = 0
    failed: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def add(self, n: int, trial: Trial) -> None:
        self.trials += 1
        self.codes.update(trial.codes)
        self.tracebacks += trial.traceback
        self.hangs += trial.hang
        self.lost += bool(trial.lost)
        self.failed += bool(trial.failed)
        self.notes += [f"trial {n}: {text}" for text in [*trial.lost, *trial.failed, *trial.notes]]

    @property
    def clean(self) -> bool:
        return not (self.tracebacks or self.hangs or self.lost or self.failed)

    def as_json(self) -> dict[str, Any]:
        return {"trials": self.trials, "exit_codes": {str(c): n for c, n in sorted(self.codes.items())},
                "tracebacks": self.tracebacks, "hangs": self.hangs, "data_lost": self.lost,
                "other_failures": self.failed, "seconds": round(self.seconds, 1), "notes": self.notes}


# ---------------------------------------------------------------- processes


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (None when gone): with the pid, it names one process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, everything below it (ranks live in sessions of their own) and its group."""
    for child in [*_descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def start(trial: Trial, argv: list[str], log: Path, prefix: list[str] | None = None,
          env: dict[str, str] | None = None, stdin: Path | None = None) -> subprocess.Popen[bytes]:
    """``python -m hpctrain ARGV`` (or ``PREFIX ARGV``) from the repository root, output to ``log``
    (a file, not a pipe: nobody reads while it runs); ``env`` on top of the test environment;
    ``stdin``: a file to read (else none: a prompt gets end-of-file, never the suite's terminal)."""
    cmd = prefix + argv if prefix else [sys.executable, "-m", "hpctrain", *argv]
    with open(log, "wb") as out, open(stdin or os.devnull, "rb") as given:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(**(env or {})), stdout=out, stderr=subprocess.STDOUT,
                                stdin=given, start_new_session=True)
    trial.procs.append(proc)
    return proc


def finish(trial: Trial, proc: subprocess.Popen[bytes], log: Path,
           timeout: float = RUN_TIMEOUT) -> tuple[int | None, str]:
    """Wait for ``proc``; past ``timeout`` it is a hang (killed, code None). Recorded in ``trial``."""
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        code = None
    out = log.read_text(errors="replace")
    trial.record(code, out)
    return code, out


def run(trial: Trial, argv: list[str], log: Path, prefix: list[str] | None = None,
        env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT,
        stdin: Path | None = None) -> tuple[int | None, str]:
    return finish(trial, start(trial, argv, log, prefix, env, stdin), log, timeout)


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float = RUN_TIMEOUT,
               poll: float = 0.01) -> bool:
    """Poll ``ready`` until it holds (True) or ``proc`` ends or the time is up (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return True
        time.sleep(poll)
    return ready()


def hpctrain(world: int, *args: str) -> list[str]:
    """``train ARGS`` in one process, or under ``hpctrain run -n WORLD``."""
    return ["train", *args] if world == 1 else ["run", "-n", str(world), "train", *args]


# ---------------------------------------------------------------- checkpoints and references


class References:
    """``params_sha256`` of the uninterrupted SLOW_RUN_ARGS run per world size, computed once."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.known: dict[int, str] = {}

    def __call__(self, world: int) -> str:
        if world not in self.known:
            run_dir, trial = self.work / f"reference-{world}", Trial()
            code, out = run(trial, hpctrain(world, *SLOW_RUN_ARGS, "checkpoint.enabled=false", f"run.dir={run_dir}"),
                            self.work / f"reference-{world}.log")
            if code != 0:
                raise RuntimeError(f"the uninterrupted run at world size {world} failed ({code}):\n{out[-3000:]}")
            self.known[world] = preempt._params(run_dir)
        return self.known[world]


def intact(run_dir: Path) -> dict[int, list[str]]:
    """Every committed checkpoint of ``run_dir`` by step, with its problems (empty: intact)."""
    return {step: layout.verify(path) for step, path in layout.committed(run_dir / "checkpoints")}


def check_kept(trial: Trial, before: dict[int, list[str]], run_dir: Path) -> None:
    """What was committed and intact before the fault still is, unless retention deleted it
    (``KEEP_LAST`` newer intact checkpoints exist)."""
    after = intact(run_dir)
    for step, problems in before.items():
        newer = [s for s, p in after.items() if s > step and not p]
        if not problems and step not in after and len(newer) >= KEEP_LAST:
            continue
        if not problems and after.get(step, ["missing"]):
            trial.lost.append(f"step {step} committed before the fault, now: {after.get(step, ['missing'])}")


def check_committed(trial: Trial, run_dir: Path) -> None:
    """After a kill: every committed checkpoint verifies, except what retention was deleting
    (older than the newest ``KEEP_LAST``: a kill mid-``rmtree`` leaves it half gone)."""
    found = intact(run_dir)
    newest = sorted(found)[-KEEP_LAST:]
    for step, problems in found.items():
        if problems and step in newest:
            trial.lost.append(f"committed step {step} corrupt: {problems[0]}")
        elif problems:
            trial.notes.append(f"step {step}, being deleted by retention when killed, is half gone (skipped on "
                               "resume)")


def check_restart(trial: Trial, code: int | None, out: str, run_dir: Path, reference: str, resumed: bool) -> None:
    """The restart ends (0), resumed when something was committed, bit-identical to the reference."""
    if not trial.expect(code == 0, f"restart exit {code}: {error_line(out)}"):
        return
    trial.expect("resumed from" in out or not resumed, "the restart did not resume")
    params = preempt._params(run_dir)
    if params != reference:
        trial.lost.append(f"restart params_sha256 {params[:12]} != reference {reference[:12]}")


def error_line(out: str) -> str:
    """The command's error line (or its last line): what a user would read first."""
    lines = [line for line in out.splitlines() if ": error: " in line or "internal error" in line]
    lines = lines or out.strip().splitlines() or ["(no output)"]
    return lines[-1].strip()


# ---------------------------------------------------------------- disk full


@dataclass
class SmallDisk:
    """The run directory's file system, filled on demand: an 8 MB tmpfs (``tmpfs``), or, where
    mounting is not permitted, a flag file that makes ``layout.commit`` raise ENOSPC (``inject``)."""

    where: Path
    how: str

    @property
    def filler(self) -> Path:
        return self.where.parent / f"{self.where.name}.enospc" if self.how == "inject" else self.where / "filler"

    def prefix(self) -> list[str] | None:
        return [sys.executable, "-c", INJECT, str(self.filler)] if self.how == "inject" else None

    def fill(self) -> None:
        if self.how == "inject":
            self.filler.touch()
            return
        st = os.statvfs(self.where)
        with open(self.filler, "wb") as fh:
            os.posix_fallocate(fh.fileno(), 0, max(st.f_bavail * st.f_frsize - HEADROOM, 0))

    def free(self) -> None:
        self.filler.unlink()


# `hpctrain ARGV` whose checkpoint commits fail with ENOSPC while the flag file argv[1] exists.
INJECT = """import errno, os, runpy, sys
from pathlib import Path
from hpctrain.checkpoint import layout
flag, real = Path(sys.argv[1]), layout.commit
def commit(*args, **kwargs):
    if flag.exists():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]))
    return real(*args, **kwargs)
layout.commit = commit
sys.argv = ["hpctrain", *sys.argv[2:]]
runpy.run_module("hpctrain", run_name="__main__", alter_sys=True)
"""


def can_mount(work: Path) -> str | None:
    """None when a tmpfs can be mounted here, else why not."""
    point = work / "mount-check"
    point.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(point)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        return done.stderr.strip() or f"mount exited {done.returncode}"
    subprocess.run(["umount", str(point)], check=True)
    return None


@contextlib.contextmanager
def small_disk(where: Path, how: str) -> Iterator[SmallDisk]:
    where.mkdir(parents=True)
    if how == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], check=True)
    try:
        yield SmallDisk(where, how)
    finally:
        if how == "tmpfs" and subprocess.run(["umount", str(where)]).returncode != 0:
            subprocess.run(["umount", "-l", str(where)])


def disk_full(mode: str) -> Callable[[Trial, random.Random, Path, Context], None]:
    """A full disk during a sync save, an async save or the final save, then space freed and resumed."""

    def probe(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
        every, at = (32, 100) if mode == "final" else (8, rng.randint(10, 60))  # final: after step 96's save
        with small_disk(work / "disk", ctx.disk) as disk:
            run_dir = disk.where / "run"
            argv = hpctrain(1, *SLOW_RUN_ARGS, f"checkpoint.every_steps={every}", "checkpoint.keep_last=100",
                            f"checkpoint.mode={'async' if mode == 'async' else 'sync'}", f"run.dir={run_dir}")
            log = work / "full.log"
            proc = start(trial, argv, log, disk.prefix())
            if not trial.expect(wait_until(lambda: preempt._last_step(run_dir) >= at, proc),
                                f"never reached step {at}"):
                finish(trial, proc, log)
                return
            disk.fill()
            before = intact(run_dir)
            code, out = finish(trial, proc, log)
            trial.expect(code == 1, f"filled at step {at}: exit {code}, not 1: {error_line(out)}")
            trial.notes.append(f"filled at step {at}: {error_line(out)}")
            check_kept(trial, before, run_dir)
            disk.free()
            code, out = run(trial, argv, work / "resume.log", disk.prefix())
            check_restart(trial, code, out, run_dir, ctx.reference(1), resumed=bool(before))

    return probe


# ---------------------------------------------------------------- SIGKILL during async saves


def saving(run_dir: Path) -> bool:
    return any((run_dir / "checkpoints").glob(f"{layout.PARTIAL_PREFIX}*"))


def sigkill_async(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    world = 1 + ctx.index % 2
    run_dir = work / "run"
    argv = hpctrain(world, *SLOW_RUN_ARGS, "checkpoint.mode=async", "checkpoint.every_steps=4", f"run.dir={run_dir}")
    steps = 128 // world
    at = rng.randint(5, steps - 6)
    proc = start(trial, argv, work / "killed.log")
    if not trial.expect(wait_until(lambda: preempt._last_step(run_dir) >= at, proc), f"never reached step {at}"):
        finish(trial, proc, work / "killed.log")
        return
    in_save = wait_until(lambda: saving(run_dir), proc, timeout=1.5, poll=0.001)
    time.sleep(rng.uniform(0, 0.005))
    kill_tree(proc.pid)  # ranks and launcher at once, as a node failure does
    proc.wait()
    trial.notes.append(f"world {world}, killed after step {preempt._last_step(run_dir)}"
                       f"{' with a save in flight' if in_save and saving(run_dir) else ''}")
    check_committed(trial, run_dir)
    resumed = bool(layout.committed(run_dir / "checkpoints"))
    code, out = run(trial, argv, work / "restart.log")
    check_restart(trial, code, out, run_dir, ctx.reference(world), resumed)


# ---------------------------------------------------------------- shard fuzz


def shard_fuzz(trials: int, seed: int, work: Path, tally: Tally) -> None:
    """``trials`` mutations in worker processes; a mutation past FUZZ_CASE_TIMEOUT is a hang, and
    a fresh worker goes on with the next one."""
    case = 0
    while case < trials:
        worker = subprocess.Popen([sys.executable, __file__, "--fuzz-worker", str(work), "--seed", str(seed),
                                   "--fuzz-cases", f"{case}:{trials}"], cwd=ROOT, env=launch_env(),
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(worker, lines), daemon=True).start()
        while case < trials:
            try:
                line, hung = lines.get(timeout=FUZZ_CASE_TIMEOUT), False
            except queue.Empty:
                line, hung = None, True
                kill_tree(worker.pid)
            if line is None:  # a hang, or the worker died: count it, go on in a new worker
                trial = Trial(hang=hung)
                if hung:
                    trial.notes.append(f"case {case}: no result within {FUZZ_CASE_TIMEOUT} s (killed)")
                else:
                    trial.failed.append(f"case {case}: the fuzz worker died (exit {worker.wait()})")
                tally.add(case, trial)
                case += 1
                break
            result = json.loads(line)
            trial = Trial(codes=[result["verify_code"], result["train_code"]], traceback=result["traceback"])
            trial.failed = [f"case {case} ({result['shard']} {result['mutation']}): {p}" for p in result["problems"]]
            if not result["in_samples"]:
                trial.notes.append(f"case {case}: only bytes outside every sample (the tar's end blocks): "
                                   f"train exit {result['train_code']}")
            tally.add(case, trial)
            case += 1
        worker.kill()
        worker.wait()


def _pump(worker: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    assert worker.stdout is not None
    for line in worker.stdout:
        if line.startswith("FUZZ "):
            lines.put(line[5:])
    lines.put(None)


def fuzz_worker(work: Path, seed: int, cases: str) -> None:
    """Mutations FIRST..LAST-1 in this process, one JSON line each (``FUZZ {...}``)."""
    import torch

    from tests.test_fault_suite import fuzz_case, make_fuzz_shards, train_on

    torch.set_num_threads(1)
    first, last = map(int, cases.split(":"))
    scratch = work / f"fuzz-{first}"
    shutil.rmtree(scratch, ignore_errors=True)
    shards = make_fuzz_shards(scratch / "shards")  # afresh: a killed worker may have left one mutated
    code, out, intact_params = train_on(shards, scratch / "intact")
    if code != 0 or intact_params is None:
        raise RuntimeError(f"training on the intact shards failed ({code}):\n{out[-3000:]}")
    for case in range(first, last):
        r = fuzz_case(shards, case, seed, scratch)
        print("FUZZ " + json.dumps({"shard": r.shard, "mutation": r.mutation, "in_samples": r.in_samples,
                                    "verify_code": r.verify_code, "train_code": r.train_code,
                                    "traceback": r.traceback, "problems": r.problems(intact_params)}), flush=True)


# ---------------------------------------------------------------- crafted checkpoints


def crafted_probe(kind: str) -> Callable[[Trial, random.Random, Path, Context], None]:
    """tests/checkpoint/test_crafted.py's file as the newest checkpoint: refused, then skipped."""

    def probe(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
        run_dir = work / "run"
        newest = crafted._plant(ctx.crafted_base(), kind, run_dir)
        (run_dir / "summary.json").unlink()  # as if stopped: resume=auto takes the newest checkpoint
        reason = crafted.CRAFTED[kind][1]
        code, out = run(trial, ["ckpt", "verify", str(newest)], work / "verify.log")
        trial.expect(code == 2 and reason in out, f"ckpt verify exit {code}, reason shown: {reason in out}")
        code, out = run(trial, ["train", *crafted.BASE, f"run.dir={run_dir}", "resume=auto"], work / "resume.log")
        if trial.expect(code == 0, f"resume=auto exit {code}: {error_line(out)}"):
            trial.expect(f"{newest} is corrupt and is skipped" in out and reason in out, "not skipped with the reason")
            steps = json.loads((run_dir / "summary.json").read_text())["steps"]
            trial.expect(steps == 8, f"ended at step {steps}, not 8")

    return probe


def crafted_read_probe(kind: str) -> Callable[[Trial, random.Random, Path, Context], None]:
    """tests/checkpoint/test_crafted_reads.py's checkpoint as the newest: named, then skipped."""

    def probe(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
        fmt = crafted_reads.CRAFTED[kind][0]
        run_dir = work / "run"
        newest, says = crafted_reads._plant({fmt: ctx.crafted_base(fmt)}, kind, run_dir)
        (run_dir / "summary.json").unlink()  # as if stopped: resume=auto takes the newest checkpoint
        if kind != "huge_tensor":  # verify hashes its 64 GiB: bounded, but minutes
            code, out = run(trial, ["ckpt", "verify", str(newest)], work / "verify.log")
            trial.expect(code in (1, 2) and says in out, f"ckpt verify exit {code}, reason shown: {says in out}")
            code, out = run(trial, ["ckpt", "list", "--verify", str(run_dir)], work / "list.log")
            trial.expect(code in (1, 2), f"ckpt list --verify exit {code}")
        code, out = run(trial, ["train", *crafted.BASE, f"run.dir={run_dir}", "resume=auto",
                                f"checkpoint.format={fmt}"], work / "resume.log")
        if trial.expect(code == 0, f"resume=auto exit {code}: {error_line(out)}"):
            trial.expect(f"{newest} is corrupt and is skipped" in out and says in out, "not skipped with the reason")
            steps = json.loads((run_dir / "summary.json").read_text())["steps"]
            trial.expect(steps == 8, f"ended at step {steps}, not 8")

    return probe


def checkpoint_fuzz(cases: int, seed: int, work: Path, tally: Tally) -> None:
    """Each fuzzer of tests/checkpoint/test_fuzz_checkpoint.py with ``cases`` cases, one trial each."""
    env = {**launch_env(), "HPCTRAIN_FUZZ_CASES": str(cases), "HPCTRAIN_FUZZ_SEED": str(seed)}
    for n, name in enumerate(("manifests", "tensor_file_headers", "dcp_metadata")):
        trial, log = Trial(), work / f"fuzz-{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--tb=line",
               f"tests/checkpoint/test_fuzz_checkpoint.py::test_fuzz_{name}"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        trial.procs.append(proc)
        code, text = finish(trial, proc, log, timeout=RUN_TIMEOUT * 4)
        trial.hang |= "still running after" in text  # a case past its alarm
        trial.expect(code == 0 or "still running after" in text, f"{name}: {error_line(text)}")
        ran = cases // 3 if name == "dcp_metadata" else cases  # the DCP fuzzer runs a third (each case loads)
        trial.notes.append(f"{name}: {ran} cases, pytest exit {code}")
        trial.cleanup()
        tally.add(n, trial)


# ---------------------------------------------------------------- two runs, one run.dir


def two_runs(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    run_dir = work / "run"
    args = [*SLOW_RUN_ARGS, "checkpoint.every_steps=8", f"run.dir={run_dir}"]
    first = start(trial, hpctrain(1, *args), work / "first.log")
    at = rng.randint(5, 100)
    if not trial.expect(wait_until(lambda: preempt._last_step(run_dir) >= at, first), f"never reached step {at}"):
        finish(trial, first, work / "first.log")
        return
    os.killpg(first.pid, signal.SIGSTOP)  # the owner holds still (mid-save, maybe) while the second starts
    try:
        world = 1 + ctx.index % 2
        code, out = run(trial, hpctrain(world, *args), work / "second.log")
        named = "is in use by another run" in out and f"pid {first.pid}" in out
        trial.expect(code == 2 and named, f"second run (world {world}) exit {code}, owner named: {named}: "
                                          f"{error_line(out)}")
        trial.notes.append(f"second run (world {world}): {error_line(out)}")
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    code, out = finish(trial, first, work / "first.log")
    check_restart(trial, code, out, run_dir, ctx.reference(1), resumed=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted(row["step"] for row in rows if "loss" in row)
    if steps != list(range(1, 129)):
        trial.lost.append(f"metrics.jsonl training rows: {len(steps)}, {len(set(steps))} distinct, not 1..128")
    check_committed(trial, run_dir)


# ---------------------------------------------------------------- a SIGKILLed launcher


def launcher_kill(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    run_dir = work / "run"
    argv = hpctrain(2, *SLOW_RUN_ARGS, "checkpoint.every_steps=8", f"run.dir={run_dir}")
    proc = start(trial, argv, work / "killed.log")
    at = rng.randint(10, 56)
    if not trial.expect(wait_until(lambda: preempt._last_step(run_dir) >= at, proc), f"never reached step {at}"):
        finish(trial, proc, work / "killed.log")
        return
    ranks = [trial.watch(pid) for pid in preempt._workers(proc.pid)]
    trial.expect(len(ranks) == 2, f"{len(ranks)} ranks found under the launcher")
    os.killpg(proc.pid, signal.SIGKILL)  # the OOM killer, `timeout -s KILL`: the group, not the ranks' sessions
    proc.wait()
    deadline = time.monotonic() + 5
    while any(preempt._alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in ranks if preempt._alive(pid)]
    trial.expect(not alive, f"ranks {alive} alive 5 s after the launcher's SIGKILL")
    trial.cleanup()
    check_committed(trial, run_dir)
    code, out = run(trial, argv, work / "restart.log")
    check_restart(trial, code, out, run_dir, ctx.reference(2), resumed=bool(layout.committed(run_dir / "checkpoints")))


# ---------------------------------------------------------------- stalled ranks


def stalled_rank(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    nproc = 2 + ctx.index % 2
    stopped = rng.randrange(nproc)
    run_dir = work / "run"
    argv = ["run", "-n", str(nproc), f"--hang-timeout={hang.HANG_S}", "train", *hang.TINY,
            "model.name=tests.user_models:slow_mlp", f"run.dir={run_dir}"]
    proc = start(trial, argv, work / "stalled.log")
    at = rng.randint(3, 8)
    if not trial.expect(wait_until(lambda: preempt._last_step(run_dir) >= at, proc), f"never reached step {at}"):
        finish(trial, proc, work / "stalled.log")
        return
    before = intact(run_dir)
    pid = trial.watch(hang._rank_pid(proc.pid, stopped))
    os.kill(pid, signal.SIGSTOP)
    stalled_at = time.monotonic()
    code, out = finish(trial, proc, work / "stalled.log", timeout=hang.HANG_S + 120)
    took = time.monotonic() - stalled_at
    trial.expect(code == 4, f"exit {code}, not 4: {error_line(out)}")
    trial.expect(took < hang.HANG_S + 30, f"ended {took:.0f} s after the stall (bound {hang.HANG_S + 30} s)")
    summaries = sorted(run_dir.glob("hang-*/summary.txt"))
    said = summaries[0].read_text().strip() if summaries else "(no hang-*/summary.txt)"
    trial.expect(f"hang: rank {stopped} " in said, f"rank {stopped} of {nproc} stopped; the report says: {said}")
    trial.notes.append(f"rank {stopped} of {nproc} stopped after step {at}: exit {code} after {took:.0f} s")
    check_kept(trial, before, run_dir)


# ---------------------------------------------------------------- a user's files in run.dir (issue 25)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


FOREIGN = {"config.yaml": b"trainer:\n  max_epochs: 3\nmodel:\n  lr: 0.1\n", "model.pt": b"weights",
           "status.json": b'{"state": "done"}', "metrics.jsonl": b'{"loss": 1}\n',
           "checkpoints/best.json": b'{"epoch": 3}', "checkpoints/epoch=3-step=1000.ckpt": b"lightning"}


def foreign_run_dir(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """Another tool's run as run.dir: refused (exit 2, naming what is there) under resume=auto
    and run.overwrite=true resume=never, every file byte for byte as it was; ``/`` and ``~`` refused."""
    run_dir = work / "lightning"
    for name, data in FOREIGN.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data + rng.randbytes(rng.randrange(64)))
    before = _tree(run_dir)
    for n, extra in enumerate((["resume=auto"], ["run.overwrite=true", "resume=never"])):
        code, out = run(trial, ["train", *rundir_safety.TINY, "train.max_steps=2", f"run.dir={run_dir}", *extra],
                        work / f"foreign-{n}.log")
        line = error_line(out)
        trial.expect(code == 2 and "already holds files hpctrain did not write" in line,
                     f"{' '.join(extra)}: exit {code}: {line}")
        after = _tree(run_dir)
        changed = sorted(k for k in {*before, *after} if before.get(k, b"") != after.get(k, b""))
        if changed:
            trial.lost.append(f"{' '.join(extra)}: the user's files changed: {changed}")
    for where, says in (("/", "is a system folder"), ("~", "is your home folder")):
        real = Path(os.path.expanduser(where))
        names = {p.name for p in real.iterdir()}
        code, out = run(trial, ["train", *rundir_safety.TINY, "train.max_steps=1", f"run.dir={where}"],
                        work / "root.log")
        line = error_line(out)
        trial.expect(code == 2 and says in line, f"run.dir={where}: exit {code}: {line}")
        written = sorted(({p.name for p in real.iterdir()} - names) & {MARKER, *HPCTRAIN_NAMES})
        if written or (real / MARKER).exists():
            trial.lost.append(f"run.dir={where}: hpctrain wrote {written or [MARKER]} into {real}")


HPCTRAIN_NAMES = {"config.yaml", "status.json", "metrics.jsonl", "summary.json", "checkpoints", "run.lock"}


# ---------------------------------------------------------------- non-finite numerics (issue 25)


def _finite_weights(ckpt: Path) -> bool:
    """Every floating-point tensor of a torch-format checkpoint's replicated tensor file is finite."""
    import torch
    from safetensors.torch import load_file

    return all(bool(torch.isfinite(t).all()) for t in load_file(ckpt / "replicated.safetensors").values()
               if t.is_floating_point())


def nonfinite(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """optim.lr far too large: exit 1 naming the step, no checkpoint of non-finite weights, none
    best, the last finite ones kept; an fp16 loss that overflows every step: stopped, with the
    message (at once under the default, after train.nonfinite_patience skipped steps under skip)."""
    run_dir, lr = work / "lr", rng.choice(("1e6", "1e5", "1e8"))
    code, out = run(trial, ["train", *nonfinite_tests.BASE, nonfinite_tests.BN, f"optim.lr={lr}", "train.max_steps=16",
                            f"run.dir={run_dir}", "checkpoint.every_steps=1", "checkpoint.keep_last=3",
                            "train.eval_every_steps=1"],  # a validation each step: a best to record
                    work / "lr.log")
    line = error_line(out)
    named = re.search(r"step (\d+): the loss is (nan|inf)", line)
    trial.expect(code == 1 and named is not None and "train.nonfinite=stop" in line,
                 f"optim.lr={lr}: exit {code}: {line}")
    found = intact(run_dir)
    trial.expect(bool(found), f"optim.lr={lr}: no checkpoint kept (the last finite ones must be)")
    stop = int(named.group(1)) if named else 0
    for step, problems in found.items():
        path = run_dir / "checkpoints" / layout.step_name(step)
        if problems or not layout.read_manifest(path).get("finite") or not _finite_weights(path):
            trial.lost.append(f"optim.lr={lr}: checkpoint of step {step} is not intact and finite: {problems}")
        trial.expect(step < stop, f"optim.lr={lr}: a checkpoint of step {step}, at or after the stop at {stop}")
    best = layout.best_step(run_dir / "checkpoints")
    trial.expect(best is None or best in found, f"optim.lr={lr}: best is step {best}, not a kept checkpoint")
    status = json.loads((run_dir / "status.json").read_text())
    trial.expect(status.get("outcome") == "failed", f"optim.lr={lr}: status.json says {status.get('outcome')}")
    trial.notes.append(f"optim.lr={lr}: stopped at step {stop}; kept steps {sorted(found)}, best {best}")
    for policy in (["train.nonfinite=stop"], ["train.nonfinite=skip", "train.nonfinite_patience=3"]):
        code, out = run(trial, ["train", *nonfinite_tests.BASE, "precision=fp16", "train.max_steps=6",
                                "train.loss=tests.train.test_nonfinite:overflow_loss", *policy,
                                f"run.dir={work / policy[0][-4:]}"], work / "fp16.log")
        line = error_line(out)
        trial.expect(code == 1 and "precision=fp16, loss scale" in line and "hint: precision=bf16" in line,
                     f"fp16 overflow, {' '.join(policy)}: exit {code}: {line}")


# ---------------------------------------------------------------- config files and overrides (issue 25)


def _config_case(n: int, rng: random.Random, work: Path) -> tuple[list[str], str | None, int | None]:
    """Case ``n``: (argv, a text the output must hold, the exit code it must have); the attack's
    cases first, then tests/test_config_fuzz.py's mutated files and random overrides."""
    bomb, path = config_fuzz_tests._bomb(), work / "case.yaml"
    kwargs_bomb = b"optim:\n  name: torch.optim:AdamW\n  kwargs:\n" + b"".join(b"    " + x + b"\n"
                                                                              for x in bomb.splitlines())
    refused = "aliases (*name) expand to more than 100000 values"
    attacks: list[tuple[bytes | None, list[str], str | None, int | None]] = [
        (bomb, ["config", "show"], refused, 2), (bomb, ["train"], refused, 2),
        (kwargs_bomb, ["config", "show"], refused, 2), (kwargs_bomb, ["train"], refused, 2),
        (b"model:\n  name: caf\xe9\n", ["config", "show"], "is not UTF-8 text (byte 0xe9 on line 2)", 2),
        *[(None, ["config", "show", f"{key}={value}"], value, 0) for key, value in
          (("model.name", "`id`"), ("run.dir", "@x"), ("run.dir", "%x"), ("data.path", "[x"), ("data.path", "{x"),
           ("model.name", "&a"), ("run.dir", "~"))],
        (None, ["config", "show", "optim.lr=`x"], "override optim.lr='`x' is not valid YAML", 2),
    ]
    if n < len(attacks):
        data, argv, says, code = attacks[n]
        if data is not None:
            path.write_bytes(data)
            argv = [*argv, str(path)]
        return argv, says, code
    if n % 2:
        path.write_bytes(config_fuzz_tests._mutated(rng))
        return ["config", "show", str(path)], None, None
    keys = [f"{section}.{k}" if section else k for section, names in key_names().items() for k in names]
    keys += ["optim.kwargs.eps", "nope.x", "model..name", "model.name.x", ".", ""]
    parts = config_fuzz_tests.VALUE_PARTS
    return ["config", "show", *[f"{rng.choice(keys)}={''.join(rng.choices(parts, k=rng.randint(1, 3)))}"
                                for _ in range(rng.randint(1, 3))]], None, None


def config_fuzz(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """One config case through ``hpctrain``: exit 0, or 2 with one line; never a traceback or a hang."""
    argv, says, want = _config_case(ctx.index, rng, work)
    code, out = run(trial, argv, work / "config.log", timeout=CONFIG_TIMEOUT)
    case = " ".join(argv)[:120]
    lines = out.strip().splitlines()
    if trial.expect(code in (0, 2), f"{case!r}: exit {code}: {error_line(out)}") and code == 2:
        trial.expect(len(lines) == 1 and ": error: " in lines[0], f"{case!r}: exit 2 with {len(lines)} lines")
    trial.expect("internal error" not in out, f"{case!r}: {error_line(out)}")
    if want is not None:
        trial.expect(code == want and says is not None and says in out, f"{case!r}: exit {code}: {error_line(out)}")


# ---------------------------------------------------------------- crafted shards (issue 25)


# `hpctrain ARGV` with an audit hook that appends to argv[1] each path opened at or under argv[2]
# (the bait outside data.path); os.open with a dir_fd is judged by its name alone.
AUDIT = """import os, runpy, sys
log, bait = sys.argv[1], os.path.realpath(sys.argv[2])
def hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path == bait or path.startswith(bait + os.sep):
            with open(log, "a") as fh:
                fh.write(path + "\\n")
sys.addaudithook(hook)
sys.argv = ["hpctrain", *sys.argv[3:]]
runpy.run_module("hpctrain", run_name="__main__", alter_sys=True)
"""
SHARD_TRAIN = [*FUZZ_TRAIN, "train.max_steps=2", "data.num_workers=0"]


def audited(trial: Trial, argv: list[str], work: Path, bait: Path, name: str,
            env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """``hpctrain ARGV``, every open of ``bait`` (or under it) counted as data read outside."""
    reads = work / f"{name}.outside"
    code, out = run(trial, argv, work / f"{name}.log", [sys.executable, "-c", AUDIT, str(reads), str(bait)], env)
    if reads.exists():
        trial.lost.append(f"{name}: read outside data.path: {sorted(set(reads.read_text().split()))[:3]}")
    return code, out


def shard_crafted(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """tests/data/test_shard_confine.py's crafted shards through ``hpctrain data`` and ``hpctrain
    train``: a .cls member declaring 100 GB, a negative index range, manifests naming
    ``../outside/train-000000.tar`` and ``../../outside.tar``: exit 1 or 2 naming the file."""
    big = work / "big"
    big.mkdir()
    shard_confine._tar_with_member(big / "train-0.tar", 100 * 2**30)
    train = ["train", *SHARD_TRAIN, "model.name=tests.user_models:tiny_mlp"]
    for name, argv in (("index", ["data", "index", str(big), "--split", "train"]),
                       ("train", [*train, f"data.path={big}", f"run.dir={work / 'run-big'}"])):
        code, out = run(trial, argv, work / f"big-{name}.log")
        line = error_line(out)
        trial.expect(code == 2 and "train-0.tar" in line and "107374182400" in line,
                     f"100 GB member, {name}: exit {code}: {line}")
    neg = work / "neg"
    shard_confine._write(neg)
    shard = rng.choice(("train-000000", "train-000001"))
    index = json.loads((neg / f"{shard}.idx.json").read_text())
    index["start"][1], index["end"][1] = index["end"][1], index["start"][1]
    (neg / f"{shard}.idx.json").write_text(json.dumps(index))
    for name, argv, codes in (("verify", ["data", "verify", str(neg)], (1,)),
                              ("train", [*train, f"data.path={neg}", f"run.dir={work / 'run-neg'}"], (1, 2))):
        code, out = run(trial, argv, work / f"neg-{name}.log")
        trial.expect(code in codes and f"{shard}." in out and "ends before it starts" in out,
                     f"negative range in {shard}, {name}: exit {code}: {error_line(out)}")
    data = work / "site" / "data"
    shard_confine._write(data.parent / "outside")  # the bait: valid shards where ../outside/ points
    shutil.copyfile(data.parent / "outside" / "train-000000.tar", work / "outside.tar")  # and ../../outside.tar
    shard_confine._write(data)
    (data / "train-000000.tar").unlink()
    pristine = json.loads(manifest_path(data, "train").read_text())
    stage = work / "slurm-tmp"
    stage.mkdir()
    staged = [a for a in train if a != "data.stage_dir=off"]  # under $SLURM_TMPDIR staging reads it first
    for outside, bait in (("../outside/train-000000.tar", data.parent / "outside"),
                          ("../../outside.tar", work / "outside.tar")):
        pristine["shards"][0]["name"] = outside
        manifest_path(data, "train").write_text(json.dumps(pristine))
        for name, argv, env in (("verify", ["data", "verify", str(data)], None),
                                ("train", [*train, f"data.path={data}", f"run.dir={work / 'run-out'}"], None),
                                ("train-staged", [*staged, f"data.path={data}", f"run.dir={work / 'run-out'}"],
                                 {"SLURM_TMPDIR": str(stage)})):
            code, out = audited(trial, argv, work, bait, f"{bait.name}-{name}", env)
            trial.expect(code == 2 and outside in out, f"manifest naming {outside}, {name}: exit {code}: "
                                                       f"{error_line(out)}")


def shard_index_fuzz(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """One case of tests/data/test_shard_fuzz.py's generators (a mutated shard index, a mutated
    shard manifest, or a tar with one lie, in turn) through ``hpctrain data index``/``verify``
    (every case) and ``hpctrain train`` (every 4th case, not the tars): exit 0, 1 or 2, one
    error line, no traceback, no hang, nothing opened outside data.path (the bait beside it)."""
    kind = ("index", "manifest", "tar")[ctx.index % 3]
    data, bait = work / "data", work / "outside"
    commands: list[tuple[str, list[str]]] = []
    if kind == "tar":
        data.mkdir()
        (data / "train-000000.tar").write_bytes(shard_fuzz_tests._fuzzed_tar(rng))
        bait.mkdir()
        commands.append(("index", ["data", "index", str(data), "--split", "train"]))
    else:
        make_fuzz_shards(data)
        shutil.copytree(data, bait)  # what ../outside/... in a mutation names
        target = data / "train-000001.idx.json" if kind == "index" else manifest_path(data, "train")
        target.write_bytes(shard_fuzz_tests._mutate_json(json.loads(target.read_text()), rng))
    commands.append(("verify", ["data", "verify", str(data)]))
    if kind != "tar" and ctx.index % 4 == 0:
        commands.append(("train", ["train", *SHARD_TRAIN, f"data.path={data}", f"run.dir={work / 'run'}"]))
    for name, argv in commands:
        code, out = audited(trial, argv, work, bait, name)
        errors = [line for line in out.splitlines() if ": error: " in line]
        trial.expect(code in (0, 1, 2) and len(errors) <= 1 and "internal error" not in out,
                     f"{kind} case, {name}: exit {code}, {len(errors)} error lines: {error_line(out)}")
        if code == 2:
            trial.expect(str(data) in error_line(out), f"{kind} case, {name}: exit 2 naming no file of "
                                                       f"{data}: {error_line(out)}")
    trial.notes.append(f"{kind}: exit codes {trial.codes}")


# ---------------------------------------------------------------- rendered Slurm jobs (issue 25)


SLURM_TIME = ["--nodes", "1", "--time", "10", "--cpus-per-task", "1"]


def slurm_render(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """``hpctrain slurm --dry-run`` with ``,`` and ``:`` in data.path and --mount (Apptainer and
    Pyxis) and --env replacing the script's own variables: exit 2 naming the value, nothing
    rendered, nothing written; the same command without them renders (exit 0)."""
    config = ["data.name=synthetic_tiny", f"run.dir={work / 'runs' / 'x'}"]
    cases: list[tuple[list[str], list[str]]] = []  # (options, what the error must say)
    for runtime, (image, option) in slurm_tests.RUNTIMES.items():
        container = ["--container", image, "--container-runtime", runtime]
        cases += [(["data.path=/data/x,/root/.ssh:/data/x", *container],
                   ["data.path '/data/x,/root/.ssh:/data/x' holds ',' and ':'", option]),
                  (["--mount", "/scratch/a,/etc", *container],
                   ["--mount /scratch/a,/etc '/scratch/a,/etc' holds ','", option]),
                  (["--mount", "/scratch/a:/etc", *container], ["'/scratch/a:/etc' holds ':'", option])]
    cases += [(["--env", "MAX_REQUEUES=99"], ["would replace the job script's own MAX_REQUEUES"]),
              (["--env", "SLURM_RESTART_COUNT=0"], ["SLURM_RESTART_COUNT=... is refused: Slurm sets it for the job"]),
              (["--env", f"RUN_DIR=/tmp/elsewhere-{rng.randrange(1000)}"], ["own RUN_DIR; hint: set it with run.dir="])]
    code, out = run(trial, ["slurm", *config, *SLURM_TIME, "--dry-run"], work / "plain.log")
    trial.expect(code == 0 and "#SBATCH" in out, f"the plain render: exit {code}: {error_line(out)}")
    for n, (argv, says) in enumerate(cases):
        code, out = run(trial, ["slurm", *config, *argv, *SLURM_TIME, "--dry-run"], work / f"slurm-{n}.log")
        named = all(text in out for text in says)
        trial.expect(code == 2 and named and "#SBATCH" not in out,
                     f"{' '.join(argv)}: exit {code}, named: {named}: {error_line(out)}")
    trial.expect(not (work / "runs").exists(), "a dry run wrote into run.dir")


# ---------------------------------------------------------------- the hang bound, first causes (issue 25)


STALL_S = 8  # --hang-timeout of the bound probe: 3 x it (the long phases' allowance) is 24 s
STALL_MARGIN = 12  # s from the judgement to the exit (stack dumps, teardown) on 2 loaded cores: under 3 x STALL_S


def stalled_in_agreement(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """A rank SIGSTOPped under --hang-timeout STALL_S outside any save or validation: exit 4 naming
    it, judged at the plain timeout (not 3 x). Even trials: `hpctrain train` (2 ranks, no
    checkpoints), stopped at a random moment of a random step; odd trials: tests/launch/
    test_hang_phases.py's loop, rank 1 stopping itself right before the preemption agreement."""
    run_dir, stopped = work / "run", rng.randrange(2)
    options = ["run", "-n", "2", f"--hang-timeout={STALL_S}"]
    if ctx.index % 2:
        stopped, at = 1, rng.randint(3, 30)
        program = work / "agreement.py"
        program.write_text(hang_phases.AGREEMENT.replace("step == 5", f"step == {at}"))
        proc = start(trial, [*options, f"--run-dir={run_dir}", str(program)], work / "stalled.log")
        if not trial.expect(wait_until(lambda: _stopped(proc.pid, stopped) is not None, proc, poll=0.05),
                            "rank 1 never stopped"):
            finish(trial, proc, work / "stalled.log")
            return
        trial.watch(_stopped(proc.pid, stopped) or 0)
    else:
        at = rng.randint(3, 20)
        proc = start(trial, [*options, "train", *hang.TINY, "model.name=tests.user_models:slow_mlp",
                             "checkpoint.enabled=false", f"run.dir={run_dir}"], work / "stalled.log")
        if not trial.expect(wait_until(lambda: preempt._last_step(run_dir) >= at, proc), f"never reached step {at}"):
            finish(trial, proc, work / "stalled.log")
            return
        time.sleep(rng.uniform(0, 0.05))  # anywhere in the step
        os.kill(trial.watch(hang._rank_pid(proc.pid, stopped)), signal.SIGSTOP)
    stalled_at = time.monotonic()
    code, out = finish(trial, proc, work / "stalled.log", timeout=STALL_S * 3 + 120)
    took = time.monotonic() - stalled_at
    summaries = sorted(run_dir.glob("hang-*/summary.txt"))
    said = summaries[0].read_text().strip() if summaries else "(no hang-*/summary.txt)"
    silence = re.search(r"made no progress for (\d+) s", said)
    trial.expect(code == 4 and f"hang: rank {stopped} " in said, f"exit {code}, rank {stopped} stopped; the report "
                                                                 f"says: {said[:300]}")
    trial.expect(took < STALL_S + STALL_MARGIN, f"ended {took:.0f} s after the stall (bound {STALL_S + STALL_MARGIN} "
                                                f"s; 3 x the timeout is {3 * STALL_S} s)")
    trial.expect(silence is not None and int(silence.group(1)) < 2 * STALL_S, f"judged after {silence and silence[1]} "
                                                                             f"s of silence, not ~{STALL_S} s")
    doing = re.search(r"after step (\d+), in ([^;(]*)", said)
    trial.notes.append(f"{'agreement loop' if ctx.index % 2 else 'train'}: rank {stopped} stopped "
                       f"{f'after step {doing[1]}, in {doing[2].strip()}' if doing else '(no phase reported)'}: "
                       f"exit {code} after {took:.0f} s, judged after {silence and silence[1]} s of silence")


def _stopped(launcher: int, rank: int) -> int | None:
    """The pid of rank ``rank`` under ``launcher`` once it is stopped (state T), else None."""
    for pid in preempt._workers(launcher):
        with contextlib.suppress(OSError):
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                return pid if state == "T" else None
    return None


def killed_rank(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """A rank of a 2-rank run SIGKILLed at a random step: the survivor names it ("rank N ended with
    signal 9"), the launcher says it was first, status.json records it; no "internal error"."""
    run_dir, killed, at = work / "run", ctx.index % 2, rng.randint(3, 20)
    proc = start(trial, ["run", "-n", "2", "--hang-timeout=0", "train", *hang.TINY,
                         "model.name=tests.user_models:slow_mlp", f"run.dir={run_dir}"], work / "killed.log")
    if not trial.expect(wait_until(lambda: preempt._last_step(run_dir) >= at, proc), f"never reached step {at}"):
        finish(trial, proc, work / "killed.log")
        return
    before = intact(run_dir)
    os.kill(trial.watch(hang._rank_pid(proc.pid, killed)), signal.SIGKILL)
    code, out = finish(trial, proc, work / "killed.log")
    cause = f"rank {killed} ended with signal 9 (SIGKILL)"
    trial.expect(code == 1, f"exit {code}, not 1: {error_line(out)}")
    trial.expect(f"hpctrain train: error: {cause}, so this rank failed too" in out, f"the survivor says: "
                                                                                    f"{error_line(out)}")
    trial.expect("internal error" not in out and "This is a bug" not in out, "an internal error reported")
    trial.expect(f"hpctrain run: hpctrain failed: {cause} first" in out, "the launcher does not name the first cause")
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").is_file() else {}
    trial.expect(status.get("outcome") == "failed" and str(status.get("error", "")).startswith(cause),
                 f"status.json: {status.get('outcome')}: {str(status.get('error'))[:120]}")
    check_kept(trial, before, run_dir)
    trial.notes.append(f"rank {killed} killed after step {at}: exit {code}")


# ---------------------------------------------------------------- issue 42's surfaces


S3_TIMEOUT = 120  # s for one command against the local moto server
QUICK_TIMEOUT = 30  # s for a command that must answer from its inputs alone (estimate, plan, config show)
JSON_LIMIT_TEST = 64 << 10  # HPCTRAIN_MAX_JSON_BYTES of the manifest probes: "huge" without uploading 1 GiB
BAD_SEGMENTS = ["..", "x//y", " ", "a b", "x?y", "c\x01d", "\x7f", "t\tu"]  # "x//y": an empty segment inside


def _s3_env(ctx: Context, work: Path, **extra: str) -> dict[str, str]:
    """The moto server's credentials and endpoint, a cache of the trial's own (nothing outside it)."""
    return {**ctx.s3().env, "HPCTRAIN_CACHE": str(work / "cache"), **extra}


def _bucket(ctx: Context, work: Path) -> str:
    """A bucket of this trial's own (``f42-<probe>-<trial>``)."""
    name = re.sub(r"[^a-z0-9-]", "-", f"f42-{work.parent.name}-{ctx.index}")[:63]
    ctx.s3().bucket(name)
    return name


def _upload(ctx: Context, bucket: str, prefix: str, local: Path, change: dict[str, bytes | None] | None = None) -> str:
    """``local``'s files under ``s3://bucket/prefix`` (``change``: name -> other bytes, None: left out)."""
    client, change = ctx.s3().client(), change or {}
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        name = f.relative_to(local).as_posix()
        body = change.get(name, f.read_bytes())
        if body is not None:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body)
    return f"s3://{bucket}/{prefix}"


def answered(trial: Trial, code: int | None, out: str, case: str, codes: tuple[int, ...] = (0, 1, 2),
             says: str | None = None) -> bool:
    """Issue 42's promise for one command: an expected exit code, at most one error line, never an
    internal error, never the test secret; ``says``: a text the output must hold."""
    from tests.s3_server import SECRET_KEY

    errors = [line for line in out.splitlines() if ": error: " in line]
    ok = trial.expect(code in codes, f"{case}: exit {code}, not {'/'.join(map(str, codes))}: {error_line(out)}")
    ok &= trial.expect(len(errors) <= 1 and "internal error" not in out, f"{case}: {len(errors)} error lines, "
                                                                         f"{error_line(out)}")
    if SECRET_KEY in out:
        trial.lost.append(f"{case}: the secret access key was printed")
    if says is not None:
        ok &= trial.expect(says in out, f"{case}: the output does not say {says!r}: {error_line(out)}")
    return ok


def no_secret_in(trial: Trial, root: Path) -> None:
    """No file under ``root`` (run dirs, caches, logs) holds the test secret."""
    from tests.s3_server import SECRET_KEY

    for f in (p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        with contextlib.suppress(OSError):
            if SECRET_KEY.encode() in f.read_bytes():
                trial.lost.append(f"the secret access key is in {f}")


def _bad_key(rng: random.Random) -> str:
    """A key of 1-4 segments, at least one of which no store can take."""
    segments = [rng.choice(["data", "x", "p-1", "ok"]) for _ in range(rng.randint(1, 3))]
    segments.insert(rng.randrange(len(segments) + 1), rng.choice(BAD_SEGMENTS))
    return "/".join(segments)


def s3_keys(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """URLs that name no object (``..``, empty segments, spaces, ``?``, control characters) through
    every command that takes one: exit 2 in one line before any request; a region that names a host:
    exit 2, no connection to it; stray keys with ``..`` or ``//`` under a prefix: skipped and named,
    the command goes on (exit 0)."""
    bucket, env = _bucket(ctx, work), _s3_env(ctx, work)
    kind = ctx.index % 3
    if kind == 0:
        url = f"s3://{bucket}/{_bad_key(rng)}"
        argv = rng.choice([["data", "verify", url], ["ckpt", "list", url],
                           ["train", *SHARD_TRAIN, f"data.path={url}", f"run.dir={work / 'run'}"],
                           ["train", *crafted.BASE, f"checkpoint.remote={url}", f"run.dir={work / 'run'}"]])
        code, out = run(trial, argv, work / "url.log", env=env, timeout=S3_TIMEOUT)
        answered(trial, code, out, f"{argv[:2]} {url!r}", (2,))
        trial.notes.append(f"{url!r}: {error_line(out)}")
    elif kind == 1:
        import socket

        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            port = listener.getsockname()[1]
            region = rng.choice([f"x@127.0.0.1:{port}/#", f"us-east-1.127.0.0.1:{port}", f"x@127.0.0.1:{port}?",
                                 f"a/../127.0.0.1:{port}", f"US East {port}"])
            url = _upload(ctx, bucket, "data", ctx.shards())
            argv = rng.choice([["data", "verify", url, "--storage-option", f"region={region}"],
                               ["train", *SHARD_TRAIN, f"data.path={url}", f"run.dir={work / 'run'}",
                                f'data.storage_options={{region: "{region}"}}']])
            code, out = run(trial, argv, work / "region.log", env=env, timeout=S3_TIMEOUT)
            answered(trial, code, out, f"region={region!r}", (2,))
            listener.setblocking(False)
            try:  # a connect completes in the kernel's backlog whether or not it is accepted
                listener.accept()[0].close()
                trial.lost.append(f"region={region!r}: a request reached 127.0.0.1:{port}")
            except BlockingIOError:
                pass
    else:
        url = _upload(ctx, bucket, "stray", ctx.shards())
        strays = [f"stray/{_bad_key(rng)}/x" for _ in range(rng.randint(1, 3))]
        for key in strays:
            with contextlib.suppress(Exception):  # a key the server itself refuses is no stray
                ctx.s3().client().put_object(Bucket=bucket, Key=key, Body=b"stray")
        for name, argv in (("verify", ["data", "verify", url]),
                           ("train", ["train", *SHARD_TRAIN, f"data.path={url}", f"run.dir={work / 'run'}"])):
            code, out = run(trial, argv, work / f"stray-{name}.log", env=env, timeout=S3_TIMEOUT)
            answered(trial, code, out, f"{name} with stray keys {strays!r}", (0,))
    no_secret_in(trial, work)


GONE = """import os, runpy, sys
import boto3
from hpctrain.data import remote
bucket, key, real = sys.argv[1], sys.argv[2], remote.mirror
def mirror(*args, **kwargs):
    root = real(*args, **kwargs)
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).delete_object(Bucket=bucket, Key=key)
    return root
remote.mirror = mirror
sys.argv = ["hpctrain", *sys.argv[3:]]
runpy.run_module("hpctrain", run_name="__main__", alter_sys=True)
"""


def s3_manifests(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """Shard manifests and indexes on the store beyond HPCTRAIN_MAX_JSON_BYTES (64 KiB here), with and
    without ``index_sha256``, fuzzed, or without shards; a tar deleted between the listing and its
    read: exit 1 or 2 in one line naming the place or the limit, nothing past the limit cached."""
    bucket, local = _bucket(ctx, work), ctx.shards()
    env = _s3_env(ctx, work, HPCTRAIN_MAX_JSON_BYTES=str(JSON_LIMIT_TEST))
    manifest = json.loads(manifest_path(local, "train").read_text())
    kind = ("manifest", "index", "fuzzed", "gone", "empty")[ctx.index % 5]
    pad = b" " * (JSON_LIMIT_TEST + rng.randrange(1, 1 << 20))
    says: str | None = "HPCTRAIN_MAX_JSON_BYTES" if kind in ("manifest", "index") else None
    change: dict[str, bytes | None] = {}
    if kind == "manifest":
        change["train.manifest.json"] = json.dumps(manifest).encode() + pad
    elif kind == "index":
        for shard in manifest["shards"]:
            shard.pop("index_sha256", None)
        change["train.manifest.json"] = json.dumps(manifest).encode()
        change["train-000001.idx.json"] = (local / "train-000001.idx.json").read_bytes() + pad
    elif kind == "fuzzed":
        change["train.manifest.json"] = shard_fuzz_tests._mutate_json(manifest, rng)
    elif kind == "empty":
        change["train.manifest.json"] = json.dumps({**manifest, "shards": []}).encode()
    url = _upload(ctx, bucket, kind, local, change)
    train = ["train", *SHARD_TRAIN, f"data.path={url}", f"run.dir={work / 'run'}"]
    if kind == "gone":
        prefix = [sys.executable, "-c", GONE, bucket, f"{kind}/train-000001.tar"]
        whole = ["train", *FUZZ_TRAIN, "data.num_workers=0", f"data.path={url}", f"run.dir={work / 'run'}"]  # every tar
        code, out = run(trial, whole, work / "gone.log", prefix=prefix, env=env, timeout=S3_TIMEOUT)
        answered(trial, code, out, "a tar deleted after the listing", (1,), f"{url}/train-000001.tar")
    else:
        for name, argv in (("verify", ["data", "verify", url]), ("train", train)):
            code, out = run(trial, argv, work / f"{name}.log", env=env, timeout=S3_TIMEOUT)
            answered(trial, code, out, f"{kind}, {name}", (0, 1, 2) if kind == "fuzzed" else (1, 2), says)
            if kind == "empty":
                trial.expect("0 of the 0 shards" not in out, f"empty, {name}: {error_line(out)}")
    cached = [p for p in (work / "cache").rglob("*") if p.is_file() and p.stat().st_size > JSON_LIMIT_TEST
              and p.name.endswith(".json")]
    trial.expect(not cached, f"{kind}: files past the limit cached: {[p.name for p in cached]}")
    no_secret_in(trial, work)
    trial.notes.append(f"{kind}: codes {trial.codes}")


def _token_folder(kind: str, root: Path, marker: Path) -> Path:
    """A tokenizer folder of ``kind``; ``marker`` is what running its code would create."""
    root.mkdir(parents=True)
    word_level: dict[str, Any] = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "the": 1, "dog": 2}, "unk_token": "[UNK]"}}
    if kind == "auto_map":
        (root / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}))
        (root / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    elif kind == "fifo":
        os.mkfifo(root / "tokenizer.json")
    elif kind == "dev_zero":
        (root / "tokenizer.json").symlink_to("/dev/zero")
    elif kind == "sentencepiece_fifo":
        os.mkfifo(root / "tokenizer.model")
        (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    elif kind in ("ids_3e9", "ids_2e31"):
        top = 3_000_000_000 if kind == "ids_3e9" else 2**31 - 1
        word_level["model"] = {"type": "WordLevel", "vocab": {"[UNK]": 0, "the": top, "dog": 300}, "unk_token": "[UNK]"}
        (root / "tokenizer.json").write_text(json.dumps(word_level))
    elif kind == "backtracking":
        word_level["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated",
                                       "invert": False}
        (root / "tokenizer.json").write_text(json.dumps(word_level))
    return root


TOKENIZER_KINDS = ("auto_map", "fifo", "dev_zero", "sentencepiece_fifo", "ids_3e9", "ids_2e31", "backtracking",
                   "non_utf8")


def tokenizer_folders(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """``data shard --tokenizer`` on crafted folders (an ``auto_map`` with "y" on stdin, a FIFO or
    /dev/zero as its file, ids above 255, a backtracking pre-tokenizer) and a jsonl record that is no
    UTF-8: exit 0 with the right tokens, or 1/2 in one line within the time-out; no code run."""
    kind, marker = TOKENIZER_KINDS[ctx.index % len(TOKENIZER_KINDS)], work / "RAN"
    corpus = work / "corpus"
    corpus.mkdir()
    text = "the dog " * rng.randint(4, 40) + ("a" * 5000 + "!" if kind == "backtracking" else "")
    (corpus / "d0.txt").write_text(text)
    if kind == "non_utf8":
        noise = rng.randbytes(8).hex().encode()
        (corpus / "train.jsonl").write_bytes(b'{"text": "the dog"}\n{"text": "caf\xe9 ' + noise + b'\xff"}\n')
        argv = ["data", "shard", f"jsonl:{corpus / 'train.jsonl'}", str(work / "out"), "--split", "train", "--seq-len",
                "8", "--quiet"]
    else:
        folder = _token_folder(kind, work / "tok", marker)
        argv = ["data", "shard", f"text:{corpus}", str(work / "out"), "--split", "train", "--seq-len", "8",
                "--packing", "documents", "--tokenizer", str(folder), "--quiet"]
    (work / "stdin").write_bytes(b"y\ny\n")
    code, out = run(trial, argv, work / "shard.log", timeout=60, stdin=work / "stdin")
    says = {"auto_map": "auto_map", "non_utf8": "train.jsonl"}.get(kind)
    answered(trial, code, out, kind, (2,) if kind == "auto_map" else (0, 1, 2), says)
    if marker.exists():
        trial.lost.append(f"{kind}: the tokenizer folder's code ran")
    trial.expect("[y/N]" not in out, f"{kind}: asked on stdin whether to run the folder's code")
    manifest = work / "out" / "train.manifest.json"
    if code == 0 and kind.startswith("ids_") and manifest.is_file():
        vocab = json.loads(manifest.read_text()).get("vocab_size", 0)
        top = 3_000_000_000 if kind == "ids_3e9" else 2**31 - 1
        trial.expect(vocab > top, f"{kind}: shards written with vocab_size {vocab}: ids up to {top} would wrap")
    trial.notes.append(f"{kind}: exit {code}: {error_line(out)}")


MIX_WEIGHTS = ["1", "3", "0.5", "0", "-1", "1.0e-7", "1.0e+308", ".inf", "-.inf", ".nan", "1" + "0" * 400, "true",
               '"x"', "5.0e-324", "1.0e+200", "null", "[1]"]


def _mix_case(rng: random.Random) -> tuple[list[str], int]:
    """Random weights of a random count of sources, and the exit code ``config show`` must give."""
    count = rng.choice([1, 2, 3, 5, 8, 64, 1024, 1025, 3000])
    pick = rng.random()
    if pick < 0.5:  # mostly good ones: the right answer is exit 0
        weights = [f"{rng.uniform(0.01, 10):.4f}" for _ in range(count)]
    else:
        weights = [rng.choice(MIX_WEIGHTS) if rng.random() < 0.3 else f"{rng.uniform(0, 10):.3f}" for _ in range(count)]
    values: list[Any] = []
    for w in weights:
        try:
            v = json.loads(w.replace(".inf", "Infinity").replace(".nan", "NaN"))
        except ValueError:
            v = "x"
        values.append(v)
    good = count <= 1024 and all(type(v) in (int, float) and abs(v) < 2**1000 and v == v and 0 <= v < float("inf")
                                 for v in values)
    total = sum(float(v) for v in values) if good else 0.0
    good = good and 0 < total < float("inf") and all(v == 0 or v >= 1e-6 * total for v in values)
    return weights, 0 if good else 2


def mix_fuzz(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """A random data.mix (1 to 3,000 sources; weights good, zero, tiny, huge, inf, nan, negative,
    past a float, of the wrong type) through ``config show``: exit 0 exactly when it is a mixture,
    else 2 in one line; every 4th good one of at most 8 sources trains 2 steps with the counts right."""
    weights, want = _mix_case(rng)
    entries = [f"  - {{name: synthetic_tiny, weight: {w}, label: s{i}}}" for i, w in enumerate(weights)]
    config = work / "mix.yaml"
    config.write_text("model:\n  name: tests.user_models:tiny_mlp\ndata:\n  mix:\n" + "\n".join(entries) + "\n")
    case = f"{len(weights)} sources, weights {sorted(set(weights))[:6]}"
    code, out = run(trial, ["config", "show", str(config)], work / "show.log", timeout=QUICK_TIMEOUT)
    answered(trial, code, out, case, (want,), f"data.mix has {len(weights)} sources" if len(weights) > 1024 else None)
    if want == 0 and len(weights) <= 8 and ctx.index % 4 == 0:
        run_dir = work / "run"
        code, out = run(trial, ["train", str(config), "data.synthetic_size=64", "data.max_val_samples=8",
                                "data.batch_size=8", "train.max_steps=2", "train.progress=false", "train.threads=1",
                                "checkpoint.enabled=false", f"run.dir={run_dir}"], work / "train.log")
        if answered(trial, code, out, f"train {case}", (0,)):
            mix = json.loads((run_dir / "summary.json").read_text())["mix"]
            trial.expect(sum(r["samples"] for r in mix.values()) == 16 and len(mix) == len(weights),
                         f"train {case}: summary mix {mix}")
    trial.notes.append(f"{case}: exit {code}")


def _put_checkpoint(ctx: Context, bucket: str, prefix: str, name: str, files: dict[str, bytes],
                    manifest: dict[str, Any]) -> None:
    """A (maybe crafted) checkpoint uploaded as an upload would: files, then the manifest with their hashes."""
    from hpctrain.checkpoint import checksum

    client, algorithm = ctx.s3().client(), checksum.resolve(checksum.DEFAULT)
    for file, data in files.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}/{file}", Body=data)
    body = {**manifest, "files": {f: checksum.hash_bytes(d, algorithm) for f, d in files.items()}}
    client.put_object(Bucket=bucket, Key=f"{prefix}/{name}/{layout.MANIFEST}", Body=json.dumps(body).encode())


class _Payload:
    """Pickles as a call that creates ``marker``: a crafted rank file's right-hashed payload."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


REMOTE_KINDS = ("misnamed", "file_and_folder", "long_name", "payload", "stray_keys", "two_runs")


def remote_ckpt(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """A tier with steps 4 and 8 of run A and a crafted newer one (named 99 with a manifest of 8,
    files ``x`` and ``x/y``, a 300-character name, a right-hashed ``__reduce__`` payload, keys with
    ``..``/``//``): a new run dir resumes from step 8 (exit 0), nothing run; ``ckpt list``/``verify``
    in one line each. ``two_runs``: B on A's prefix while A runs: exit 2 naming A, A's uploads whole."""
    bucket, env, kind = _bucket(ctx, work), _s3_env(ctx, work), REMOTE_KINDS[ctx.index % len(REMOTE_KINDS)]
    url = f"s3://{bucket}/tier"
    if kind == "two_runs":
        remote_two_runs(trial, rng, work, ctx, url, env)
        return
    code, out = run(trial, ["train", *crafted.BASE, f"run.dir={work / 'a'}", f"checkpoint.remote={url}"],
                    work / "a.log", env=env, timeout=S3_TIMEOUT)
    if not answered(trial, code, out, "run A", (0,)):
        return
    eight = work / "a" / "checkpoints" / layout.step_name(8)
    files = {f.relative_to(eight).as_posix(): f.read_bytes() for f in sorted(eight.rglob("*"))
             if f.is_file() and f.name != layout.MANIFEST}
    info = {k: v for k, v in layout.read_manifest(eight).items() if k != "files"}
    marker = work / "PWNED"
    if kind == "misnamed":
        name, content, manifest = "step-000000099", files, info
    elif kind == "file_and_folder":
        name, content, manifest = "step-000000010", {**files, "x": b"1", "x/y": b"2"}, {**info, "step": 10}
    elif kind == "long_name":
        name, content, manifest = "step-000000011", {**files, "a" * rng.randint(256, 400): b"1"}, {**info, "step": 11}
    elif kind == "payload":
        import io

        import torch

        from hpctrain.checkpoint.state import rank_file

        buf = io.BytesIO()
        torch.save(_Payload(marker), buf)
        name, content, manifest = "step-000000012", {**files, rank_file(0): buf.getvalue()}, {**info, "step": 12}
    else:
        name = "step-000000013"
        content, manifest = files, {**info, "step": 13}
        for key in (f"tier/{name}/../x", f"tier/step-000000014//{layout.MANIFEST}", f"tier/{_bad_key(rng)}"):
            with contextlib.suppress(Exception):
                ctx.s3().client().put_object(Bucket=bucket, Key=key, Body=b"{}")
    _put_checkpoint(ctx, bucket, "tier", name, content, manifest)
    if kind == "stray_keys":  # the crafted one is intact: resume takes it
        name = "step-000000013"
    code, out = run(trial, ["train", *crafted.BASE, f"run.dir={work / 'b'}", f"checkpoint.remote={url}",
                            "resume=auto"], work / "b.log", env=env, timeout=S3_TIMEOUT)
    want = name if kind == "stray_keys" else layout.step_name(8)
    answered(trial, code, out, f"{kind}: resume=auto in a new run dir", (0,), "resumed from")
    trial.expect(want in " ".join(line for line in out.splitlines() if "resumed from" in line),
                 f"{kind}: did not resume from {want}: {[x for x in out.splitlines() if 'resumed' in x][:1]}")
    if marker.exists():
        trial.lost.append(f"{kind}: the crafted checkpoint's payload ran")
    code, out = run(trial, ["ckpt", "list", url], work / "list.log", env=env, timeout=S3_TIMEOUT)
    answered(trial, code, out, f"{kind}: ckpt list", (0, 1))
    if kind != "stray_keys":
        code, out = run(trial, ["ckpt", "verify", f"{url}/{name}"], work / "verify.log", env=env, timeout=S3_TIMEOUT)
        # right hashes: verify may call the payload's files intact; resume is what must refuse to load them
        answered(trial, code, out, f"{kind}: ckpt verify", (0, 1, 2) if kind == "payload" else (1, 2))
    no_secret_in(trial, work)


def remote_two_runs(trial: Trial, rng: random.Random, work: Path, ctx: Context, url: str,
                    env: dict[str, str]) -> None:
    """Run A uploads to ``url``; B (another run dir) starts on it while A is stopped: exit 2 naming
    A's run, nothing of the tier changed; A goes on and ends with its checkpoints on the tier."""
    from hpctrain.checkpoint import remote as ckpt_remote

    a_dir = work / "a"
    args = [*SLOW_RUN_ARGS, "checkpoint.every_steps=8", f"checkpoint.remote={url}"]
    first = start(trial, hpctrain(1, *args, f"run.dir={a_dir}"), work / "a.log", env=env)
    at = rng.randint(10, 60)
    if not trial.expect(wait_until(lambda: preempt._last_step(a_dir) >= at, first), f"never reached step {at}"):
        finish(trial, first, work / "a.log")
        return
    os.killpg(first.pid, signal.SIGSTOP)
    try:
        bucket = url.split("/")[2]
        before = ctx.s3().keys(bucket)
        code, out = run(trial, hpctrain(1, *args, f"run.dir={work / 'b'}", "resume=auto"), work / "b.log", env=env,
                        timeout=S3_TIMEOUT)
        answered(trial, code, out, "run B on A's prefix", (2,), "is in use by run")
        if ctx.s3().keys(bucket) != before:
            trial.lost.append("run B changed the tier A owns")
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    code, out = finish(trial, first, work / "a.log", timeout=S3_TIMEOUT * 2)
    answered(trial, code, out, "run A after B", (0,))
    with contextlib.suppress(Exception):
        steps = [s for s, _ in ckpt_remote.committed(ckpt_remote.open_store(url))]
        trial.expect(bool(steps) and max(steps) == 128, f"A's tier holds steps {steps}, not up to 128")


ESTIMATE_FILES: dict[str, Callable[[Path, random.Random], object]] = {  # case -> writes config.json
    "intact": lambda p, r: p.write_text(json.dumps(_hf_base())),  # the right answer: exit 0
    "huge_int": lambda p, r: p.write_text(json.dumps({**_hf_base(), "hidden_size": 10**30})),
    "digits_5000": lambda p, r: p.write_text(json.dumps(_hf_base())[:-1] + ', "num_hidden_layers": ' + "9" * 5000
                                             + "}"),
    "deep": lambda p, r: p.write_text("[" * 200_000 + "]" * 200_000),
    "experts_1e12": lambda p, r: p.write_text(json.dumps({**_hf_base(), "model_type": "mixtral",
                                                          "num_local_experts": 1e12, "num_experts_per_tok": 2})),
    "nan": lambda p, r: p.write_text(json.dumps(_hf_base())[:-1] + ', "intermediate_size": NaN}'),
    "negative": lambda p, r: p.write_text(json.dumps({**_hf_base(), "num_attention_heads": -r.randint(1, 64)})),
    "types": lambda p, r: p.write_text(json.dumps({**_hf_base(), "vocab_size": r.choice(["x", [1], {}, True, None])})),
    "fifo": lambda p, r: os.mkfifo(p),
    "dev_zero": lambda p, r: p.symlink_to("/dev/zero"),
    "sparse_4g": lambda p, r: _sparse(p, 4 << 30),
    "not_utf8": lambda p, r: p.write_bytes(b'{"model_type": "llama\xff"}'),
    "array": lambda p, r: p.write_text("[1, 2, 3]"),
}


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as fh:
        fh.truncate(size)  # no block written: 4 GiB that cost nothing


def _hf_base() -> dict[str, Any]:
    base: dict[str, Any] = json.loads((ROOT / "tests" / "estimate" / "hf_configs" / "llama-2-7b.json").read_text())
    return base


ESTIMATE_FLAGS = [
    ["estimate", "--params", "1e400"], ["estimate", "--params", "nan"], ["estimate", "--params=-7B"],
    ["estimate", "--params", "7B", "--gpus", "1000000000000"], ["estimate", "--params", "7B", "--gpu-memory-gb", "nan"],
    ["estimate", "--model", "gpt", "--seq-len", "1000000000000"], ["estimate", "--params", "7B", "--tokens", "inf"],
    ["estimate", "--params", "7B", "--micro-batch", "100000000000"],
    ["estimate", "--model", "gpt", "--layers", "1" + "0" * 30],
    ["estimate", "--params", "7B", "--mtbf-hours", "0"], ["estimate", "--params", "7B", "--mfu", "nan"],
    ["plan", "--gpu", "h100-sxm", "-n", "1000000000", "--nodes", "1000000000", "model.name=gpt"],
    ["plan", "--gpu", "h100-sxm", "model.name=gpt", "data.batch_size=100000000000"],
    ["plan", "--gpu", "h100-sxm", "model.name=gpt", "model.n_layers=1000000000", "model.hidden=1000000000"],
    ["plan", "--gpu", "h100-sxm", "--gpu-memory-gb", "nan", "model.name=gpt"],
    ["plan", "--gpu", "h100-sxm", "--gpu-memory-gb", "-1", "model.name=gpt"],
]


def estimator_inputs(trial: Trial, rng: random.Random, work: Path, ctx: Context) -> None:
    """``hpctrain estimate --hf-config`` on crafted config.json files (10^30, 5,000 digits, 200,000
    deep, 1e12 experts, NaN, wrong types, a FIFO, /dev/zero, a 4 GiB sparse file) and ``estimate`` /
    ``plan`` with sizes beyond physical sense: exit 0 with finite numbers or 2 in one line, within
    QUICK_TIMEOUT s. Odd trials: a flag case; even trials: a file case, its values mutated at random."""
    if ctx.index % 2:
        argv = ESTIMATE_FLAGS[(ctx.index // 2) % len(ESTIMATE_FLAGS)]
        case = " ".join(argv)[:100]
    else:
        kind = list(ESTIMATE_FILES)[(ctx.index // 2) % len(ESTIMATE_FILES)]
        path = work / "config.json"
        ESTIMATE_FILES[kind](path, rng)
        argv, case = ["estimate", "--hf-config", str(path), "--gpus", str(rng.choice([1, 8, 64]))], kind
    code, out = run(trial, argv, work / "estimate.log", timeout=QUICK_TIMEOUT)
    answered(trial, code, out, case, (0,) if case == "intact" else (0, 2))
    if code == 0:
        trial.expect(not re.search(r"\b(nan|inf)\b", out, re.IGNORECASE), f"{case}: exit 0 printing nan/inf")
    trial.notes.append(f"{case}: exit {code}: {error_line(out)}")


# ---------------------------------------------------------------- the suite


@dataclass
class Context:
    """What the probes share: the references, the crafted probes' base run, the disk, the trial index."""

    work: Path
    disk: str
    reference: References
    index: int = 0
    _bases: dict[str, Path] = field(default_factory=dict)
    _s3: Any = None  # tests/s3_server.py's moto server, started by the first probe that needs it
    _shards: Path | None = None

    def s3(self) -> Any:
        """The moto S3 server of issue 42's probes (one for the whole suite; each trial its own bucket)."""
        if self._s3 is None:
            from tests.s3_server import S3Server

            self._s3 = S3Server().start()
        return self._s3

    def shards(self) -> Path:
        """Train and val shards (test_fault_suite.py's) to upload, written once."""
        if self._shards is None:
            self._shards = make_fuzz_shards(self.work / "issue42-shards")
        return self._shards

    def close(self) -> None:
        if self._s3 is not None:
            self._s3.kill()

    def crafted_base(self, fmt: str = "torch") -> Path:
        """A finished run with checkpoints at steps 4 and 8 (test_crafted.py's BASE) in checkpoint.format
        ``fmt``, trained once."""
        if fmt not in self._bases:
            path, trial = self.work / f"crafted-base-{fmt}", Trial()
            code, out = run(trial, ["train", *crafted.BASE, f"run.dir={path}", f"checkpoint.format={fmt}"],
                            self.work / f"crafted-base-{fmt}.log")
            if code != 0:
                raise RuntimeError(f"the crafted probes' base run failed ({code}):\n{out[-3000:]}")
            self._bases[fmt] = path
        return self._bases[fmt]


Probe = Callable[[Trial, random.Random, Path, Context], None]
PROBES: dict[str, tuple[int, Probe | None]] = {
    "disk_full_sync": (1, disk_full("sync")),
    "disk_full_async": (1, disk_full("async")),
    "disk_full_final": (1, disk_full("final")),
    "sigkill_async": (4, sigkill_async),  # 10 before issue 25's probes: the whole default run stays in 15 min
    "shard_fuzz": (200, None),  # its own loop: one worker process for many mutations
    **{f"crafted_{kind.replace('-', '_')}": (1, crafted_probe(kind)) for kind in crafted.CRAFTED},
    **{f"read_{kind}": (1, crafted_read_probe(kind)) for kind in crafted_reads.CRAFTED},
    "checkpoint_fuzz": (3000, None),  # its own loop: one pytest run per fuzzer
    "two_runs": (2, two_runs),
    "launcher_kill": (2, launcher_kill),
    "stalled_rank": (2, stalled_rank),
    "foreign_run_dir": (1, foreign_run_dir),
    "nonfinite": (1, nonfinite),
    "config_fuzz": (100, config_fuzz),  # the 13 attack cases, then 87 fuzzed
    "shard_crafted": (1, shard_crafted),
    "shard_index_fuzz": (48, shard_index_fuzz),
    "slurm_render": (1, slurm_render),
    "stalled_in_agreement": (4, stalled_in_agreement),
    "killed_rank": (2, killed_rank),
    "s3_keys": (24, s3_keys),  # issue 42: bad URLs, regions naming a host, stray keys by turns
    "s3_manifests": (10, s3_manifests),  # beyond the limit (manifest, index), fuzzed, a tar gone, no shards
    "tokenizer_folders": (8, tokenizer_folders),  # one of each TOKENIZER_KINDS
    "mix_fuzz": (60, mix_fuzz),
    "remote_ckpt": (6, remote_ckpt),  # one of each REMOTE_KINDS
    "estimator_inputs": (58, estimator_inputs),  # every file case (13) and flag case (16) twice
}


# a trial per case: only the ones that went wrong are printed
FUZZ_PROBES = {"config_fuzz", "shard_index_fuzz", "s3_keys", "mix_fuzz", "estimator_inputs"}


def run_probe(name: str, trials: int, seed: int, ctx: Context) -> Tally:
    tally, began = Tally(), time.monotonic()
    scratch = ctx.work / name
    if name == "shard_fuzz":
        shard_fuzz(trials, seed, scratch, tally)
    if name == "checkpoint_fuzz":
        checkpoint_fuzz(trials, seed, scratch, tally)
    for n in range(trials if PROBES[name][1] is not None else 0):
        trial, work = Trial(), scratch / f"trial-{n}"
        work.mkdir(parents=True)
        ctx.index = n
        try:
            PROBES[name][1](trial, random.Random(f"{seed}:{name}:{n}"), work, ctx)  # type: ignore[misc]
        except Exception as err:  # noqa: BLE001 - the probe's own failure: reported, the suite goes on
            trial.failed.append(f"probe error: {type(err).__name__}: {err}")
        finally:
            trial.cleanup()
        tally.add(n, trial)
        shutil.rmtree(work, ignore_errors=True)
        if name not in FUZZ_PROBES or trial.lost or trial.failed or trial.hang or trial.traceback:
            print(f"  {name} trial {n}: codes {trial.codes}"
                  + "".join(f"; {text}" for text in [*trial.lost, *trial.failed, *trial.notes]), flush=True)
    tally.seconds = time.monotonic() - began
    return tally


def table(tallies: dict[str, Tally]) -> str:
    rows = ["| probe | trials | exit codes seen | tracebacks | hangs | data lost | other failures | time |",
            "|---|---|---|---|---|---|---|---|"]
    for name, t in tallies.items():
        codes = ", ".join(f"{c} ({n})" for c, n in sorted(t.codes.items()))
        rows.append(f"| {name} | {t.trials} | {codes} | {t.tracebacks} | {t.hangs} | {t.lost} | {t.failed} | "
                    f"{t.seconds:.0f} s |")
    return "\n".join(rows)


def trial_counts(specs: list[str], names: list[str]) -> dict[str, int]:
    """``--trials N`` (every probe) and ``--trials PROBE=N`` over the defaults."""
    counts = {name: PROBES[name][0] for name in names}
    for spec in specs:
        name, _, value = spec.rpartition("=")
        if name and name not in PROBES:
            raise SystemExit(f"--trials {spec}: no probe {name!r}; probes: {', '.join(PROBES)}")
        for target in ([name] if name else names):
            counts[target] = int(value)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", action="append", default=[], metavar="[PROBE=]N",
                    help="trials per probe (all, or one probe by name); repeatable")
    ap.add_argument("--only", help=f"comma-separated probes: {', '.join(PROBES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/hpctrain-faults"), help="scratch (emptied first)")
    ap.add_argument("--disk-full", choices=["auto", "tmpfs", "inject"], default="auto",
                    help="auto: a tmpfs where mounting is permitted, else injected ENOSPC")
    ap.add_argument("--json", type=Path, help="write the counts (and every failure's note) here")
    ap.add_argument("--fuzz-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--fuzz-cases", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fuzz_worker:
        fuzz_worker(args.fuzz_worker, args.seed, args.fuzz_cases)
        return 0
    names = args.only.split(",") if args.only else list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        ap.error(f"--only: no probe {', '.join(unknown)}; probes: {', '.join(PROBES)}")
    counts = trial_counts(args.trials, names)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    disk = args.disk_full
    if disk == "auto" and any(n.startswith("disk_full") for n in names):
        why = can_mount(args.dir)
        disk = "tmpfs" if why is None else "inject"
        if why:
            print(f"mount of a tmpfs not permitted ({why}): disk full is injected ENOSPC at the checkpoint commit")
    ctx = Context(args.dir, disk, References(args.dir))
    began, tallies = time.monotonic(), {}
    try:
        for name in names:
            print(f"{name}: {counts[name]} trial(s)", flush=True)
            tallies[name] = run_probe(name, counts[name], args.seed, ctx)
    finally:
        ctx.close()
    print(table(tallies))
    total = time.monotonic() - began
    disk_line = f"; disk full by {disk}" if any(n.startswith("disk_full") for n in names) else ""
    print(f"{sum(t.trials for t in tallies.values())} trials in {total:.0f} s{disk_line}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "seed": args.seed,
                                         "disk_full": disk, "seconds": round(total), "probes":
                                         {n: t.as_json() for n, t in tallies.items()}}, indent=2) + "\n")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0 if all(t.clean for t in tallies.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
