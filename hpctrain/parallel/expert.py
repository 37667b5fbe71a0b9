"""``parallel.ep``: expert parallelism for a mixture of experts (:mod:`hpctrain.models.moe`).

The mesh splits the data-parallel ranks into ``edp`` (outer) x ``ep`` (inner)
(:meth:`hpctrain.core.topology.Topology.dims`). Each of the ``ep`` ranks of a group holds
``experts / ep`` whole experts: the stacked expert weights become DTensors on ``mesh["ep"]``
sharded on dim 0 (the expert), so a checkpoint (DCP) holds every expert once and resumes at
any ep size. A layer's routed tokens travel to the rank of their expert and back with
``all_to_all_single`` (torch's functional collective, autograd through it; the split sizes
first, with a plain all_to_all_single of the counts).

Gradients and memory: FSDP shards and averages the other weights over all dp ranks. The experts
are FSDP units of their own over ``edp`` (the dp / ep ranks that hold the same experts), 2D with
their ep split as FSDP x TP is (:func:`shard_experts`, as torchtitan does); with edp = 1 FSDP
leaves them alone (``ignored_params``). An expert's local gradient already sums what every ep
rank's tokens contributed (the all-to-all's backward brings it home), each from that rank's
mean loss; a hook on the expert weights divides it by ep (FSDP's reduce-scatter then averages
over edp), so it is the average over all dp ranks, like every other gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hpctrain.core.section import ConfigError
from hpctrain.core.topology import Topology
from hpctrain.models.family import family_of
from hpctrain.models.moe import Experts, MoE, split_sizes


class AllToAll:
    """A layer's dispatcher under expert parallelism (:class:`hpctrain.models.moe.Dispatcher`)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, edp: DeviceMesh | None) -> None:
        self.group, self.ep, self.edp = group, ep, edp

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """``rows`` grouped by global expert (``counts`` each) -> their experts' outputs, same order."""
        local = counts.shape[0] // self.ep
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # equal splits: local experts' counts
        host = torch.stack((counts, received_counts)).cpu()  # one copy to the host: the splits are Python ints
        sent = host[0].view(self.ep, local)  # [destination rank, its expert]
        got = host[1].view(self.ep, local)  # [source rank, my expert]
        send_splits, recv_splits = sent.sum(1).tolist(), got.sum(1).tolist()
        arrived = exchange(rows, recv_splits, send_splits, self.group)
        order = by_expert(got).to(rows.device)  # arrived is grouped by source rank, then expert: regroup by expert
        out = experts(arrived[order], split_sizes(got.sum(0), arrived.shape[0]), self.local)
        back = torch.empty_like(out).index_copy(0, order, out)
        return exchange(back, send_splits, recv_splits, self.group)

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a weight, its gradient made the average over all dp ranks (see the module doc)."""
        part = weight.to_local() if isinstance(weight, DTensor) else weight
        if part.requires_grad:
            part.register_hook(self.average)
        return part

    def average(self, grad: torch.Tensor) -> torch.Tensor:
        # the ep ranks' experts are summed by the all-to-all's backward; the replicas over edp are
        # averaged by FSDP's reduce-scatter (shard_experts), or there are none (dp = ep)
        return grad / self.ep


def exchange(rows: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """torch's differentiable all_to_all_single (its backward sends the gradients back the same way)."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), recv, send, group))


def by_expert(got: torch.Tensor) -> torch.Tensor:
    """Row indices that regroup rows laid out [source][expert] (``got`` counts) as [expert][source]."""
    flat = got.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(got)
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + got[s, e]))
              for e in range(got.shape[1]) for s in range(got.shape[0])]
    return torch.cat(pieces).to(got.device) if pieces else torch.zeros(0, dtype=torch.long, device=got.device)


def apply_expert_parallel(model: nn.Module, *, mesh: DeviceMesh, topology: Topology) -> nn.Module:
    """Keep this rank's ``experts / ep`` experts of each layer (the whole model's weights built
    alike on every rank, so the split equals one process's), as DTensors on ``mesh["ep"]``, and
    install the all-to-all dispatcher. Before FSDP, which then leaves them alone."""
    plan = family_of(model).expert_plan_of(model)
    if plan is None:
        raise ConfigError(f"parallel.ep={topology.ep} needs a model with mixture-of-experts layers "
                          "(model.name=llama model.experts=E); hint: parallel.ep=1")
    ep_mesh = mesh["ep"]
    rank = ep_mesh.get_local_rank()
    edp = mesh["edp"] if topology.dp // topology.ep > 1 else None
    dispatch = AllToAll(ep_mesh.get_group(), topology.ep, edp)
    for layer in plan.layers:
        experts = layer.experts
        if experts.w_gate.shape[0] % topology.ep:
            raise ConfigError(f"model.experts ({experts.w_gate.shape[0]}) must be divisible by parallel.ep "
                              f"({topology.ep}); hint: parallel.ep=1")
        for name, weight in list(experts.named_parameters(recurse=False)):
            part = weight.detach().chunk(topology.ep)[rank].clone()
            sharded = DTensor.from_local(part, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        layer.dispatch = dispatch
    return model


def shard_experts(model: nn.Module, shard: Callable[[nn.Module, DeviceMesh], object]) -> set[nn.Parameter]:
    """Under expert parallelism, before FSDP's units: with edp > 1, ``shard`` (fully_shard) each
    layer's experts over ``edp`` (ZeRO over the ranks holding the same experts: FSDP x EP on one
    root mesh, as FSDP x TP), whose reduce-scatter then averages their gradients over edp; the
    hook divides by ep only. Returns the expert weights FSDP's units must ignore (edp = 1: no
    replicas to shard over); empty without expert parallelism."""
    ignored: set[nn.Parameter] = set()
    for layer in (m for m in model.modules() if isinstance(m, MoE) and isinstance(m.dispatch, AllToAll)):
        dispatch = layer.dispatch
        assert isinstance(dispatch, AllToAll)
        if dispatch.edp is None:
            ignored.update(layer.experts.parameters())
            continue
        shard(layer.experts, dispatch.edp)
    return ignored
