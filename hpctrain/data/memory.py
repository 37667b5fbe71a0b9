"""Deprecated alias of :mod:`hpctrain.data.in_memory` (renamed: one of three ``memory.py``), kept for
one release so that ``from hpctrain.data.memory import EvalLoader, MemoryLoader`` keeps working.
Import from ``hpctrain.data`` (or ``hpctrain``) instead."""

from hpctrain.data.in_memory import EvalLoader, MemoryLoader, rank_slice, rank_slice_of

__all__ = ["EvalLoader", "MemoryLoader", "rank_slice", "rank_slice_of"]
