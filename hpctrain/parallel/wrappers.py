"""What a parallelized model is made of: the user's module inside wrappers, and whether this
rank holds shards of it. The helpers live in :mod:`hpctrain.core.modules` (core, so that the
components can ask without importing ``parallel/``); this module re-exports them for the
strategies and for users' code that imported them from here."""

from __future__ import annotations

from hpctrain.core.modules import is_dtensor, is_sharded, local_part, unwrap

__all__ = ["is_dtensor", "is_sharded", "local_part", "unwrap"]
