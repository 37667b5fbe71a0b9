"""The meter's own hot-path cost per optimizer step: the six laps and the per-step telemetry
check (profiler/straggler schedule) that hpctrain's loop makes, timed in isolation with
``timeit`` (best of 5), minus an empty call. The end-to-end loop overhead against a
hand-written loop is benchmarks/overhead.py; this isolates the meter's share of it, which
a loaded machine's noise (+-50 us per step) would hide there. Measured twice, side by side:
without and with the heartbeat that ``hpctrain run``'s hang watchdog reads (docs/hangs.md).

    PYTHONPATH=. python benchmarks/meter.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import timeit

import torch

from hpctrain.config import load_config
from hpctrain.core import protocol as heartbeat
from hpctrain.core.env import ClusterEnv
from hpctrain.planning.layout import layout_for
from hpctrain.telemetry.loop import Telemetry
from hpctrain.telemetry.meter import BACKWARD, CKPT, DATA, FORWARD, OPTIM, OTHER


def per_step_us(calls: int, beat: bool = False) -> float:
    heartbeat._current = None  # a fresh meter opens its own heartbeat (or none)
    os.environ.pop(heartbeat.HEARTBEAT_ENV, None)
    if beat:
        os.environ[heartbeat.HEARTBEAT_ENV] = tempfile.mkdtemp(prefix="hpctrain-bench-beats-")
    cfg = load_config(None, ["telemetry.peak_tflops=1"])
    layout = layout_for(cfg.parallel, ClusterEnv())
    tel = Telemetry.build(cfg.telemetry, ClusterEnv(), torch.device("cpu"), 0, batch=layout)
    meter = tel.meter
    meter.counted = True

    def step() -> None:  # what _train_epoch / _after_step call per optimizer step (one micro-step)
        meter.lap(DATA)
        if not meter.counted:
            pass
        meter.lap(FORWARD)
        meter.lap(BACKWARD)
        meter.lap(OPTIM)
        tel.after_step(1)
        meter.lap(OTHER)
        meter.lap(CKPT)

    best = min(timeit.repeat(step, number=calls, repeat=5))
    empty = min(timeit.repeat(lambda: None, number=calls, repeat=5))
    return (best - empty) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    off, on = per_step_us(args.calls), per_step_us(args.calls, beat=True)
    print(f"meter hot path: {off:.2f} us per optimizer step (6 laps + after_step); with the heartbeat "
          f"(hpctrain run): {on:.2f} us (+{on - off:.2f})")


if __name__ == "__main__":
    main()
