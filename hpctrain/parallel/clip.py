"""Global-norm gradient clipping that sees every shard.

Under FSDP and tensor parallelism gradients are DTensors, possibly on different meshes
(a TP weight on (dp, tp), a norm weight on dp only): ``torch.nn.utils.clip_grad_norm_``
cannot stack those. Here each mesh's group of gradients gives its norm through DTensor
(which reduces the shards), the groups are combined, and under pipeline parallelism the
stages' squared norms are summed over the pipeline group. Every rank gets the same norm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from hpctrain.core.modules import is_dtensor


def _group_key(grad: torch.Tensor) -> object:
    return (grad.device_mesh, grad.placements) if is_dtensor(grad) else None


def total_grad_norm(parameters: Iterable[torch.Tensor], *, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of all gradients of the model (all ranks' shards, all pipeline stages)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(_group_key(p.grad), []).append(p.grad)
    squares = torch.zeros((), dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        squares = squares.to(norm.device) + norm.float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        staged = squares.to("cpu" if dist.get_backend(pp_group) == "gloo" else squares.device)
        dist.all_reduce(staged, group=pp_group)
        squares = staged.to(squares.device)
    return squares.sqrt()


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, *,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most ``max_norm``; returns the norm before."""
    params = [p for p in parameters if p.grad is not None]
    norm = total_grad_norm(params, pp_group=pp_group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        grad = p.grad
        assert grad is not None
        # DTensor gradients multiply by a plain number: a 0-dim plain tensor would mix types.
        grad.mul_(coef.to(grad.device) if not is_dtensor(grad) else float(coef))
    return norm
