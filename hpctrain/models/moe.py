"""A mixture of experts: llama's MLP as ``experts`` SwiGLU MLPs behind a softmax top-k router
(Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021; Mixtral's top-2 renormalized).

* **Router**: ``softmax(router(x))`` in fp32 over the experts; each token goes to its ``top_k``
  most probable ones, weighted by their probabilities (renormalized to sum to 1 when
  ``top_k > 1``; with ``top_k = 1`` the raw probability, so the router learns from the loss).
* **Load-balancing loss** (Switch's): ``E * sum_e f_e * P_e``, ``f_e`` the share of the
  micro-batch's assignments routed to expert e, ``P_e`` its mean router probability; times
  ``aux_loss_coef``. Each layer keeps it from its last training forward.
* **Dropless or capacity**: ``capacity_factor = 0`` computes every assignment; ``> 0`` lets
  each expert take ``ceil(factor * tokens * top_k / experts)`` of the micro-batch's
  assignments, first choices first, then in token order; a dropped assignment adds nothing
  (the block's residual carries the token).
* **Shared expert** (optional): one dense SwiGLU MLP every token also passes through.

The experts' weights are stacked, expert first (``w_gate``, ``w_up``: ``(E, hidden, ffn)``,
``w_down``: ``(E, ffn, hidden)``), so expert parallelism (:mod:`hpctrain.parallel.expert`)
splits them on dim 0 and installs a :class:`Dispatcher` that sends tokens to the rank that
holds their expert; without it every expert is local.

**How the auxiliary loss reaches training** (the hook): in training, a model with experts
returns ``{"logits": ..., "aux_loss": ...}`` (the sum of its layers' weighted losses);
evaluation and ``eval()`` get the logits alone. The causal-LM task adds :func:`aux_loss_of`
the output to its loss, so the loss the trainer backpropagates (and logs as ``loss``) is
cross-entropy + aux. :func:`expert_load` gives the aux loss and the tokens each expert got
for the log rows (``moe_aux_loss``, ``expert_tokens``, ``expert_imbalance``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.core.env import collective_device


@dataclass(frozen=True)
class MoEShape:
    """The mixture's settings (the ``model.experts`` keys)."""

    experts: int
    top_k: int = 2
    aux_loss_coef: float = 0.01
    capacity_factor: float = 0.0
    shared_expert: bool = False

    def __post_init__(self) -> None:
        if self.experts < 2 or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"MoE experts={self.experts} must be >= 2 and top_k={self.top_k} in [1, experts]")
        if self.aux_loss_coef < 0 or self.capacity_factor < 0:
            raise ValueError("MoE aux_loss_coef and capacity_factor must be >= 0")

    def capacity(self, tokens: int) -> int | None:
        """Assignments one expert takes from ``tokens`` tokens; None: dropless."""
        if not self.capacity_factor:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)


class Experts(nn.Module):
    """``experts`` SwiGLU MLPs as three stacked weights, expert first (split on dim 0 by expert parallelism)."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w_up = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w_down = nn.Parameter(torch.empty(experts, ffn, hidden))

    @torch.no_grad()
    def reset_parameters(self, std: float, down_std: float) -> None:
        """Expert by expert in a fixed order, so the weights do not depend on how they are stored."""
        for e in range(self.w_gate.shape[0]):
            for weight, scale in ((self.w_gate, std), (self.w_up, std), (self.w_down, down_std)):
                nn.init.normal_(weight[e], 0.0, scale)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w_gate, self.w_up, self.w_down

    def forward(self, x: torch.Tensor, counts: list[int],
                view: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Rows of ``x`` grouped by expert, ``counts[e]`` rows for expert e -> each group through
        its expert (``view``: what expert parallelism computes with of each weight, read here,
        after FSDP's pre-forward gathered it). Every expert runs, also on no rows, so each weight
        gets a gradient (DDP)."""
        gate, up, down = (view(w) for w in self.weights()) if view is not None else self.weights()
        outs = [(F.silu(rows @ g) * (rows @ u)) @ d for rows, g, u, d in zip(x.split(counts), gate, up, down)]
        return torch.cat(outs)


class Dispatcher(Protocol):
    """Runs routed token rows (grouped by global expert, ``counts`` per expert) through the
    experts wherever they live, returning their outputs in the same order."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor: ...


def local_dispatch(rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert on this rank (one process, or data parallel without ``parallel.ep``)."""
    return experts(rows, split_sizes(counts, rows.shape[0]))


def split_sizes(counts: torch.Tensor, rows: int) -> list[int]:
    """``counts`` as Python ints; on meta (FLOP counting) an even split, which the estimator assumes too."""
    if counts.device.type != "meta":
        return [int(c) for c in counts.tolist()]
    n = counts.shape[0]
    return [rows // n + (1 if e < rows % n else 0) for e in range(n)]


@dataclass
class Routing:
    """One micro-batch's assignments, grouped by expert: ``token`` (which row of the input),
    ``weight`` (its router weight), ``counts`` per expert computed, ``assigned`` per expert before
    capacity drops (what the router asked for)."""

    token: torch.Tensor
    weight: torch.Tensor
    counts: torch.Tensor
    assigned: torch.Tensor


class MoE(nn.Module):
    """``x (B, T, hidden)`` -> the weighted sum of its top-k experts' outputs (+ the shared expert's)."""

    def __init__(self, hidden: int, ffn: int, moe: MoEShape, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.moe = moe
        self.router = nn.Linear(hidden, moe.experts, bias=False)
        self.experts = Experts(moe.experts, hidden, ffn)
        self.shared = shared
        self.dispatch: Dispatcher = local_dispatch  # expert parallelism installs its all-to-all
        self.aux_loss: torch.Tensor | None = None  # the last training forward's weighted loss (with its graph)
        self.assigned: torch.Tensor | None = None  # and its assignments per expert, counted when collected
        # the log rows' statistics since expert_load last read them (detached: no sync on the hot path)
        self.load: torch.Tensor | None = None
        self.aux_window: torch.Tensor | None = None
        self.forwards = 0
        self.load_total: torch.Tensor | None = None  # all ranks' assignments per expert, summed over the log rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)
        routing = self.route(probs)
        assigned = routing.assigned
        out = self.dispatch(flat[routing.token], routing.counts, self.experts)
        # in the experts' dtype (bf16 under autocast, while the residual stream stays fp32)
        y = flat.new_zeros(flat.shape, dtype=out.dtype).index_add(0, routing.token,
                                                                   out * routing.weight.unsqueeze(1).to(out.dtype))
        if self.shared is not None:
            y = y + self.shared(flat)
        if self.training and torch.is_grad_enabled():
            # counted by collect_aux_loss, once per model forward: activation checkpointing reruns this
            # forward in backward, which must neither count twice nor leave an aux loss an eval would return
            self.aux_loss = self.moe.aux_loss_coef * balance_loss(probs, assigned, self.moe.top_k)
            self.assigned = assigned
        return y.view_as(x)

    def route(self, probs: torch.Tensor) -> Routing:
        """Top-k per token, grouped by expert (first choices first, then in token order), capacity applied."""
        n, k = probs.shape[0], self.moe.top_k
        top_w, top_e = probs.topk(k, dim=-1)
        if k > 1:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        expert, weight = top_e.t().reshape(-1), top_w.t().reshape(-1)  # choice-major: first choices first
        token = torch.arange(n, device=probs.device).repeat(k)
        order = torch.sort(expert, stable=True).indices
        expert, weight, token = expert[order], weight[order], token[order]
        counts = torch.zeros(self.moe.experts, dtype=torch.long, device=probs.device)
        counts = counts.scatter_add(0, expert, torch.ones_like(expert))
        capacity, assigned = self.moe.capacity(n), counts
        if capacity is not None and probs.device.type != "meta":
            starts = torch.cumsum(counts, 0) - counts
            keep = torch.arange(expert.shape[0], device=probs.device) - starts[expert] < capacity
            weight, token, counts = weight[keep], token[keep], counts.clamp(max=capacity)
        return Routing(token=token, weight=weight, counts=counts, assigned=assigned)

    @torch.no_grad()
    def count(self, counts: torch.Tensor, aux: torch.Tensor) -> None:
        self.load = counts.clone() if self.load is None else self.load + counts
        self.aux_window = aux.detach() if self.aux_window is None else self.aux_window + aux.detach()
        self.forwards += 1


def balance_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer's ``E * sum_e f_e * P_e``: 1 when the load is even, up to E when all goes to one
    expert. ``f_e`` counts the routed assignments before capacity drops (what the router asked for)."""
    experts = probs.shape[-1]
    share = counts.to(probs.dtype) / max(probs.shape[0] * top_k, 1)
    return experts * (share * probs.mean(dim=0)).sum()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@dataclass(frozen=True)
class ExpertPlan:
    """How expert parallelism splits a model (applied by :mod:`hpctrain.parallel.expert`): its
    mixture-of-experts ``layers``, each with experts stacked on dim 0 (:class:`Experts`) and a
    ``dispatch`` slot for the all-to-all."""

    layers: tuple[MoE, ...]


def moe_expert_plan(model: nn.Module) -> ExpertPlan | None:
    """The plan of a model built with :class:`MoE` layers (llama's family); None without any."""
    layers = moe_layers(model)
    return ExpertPlan(tuple(layers)) if layers else None


def collect_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the layers' auxiliary losses of the training forward just run (taken: each is read
    and counted for the log once); the model calls it after its blocks, in training only."""
    losses = []
    for layer in moe_layers(model):
        if layer.aux_loss is not None and layer.assigned is not None:
            losses.append(layer.aux_loss)
            layer.count(layer.assigned, layer.aux_loss)
            layer.aux_loss, layer.assigned = None, None
    return torch.stack(losses).sum() if losses else None


def aux_loss_of(output: Any) -> torch.Tensor | None:
    """The ``aux_loss`` a model's output carries (a mapping's), else None: what the task adds to its loss."""
    aux = output.get("aux_loss") if isinstance(output, Mapping) else None
    return aux if isinstance(aux, torch.Tensor) else None


def with_aux_loss(loss: torch.Tensor, output: Any) -> torch.Tensor:
    """``loss`` + the output's auxiliary loss (a mixture of experts' load balancing), if any."""
    aux = aux_loss_of(output)
    return loss if aux is None else loss + aux.to(loss.dtype)


def take_load(model: nn.Module) -> torch.Tensor | None:
    """This rank's ``[aux loss summed over layers and forwards, forwards, assignments per expert
    (summed over layers)...]`` since the last call (float64, reset); None without experts."""
    layers = moe_layers(model)
    if not layers:
        return None
    out = torch.zeros(2 + layers[0].moe.experts, dtype=torch.float64)
    out[1] = layers[0].forwards
    for layer in layers:
        if layer.load is not None:
            out[2:] += layer.load.to("cpu", torch.float64)
        if layer.aux_window is not None:
            out[0] += float(layer.aux_window)
        layer.load, layer.aux_window, layer.forwards = None, None, 0
    return out


def expert_load(model: nn.Module, world_size: int = 1) -> dict[str, Any]:
    """A log row's MoE columns since the last row, over all ranks (one all-reduce when
    ``world_size > 1``, so every rank must call it): ``moe_aux_loss`` (the weighted aux loss
    added to the loss, mean per micro-step and rank), ``expert_tokens`` (assignments each expert
    computed or dropped, all layers and ranks) and ``expert_imbalance`` (busiest / mean). {} without experts."""
    window = take_load(model)
    if window is None:
        return {}
    if world_size > 1:
        import torch.distributed as dist  # torch: only a distributed run reduces

        on_device = window.to(collective_device())  # NCCL reduces only tensors on the rank's GPU
        dist.all_reduce(on_device)
        window = on_device.cpu()
    totals = moe_layers(model)[0]
    totals.load_total = window[2:] if totals.load_total is None else totals.load_total + window[2:]
    aux = float(window[0] / window[1]) if window[1] else math.nan
    return {"moe_aux_loss": aux, **_load_columns(window[2:])}


def expert_summary(model: nn.Module) -> dict[str, Any]:
    """summary.json's MoE fields: the run's tokens per expert as of the last log row; {} without experts."""
    layers = moe_layers(model)
    if not layers or layers[0].load_total is None:
        return {}
    return _load_columns(layers[0].load_total)


def _load_columns(load: torch.Tensor) -> dict[str, Any]:
    mean = float(load.mean())
    return {"expert_tokens": [int(c) for c in load.tolist()],
            "expert_imbalance": float(load.max()) / mean if mean else math.nan}
