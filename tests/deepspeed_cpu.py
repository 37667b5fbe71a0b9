"""Preloaded by the forkserver of tests/dist_utils.py when torch has no CUDA: DeepSpeed imported once,
set up as every rank here uses it (the CPU accelerator), instead of ~4.5 s of CPU in each forked rank
that builds a DeepSpeed engine."""

from hpctrain.parallel.deepspeed import import_deepspeed

import_deepspeed()
