"""The trained model out of every strategy: RUN_DIR/model.pt written by rank 0 one tensor at a
time (:mod:`hpctrain.weights.export`), gathered from shards, pipeline stages or DeepSpeed's
partitions by the strategy's own source, and the weights' hashes every rank reports in the
summary: ``params_sha256`` (the parameters) and ``buffers_sha256`` (the buffers: BatchNorm's
running statistics and counters), each over its tensors' bytes in sorted-name order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import agree
from hpctrain.weights.digest import ParamsHash
from hpctrain.weights.export import Source, write_stream


class Exporting(Protocol):
    """What :func:`save_model_streamed` needs of a strategy (hpctrain.parallel's, or your own)."""

    env: ClusterEnv

    def sync_buffers(self) -> None: ...
    def param_names(self) -> list[str]: ...
    def buffer_names(self) -> list[str]: ...
    def export_source(self) -> Source: ...


@dataclass(frozen=True)
class Digests:
    """sha256 of model.pt's parameters and of its buffers (that of no bytes for a model without any)."""

    params: str
    buffers: str


def save_model_streamed(strategy: Exporting, path: Path) -> Digests:
    """RUN_DIR/model.pt, one consolidated file written by rank 0 one tensor at a time: a sharded
    model (FSDP, HSDP, TP) or a pipeline's stages are gathered tensor by tensor, never whole on
    one rank. Every rank's buffers are first made rank 0's, so the file holds the model every
    rank validated. Returns the digests (hashed from the streamed tensors) on every rank. Every
    rank calls it; a failed write fails every rank."""
    env = strategy.env
    strategy.sync_buffers()
    names = strategy.param_names()
    source = strategy.export_source()
    buffers = ParamsHash(set(strategy.buffer_names()) & {spec.name for spec in source.specs})
    written = agree("writing model.pt", lambda: write_stream(path, _hashing(source, buffers),
                                                            write=env.is_main, param_names=names))
    mine = (written.params_sha256 or "", buffers.hexdigest()) if written is not None else ("", "")
    params, buffer_digest = _from_rank0(mine, env)
    return Digests(params, buffer_digest)


def _hashing(source: Source, buffers: ParamsHash) -> Source:
    """``source`` whose tensors also feed ``buffers`` (which skips the names it was not given)."""

    def tensors() -> Iterator[torch.Tensor | None]:
        for spec in source.specs:
            tensor = next(source.tensors, None)
            if tensor is not None:  # rank 0's whole tensor (None on the other ranks)
                buffers.update(spec.name, tensor)
            yield tensor
            del tensor  # not kept while the next one is gathered
        yield from source.tensors  # more than announced: write_stream reports it

    return Source(source.specs, tensors(), source.live)


def _from_rank0(digests: tuple[str, str], env: ClusterEnv) -> tuple[str, str]:
    """Rank 0's hashes of the streamed weights (digest.params_sha256's), on every rank."""
    shared = [digests if env.is_main else ("", "")]
    if env.distributed:
        torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0][0], shared[0][1]
