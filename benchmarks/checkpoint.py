"""Checkpoint benchmark: hpctrain against dd, torch.save and torch.distributed.checkpoint,
in the same run, on the same state, interleaved round by round.

    python benchmarks/checkpoint.py [--gb 1.0] [--repeats 3] [--dir /tmp/hpctrain-bench-ckpt] [--json out.json]

Writes (each durable: fsync before the clock stops):

* ``dd if=/dev/zero bs=16M oflag=direct conv=fsync`` of the same byte count (the disk);
* ``torch.save(model.state_dict())`` to a file, then fsync;
* ``torch.distributed.checkpoint.save`` (one process, ``FileSystemWriter(sync_files=True)``);
* hpctrain's sync writer (O_DIRECT tensor bytes checksummed in parallel, skeleton and
  per-rank files, fsync, manifest, rename, directory fsync).

Reads, each from a cold page cache (posix_fadvise DONTNEED), into the live, pre-touched model:

* ``dd iflag=direct`` of hpctrain's tensor file (the disk);
* ``torch.load`` + ``load_state_dict`` (torch.load allocates fresh tensors);
* ``torch.distributed.checkpoint.load`` (in place into the live state dict);
* hpctrain verify+load in one pass (what resume does: every byte read once, straight into
  the live parameters, hashed by helper threads while the next bytes are read, checked
  against the manifest before the state is used);
* for reference, the earlier two-pass way: verify (hash every file) then load.

Also the async stall (time ``save()`` blocks plus the time the next ``optimizer.step()``
waits for the writer thread's copy, against a sync save) and ``Checkpointer.resume``
end to end. Buffers are pre-touched: this VM first-touches fresh memory at 1-3 GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the measuring code is shared with `hpctrain bench checkpoint`
from hpctrain.bench.ckpt_io import run  # noqa: E402


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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scratch = Path(args.dir)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        results = run(scratch, args.gb, args.repeats, args.step_ms / 1e3)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for key, value in results.items():
        print(f"{key:<24} {value:.4g}" if isinstance(value, float) else f"{key:<24} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
