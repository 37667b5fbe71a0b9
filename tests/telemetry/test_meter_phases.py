"""The meter's phases by name, for a loop of your own: each mark books the time since the previous
one to the phase it names, into the row's breakdown columns (a fake clock: exact seconds)."""

from __future__ import annotations

from hpctrain.telemetry.meter import Meter
from hpctrain.telemetry.runs import BREAKDOWN
from tests.telemetry.test_meter import _Clock, clock  # noqa: F401 - the fixture, by name


def test_named_marks_fill_the_breakdown(clock: _Clock) -> None:  # noqa: F811
    meter = Meter(global_batch=4, step=0)
    for mark, seconds in ((meter.data, 0.5), (meter.compute, 2.0), (meter.optimizer, 0.25),  # step 1: one call
                          (meter.data, 0.5), (meter.forward, 1.0), (meter.backward, 1.0),  # step 2: apart
                          (meter.optimizer, 0.25), (meter.checkpoint, 1.5), (meter.evaluation, 2.0),
                          (meter.other, 1.0)):
        clock.now += seconds
        mark()
    row = meter.interval(2)  # two optimizer steps in 10 s
    assert {k: row[k] for k in BREAKDOWN} == {"time_data_s": 0.5, "time_fwd_bwd_s": 2.0, "time_optim_s": 0.25,
                                              "time_ckpt_s": 0.75, "time_eval_s": 1.0, "time_other_s": 0.5}
    assert row["data_wait_share"] == 1.0 / 10
    # compute() is a rank's own compute (forward and backward in one call); forward() alone when apart
    assert meter.straggler_times(2) == (5.0, 0.5, 1.5)
