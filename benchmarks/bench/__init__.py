"""``hpctrain bench NAME``: the workshop's demos as reproducible benchmarks, one file per case
(baseline, scaling, amp, workers, batch, checkpoint, strategies, mfu; see docs/bench.md).

Every case measures on whatever hardware is present, prints a table (with a progress bar
over its runs), writes ``NAME.json`` and ``NAME.png`` and states the hardware it ran on.
Shared pieces: :mod:`~bench.hardware` (what it ran on), :mod:`~bench.output`
(table, JSON, PNG), :mod:`~bench.runner` (one training run in fresh processes: its
steady-state throughput and peak memory; the ranks are :mod:`~bench.child` or the
hand-written :mod:`~bench.plain_ddp`), :mod:`~bench.loops` (hpctrain's loop
against a hand-written one, in process), :mod:`~bench.ckpt_io` (checkpoint I/O
against dd) and :mod:`~bench.shards` (image shards of any size).
``benchmarks/overhead.py`` and ``benchmarks/checkpoint.py`` use the same measuring code.
"""
