"""hpctrain's on-disk checkpoint formats: the registry lines (torch-free: ``hpctrain ckpt list``).

Each format is written and read by one :class:`~hpctrain.checkpoint.view.CheckpointView`
class of the strategy that holds the state, imported when a manifest names its format (the
view modules also register their classes themselves, so a live view brings its formats). The
application layer imports this table (``hpctrain ckpt``, the trainer, ``LoopCheckpoint``). A
format of your own is its view class plus one ``register_format`` line in your code.
"""

from __future__ import annotations

from hpctrain.checkpoint.view import register_format

# whole tensors in the replicated files, rank 0 writes them (one process, DDP, ZeRO-1); the format
# of checkpoints written before manifests named one
register_format("torch", "hpctrain.parallel.state:WholeState", default=True)
# torch.distributed.checkpoint: every rank its shards, under the whole model's names (FSDP, TP, PP)
register_format("dcp", "hpctrain.parallel.state:ShardedState")
# DeepSpeed's own files (engine.save_checkpoint): every rank its ZeRO partitions
register_format("deepspeed", "hpctrain.parallel.deepspeed:DeepSpeedState")
