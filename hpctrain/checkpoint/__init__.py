"""Checkpoints that are committed or absent: sync / async / two-tier writers, step and
wall-clock schedules, preemption signals, automatic bit-exact resume.

layout.py (commit protocol, manifest, retention), checksum.py (the files' checksums,
``checkpoint.hash``), confine.py (reading a checkpoint's files as untrusted input),
state.py (what is saved), view.py (the checkpoint-view protocol: how model + optimizer
reach the disk, one class per on-disk format, and the format registry), writer.py (how),
policy.py (when), preempt.py (signals and outcome), remote.py (the object-storage tier,
``checkpoint.remote``), tier_owner.py (which run owns a remote
prefix), checkpointer.py (the trainer's handle).
No strategy or format is named here: the views are the parallel layer's
(:mod:`hpctrain.parallel.checkpoint_formats`), ``hpctrain ckpt`` is :mod:`hpctrain.cli.ckpt`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctrain.checkpoint.layout import CheckpointError
from hpctrain.core.errors import EXIT_PREEMPTED

if TYPE_CHECKING:
    from hpctrain.checkpoint.checkpointer import Checkpointer

__all__ = ["EXIT_PREEMPTED", "CheckpointError", "Checkpointer"]


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): the config's checkpoint section and `hpctrain ckpt list` live in this
    # package and need no torch; the checkpointer does.
    if name == "Checkpointer":
        from hpctrain.checkpoint.checkpointer import Checkpointer  # torch: not on a login node's `ckpt list`

        return Checkpointer
    raise AttributeError(f"module 'hpctrain.checkpoint' has no attribute {name!r}")
