"""Checkpoints that are committed or absent: sync / async / two-tier writers, step and
wall-clock schedules, preemption signals, automatic bit-exact resume.

layout.py (commit protocol, manifest, retention), state.py (what is saved), writer.py
(how), policy.py (when), preempt.py (signals and outcome), checkpointer.py (the
trainer's handle), cli.py (``hpctrain ckpt list|verify|export``).
"""

from hpctrain.checkpoint.checkpointer import Checkpointer
from hpctrain.checkpoint.layout import CheckpointError
from hpctrain.checkpoint.preempt import EXIT_PREEMPTED

__all__ = ["EXIT_PREEMPTED", "CheckpointError", "Checkpointer"]
