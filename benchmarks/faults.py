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
* ``sigkill_async`` [10]: async saves every 4 steps; the launcher and every rank SIGKILLed at
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
* ``two_runs`` [2]: run A is SIGSTOPped at a random step (maybe mid-save) and a second run on
  its run.dir (``hpctrain train``, then ``hpctrain run -n 2``) must exit 2 naming A's pid; A
  then goes on and ends bit-identical, every metrics row there once, every checkpoint intact.
* ``launcher_kill`` [2]: SIGKILL of ``hpctrain run -n 2``'s process group at a random step: no
  rank alive 5 s later, the restart bit-identical.
* ``stalled_rank`` [2]: one random rank SIGSTOPped under ``--hang-timeout 3`` (2, then 3
  ranks): exit 4 within hang-timeout + 30 s, that rank named in ``hang-*/summary.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
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
from tests.checkpoint import test_crafted as crafted  # noqa: E402
from tests.checkpoint import test_preempt as preempt  # noqa: E402
from tests.ckpt_models import SLOW_RUN_ARGS  # noqa: E402
from tests.dist_utils import _descendants, launch_env  # noqa: E402
from tests.launch import test_hang as hang  # noqa: E402
from tests.test_fault_suite import TRACEBACK  # noqa: E402

RUN_TIMEOUT = 300  # s for one hpctrain command: far beyond a healthy one on 2 loaded cores
HEADROOM = 32 << 10  # what a full disk leaves: the metrics rows fit, no SLOW_RUN_ARGS checkpoint (64 KB) does
FUZZ_CASE_TIMEOUT = 60  # s for one mutation's verify + train
KEEP_LAST = 3  # the default checkpoint.keep_last: older committed ones are retention's to delete


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


def start(trial: Trial, argv: list[str], log: Path, prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m hpctrain ARGV`` (or ``PREFIX ARGV``) from the repository root, output to ``log``
    (a file, not a pipe: nobody reads while it runs)."""
    cmd = prefix + argv if prefix else [sys.executable, "-m", "hpctrain", *argv]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
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


def run(trial: Trial, argv: list[str], log: Path, prefix: list[str] | None = None) -> tuple[int | None, str]:
    return finish(trial, start(trial, argv, log, prefix), log)


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


# ---------------------------------------------------------------- the suite


@dataclass
class Context:
    """What the probes share: the references, the crafted probes' base run, the disk, the trial index."""

    work: Path
    disk: str
    reference: References
    index: int = 0
    _base: Path | None = None

    def crafted_base(self) -> Path:
        """A finished run with checkpoints at steps 4 and 8 (test_crafted.py's BASE), trained once."""
        if self._base is None:
            path, trial = self.work / "crafted-base", Trial()
            code, out = run(trial, ["train", *crafted.BASE, f"run.dir={path}"], self.work / "crafted-base.log")
            if code != 0:
                raise RuntimeError(f"the crafted probes' base run failed ({code}):\n{out[-3000:]}")
            self._base = path
        return self._base


Probe = Callable[[Trial, random.Random, Path, Context], None]
PROBES: dict[str, tuple[int, Probe | None]] = {
    "disk_full_sync": (1, disk_full("sync")),
    "disk_full_async": (1, disk_full("async")),
    "disk_full_final": (1, disk_full("final")),
    "sigkill_async": (10, sigkill_async),
    "shard_fuzz": (200, None),  # its own loop: one worker process for many mutations
    **{f"crafted_{kind.replace('-', '_')}": (1, crafted_probe(kind)) for kind in crafted.CRAFTED},
    "two_runs": (2, two_runs),
    "launcher_kill": (2, launcher_kill),
    "stalled_rank": (2, stalled_rank),
}


def run_probe(name: str, trials: int, seed: int, ctx: Context) -> Tally:
    tally, began = Tally(), time.monotonic()
    scratch = ctx.work / name
    if name == "shard_fuzz":
        shard_fuzz(trials, seed, scratch, tally)
    for n in range(trials if name != "shard_fuzz" else 0):
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
    for name in names:
        print(f"{name}: {counts[name]} trial(s)", flush=True)
        tallies[name] = run_probe(name, counts[name], args.seed, ctx)
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
