"""Checkpoints that are committed or absent: sync / async / two-tier writers, step and
wall-clock schedules, preemption signals, automatic bit-exact resume.

layout.py (commit protocol, manifest, retention), checksum.py (the files' checksums,
``checkpoint.hash``), state.py (what is saved), writer.py
(how), policy.py (when), preempt.py (signals and outcome), checkpointer.py (the
trainer's handle), cli.py (``hpctrain ckpt list|verify|export``).
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
        from hpctrain.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module 'hpctrain.checkpoint' has no attribute {name!r}")
