"""Global-norm gradient clipping that sees every shard.

Under FSDP and tensor parallelism gradients are DTensors, possibly on different meshes
(a TP weight on (dp, tp), a norm weight on dp only): ``torch.nn.utils.clip_grad_norm_``
cannot stack those. Here each mesh's group of gradients gives its norm through DTensor
(which reduces the shards), the groups are combined, and under pipeline parallelism the
stages' squared norms are summed over the pipeline group. Every rank gets the same norm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
    clip_with_norm_(params, max_norm, norm)
    return norm


def clip_with_norm_(params: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients of ``params`` by ``max_norm / norm`` (at most 1): the clip, given its norm."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        # DTensor gradients multiply by a plain number: a 0-dim plain tensor would mix types.
        grad.mul_(coef.to(grad.device) if not is_dtensor(grad) else float(coef))


def grad_norm(params: Sequence[torch.Tensor], *, sharded: bool) -> torch.Tensor:
    """The global gradient norm exactly as the strategy's clip computes it (``sharded``: DTensor
    gradients, reduced over their shards; else torch's ``get_total_norm``, fused per device)."""
    if sharded:
        return total_grad_norm(params)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type=2.0)


def clip_grads(params: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor, *, sharded: bool) -> None:
    """The clip's second half with the norm of :func:`grad_norm`: together bit for bit the
    strategy's own clip (``torch.nn.utils.clip_grad_norm_``, or :func:`clip_grad_norm_` for shards)."""
    if sharded:
        clip_with_norm_(params, max_norm, norm)
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def local_grad_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of this rank's part of the gradients, on their device, in one fused
    ``torch._foreach_norm`` pass (no host sync, no collective; DTensors count by their local shard):
    non-finite when a gradient is (or when their norm overflows fp32: the caller tells the two apart).
    Several times cheaper on a CPU than the largest magnitude (the inf-norm kernel is slow there)."""
    local = [g.to_local() if is_dtensor(g) else g for g in (p.grad for p in params) if g is not None]
    if not local:
        return torch.zeros(())
    with torch.no_grad():
        norms = torch._foreach_norm(local, 2.0)
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n if n.device == device else n.to(device) for n in norms])).float()
