"""Checkpoint benchmark: hpctrain against dd, torch.save and torch.distributed.checkpoint,
in the same run, on the same state, interleaved round by round.

    python benchmarks/checkpoint.py [--gb 1.0] [--repeats 3] [--dir /tmp/hpctrain-bench-ckpt] [--json out.json]
    python benchmarks/checkpoint.py --restart-only [--gb 1.0] [--repeats 3] [--local-dir DIR]

Writes (each durable: fsync before the clock stops):

* ``dd if=/dev/zero bs=16M oflag=direct conv=fsync`` of the same byte count (the disk);
* ``torch.save(model.state_dict())`` to a file, then fsync;
* ``torch.distributed.checkpoint.save`` (one process, ``FileSystemWriter(sync_files=True)``);
* hpctrain's sync writer (O_DIRECT tensor bytes checksummed in parallel, skeleton and
  per-rank files, fsync, manifest, rename, directory fsync), twice: with the default
  checksum (``checkpoint.hash``: xxh3, crc32 without the xxhash package; ``hash`` in the
  output) and with ``checkpoint.hash=sha256`` (the ``*_sha256`` figures).

Reads, each from a cold page cache (posix_fadvise DONTNEED), into the live, pre-touched model:

* ``dd iflag=direct`` of hpctrain's tensor file (the disk);
* ``torch.load`` + ``load_state_dict`` (torch.load allocates fresh tensors);
* ``torch.distributed.checkpoint.load`` (in place into the live state dict);
* hpctrain verify+load in one pass (what resume does: every byte read once, straight into
  the live parameters, hashed by helper threads while the next bytes are read, checked
  against the manifest before the state is used), of each of the two checkpoints;
* for reference, the earlier two-pass way: verify (hash every file) then load.

Within a round the methods run in an order rotated round by round. ``*_vs_best_peer``: the
faster of torch and DCP in the same round over hpctrain (above 1: hpctrain is faster), per
round and the median of the rounds. ``hash_GBps_*``: one stream of each checksum
(``checkpoint.hash``) installed here, over 256 MiB.

Also the async stall (time ``save()`` blocks plus the time the next ``optimizer.step()``
waits for the writer thread's copy, against a sync save) and ``Checkpointer.resume``
end to end. Buffers are pre-touched: this VM first-touches fresh memory at 1-3 GB/s.

Restart of a two-tier checkpoint (``checkpoint.local_dir``), side by side: ``resume=auto``
reading the node-local copy (verified against the manifest while read) against reading the
shared copy (the local one hidden), alternating round by round, each from a cold page cache.
``--local-dir`` puts the node-local tier on another disk (a node's NVMe) than ``--dir`` (the
shared file system); by default both are under ``--dir``, on the same disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the measuring code is shared with `hpctrain bench checkpoint`
from bench.ckpt_io import CPU, build_parts, run, state_bytes  # noqa: E402
from bench.pagecache import evict  # noqa: E402


def bench_restart(scratch: Path, local_dir: Path, gb: float, repeats: int) -> dict[str, float]:
    """Seconds of ``Checkpointer.resume("auto")`` from the node-local copy and from the shared one."""
    from hpctrain.checkpoint import layout
    from hpctrain.checkpoint.checkpointer import Checkpointer
    from hpctrain.config import load_config
    from hpctrain.core.env import ClusterEnv

    parts = build_parts(gb)
    cfg = load_config(None, ["checkpoint.every_seconds=None", f"checkpoint.local_dir={local_dir}"]).checkpoint
    run_dir = scratch / "restart"

    def checkpointer() -> Checkpointer:
        ckpt = Checkpointer(run_dir, ClusterEnv(), CPU, cfg, parts.state())
        ckpt.signals.uninstall()
        return ckpt

    ckpt = checkpointer()
    parts.counters.step = 1
    ckpt.save({}, blocking=True)  # two-tier: node-local first, then the shared copy, then step-1 kept locally
    ckpt.close()
    assert ckpt.writer.local is not None
    copy = ckpt.writer.local / layout.step_name(1)
    hidden = copy.with_name("hidden-for-the-shared-read")
    times: dict[str, list[float]] = {"local": [], "shared": []}
    for r in range(repeats):
        for where in ("local", "shared") if r % 2 == 0 else ("shared", "local"):
            if where == "shared":
                copy.rename(hidden)
            evict(run_dir)
            evict(copy.parent)
            resumed = checkpointer()
            start = time.perf_counter()
            assert resumed.resume("auto")
            times[where].append(time.perf_counter() - start)
            resumed.close()
            if where == "shared":
                hidden.rename(copy)
    local_s, shared_s = statistics.median(times["local"]), statistics.median(times["shared"])
    return {"restart_state_GB": state_bytes(parts) / 1e9, "restart_local_s": local_s, "restart_shared_s": shared_s,
            "restart_shared_over_local": shared_s / local_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="state size in GB")
    ap.add_argument("--dir", default="/tmp/hpctrain-bench-ckpt", help="scratch directory (removed at the end)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=100.0,
                    help="compute per loop step standing in for forward + backward in the async test")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads (the trainer's default for one rank: all cores)")
    ap.add_argument("--json", help="write {hpctrain_save_vs_dd, hpctrain_load_vs_dd, torch_save_vs_dd, ...} here")
    ap.add_argument("--restart-only", action="store_true",
                    help="only the two-tier restart: node-local copy against shared copy")
    ap.add_argument("--local-dir", help="the node-local tier for the restart figures (default: DIR/local, the same "
                                        "disk as the shared copy)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scratch = Path(args.dir)
    local_dir = Path(args.local_dir) / "hpctrain-bench-local" if args.local_dir else scratch / "local"
    for path in (scratch, local_dir):
        shutil.rmtree(path, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        results = {} if args.restart_only else run(scratch, args.gb, args.repeats, args.step_ms / 1e3)
        results.update(bench_restart(scratch, local_dir, args.gb, args.repeats))
    finally:
        for path in (scratch, local_dir):
            shutil.rmtree(path, ignore_errors=True)
    for key, value in results.items():
        print(f"{key:<24} {value:.4g}" if isinstance(value, float) else f"{key:<24} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
