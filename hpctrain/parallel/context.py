"""Context parallel, ``parallel.cp=N``: the ranks of a cp group share each sequence.

Every rank of a cp group reads the same batch (:meth:`hpctrain.core.topology.Topology.dp_rank`).
Each window of T tokens is cut into 2N chunks and rank r computes chunks r and 2N-1-r (the
causal mask makes late chunks dearer: a head chunk plus a tail chunk gives every rank the same
work, Llama 3's and torch's load balance). The model (its family's ``context_parallel`` plan:
``gpt`` and ``llama`` through :mod:`hpctrain.models.attention`, the Hugging Face Llama family
through :mod:`hpctrain.models.hf_llama`) then computes only those tokens, with their global
positions, and each attention layer all-gathers the keys and values of the group
(``torch.distributed._functional_collectives``, differentiable: backward reduce-scatters their
gradients) and masks by global token index. Activations per rank fall as 1/N except the
gathered keys and values, which are whole for the length of one layer's attention.

On CUDA with NCCL a training micro-step instead runs inside torch's
``torch.distributed.tensor.experimental.context_parallel`` (ring attention: the keys and values
pass around the ring, never whole), which shards with the same head-tail layout; packed
documents (a mask torch's ring SDPA does not take) and evaluation use the all-gather path there
too. (torch's ring attention has no CPU kernel: ``aten._scaled_dot_product_flash_attention_for_cpu``
has no sharding strategy.)

What stays exact: the loss (:class:`ContextLoss`: each rank's loss sum, over the token count
summed over the group, so the gradients averaged over dp x cp are one process's), the token
counts (the meter counts the replica's whole batch), validation (in eval mode the model's
logits are gathered back into sequence order: every metric sees whole windows). Gradients of the
replicated weights are averaged over the dp x cp ranks (DDP over them; FSDP shards over the
flattened ``dp_cp`` mesh dim, as torchtitan). Nothing of the model's state is split by cp, so a
checkpoint resumes at any cp size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from hpctrain.config.parallel import SHARDED
from hpctrain.core.section import ConfigError
from hpctrain.data.batch import main_input
from hpctrain.models.family import family_of
from hpctrain.models.outputs import logits_of
from hpctrain.models.registry import build_model
from hpctrain.models.user import CAUSAL_LM
from hpctrain.parallel.meta import meta_structure
from hpctrain.tasks.inputs import IGNORE_INDEX

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.core.topology import Topology

LossFn = Callable[[Any, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def chunk_indices(length: int, size: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The token indices rank ``rank`` of ``size`` computes of a window of ``length``: chunk
    ``rank`` and chunk ``2 size - 1 - rank`` of ``2 size`` equal chunks."""
    chunk = length // (2 * size)
    head, tail = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat((torch.arange(head, head + chunk, device=device), torch.arange(tail, tail + chunk, device=device)))


class ContextSplit:
    """A :class:`hpctrain.models.attention.SequenceSplit` over the ranks of a process group."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.ring = False  # True only inside ContextParallel.step on CUDA: torch's ring attention
        self._cache: dict[tuple[Any, ...], Any] = {}  # per (length, device[, dtype]): the same every step

    def __deepcopy__(self, memo: dict[int, Any]) -> ContextSplit:
        return self  # process groups do not copy; a model copy (a FLOP count's) shares the split

    def indices(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("indices", length, str(device))
        if key not in self._cache:
            parts = [chunk_indices(length, self.size, r, device) for r in range(self.size)]
            self._cache[key] = (parts[self.rank], torch.cat(parts))
        found: tuple[torch.Tensor, torch.Tensor] = self._cache[key]
        return found

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunks of a full-length ``x`` (its sequence along ``dim``)."""
        return x.index_select(dim, self.indices(x.shape[dim], x.device)[0])

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return funcol.all_gather_single_autograd(x.contiguous(), gather_dim=dim, group=self.group)

    def unsplit(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's chunks of ``x`` back in sequence order (evaluation's logits)."""
        gathered = self.gather(x, dim)
        order = self.indices(gathered.shape[dim], x.device)[1]
        return gathered.index_select(dim, torch.argsort(order))

    def causal_mask(self, length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = ("mask", length, str(device), dtype)
        if key not in self._cache:
            mine, gathered = self.indices(length, device)
            blocked = gathered[None, :] > mine[:, None]
            self._cache[key] = torch.zeros(blocked.shape, dtype=dtype, device=device).masked_fill_(
                blocked, float("-inf"))[None, None]
        mask: torch.Tensor = self._cache[key]
        return mask


class ContextLoss:
    """The strategy's loss under context parallel: the task's mean loss over this rank's target
    tokens, turned into this rank's share of the cp group's mean: ``sum_r * cp / tokens`` with
    ``tokens`` summed over the group (one all-reduce of a count). Averaging the gradients over
    the dp x cp ranks then gives one process's; the value, averaged over the ranks as the loop
    logs it, is the global mean loss. (A rank whose chunks hold no counted target adds 0.)"""

    def __init__(self, loss_fn: LossFn, split: ContextSplit) -> None:
        self.loss_fn, self.split = loss_fn, split

    def __call__(self, output: Any, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        targets = self.split.local(targets, 1)
        counted = targets != IGNORE_INDEX
        if mask is not None:
            counted = counted & mask.bool().view(-1, 1)
        tokens = counted.sum()
        total = funcol.all_reduce(tokens.detach(), "sum", self.split.group)
        mean = self.loss_fn(output, targets, mask)
        share = torch.where(tokens > 0, mean * tokens, torch.zeros_like(mean))  # no 0/0 where nothing counts
        return share * self.split.size / total.clamp_min(1)


def _gather_logits(split: ContextSplit) -> Callable[[nn.Module, Any, Any], Any]:
    def hook(module: nn.Module, _args: Any, output: Any) -> Any:
        if module.training:
            return None  # training's loss takes this rank's chunks (ContextLoss)
        logits = logits_of(output)
        if logits.device.type == "meta":
            return None
        whole = split.unsplit(logits, 1)
        if isinstance(output, torch.Tensor):
            return whole
        if isinstance(output, dict):
            return {**output, "logits": whole}
        output["logits"] = whole  # a ModelOutput (Hugging Face) takes item assignment
        return output
    return hook


class ContextParallel:
    """The cp machinery of one run: the split, applied to the model by its family's plan, the
    loss, and (CUDA with NCCL) torch's ring attention around a micro-step."""

    def __init__(self, mesh: DeviceMesh, device: torch.device) -> None:
        self.mesh = mesh
        self.split = ContextSplit(mesh.get_group(), mesh.get_local_rank(), mesh.size())
        # torch's context_parallel: ring attention's kernels shard only CUDA's SDPA
        self.ring = device.type == "cuda" and dist.get_backend(self.split.group) == "nccl"

    def apply(self, model: nn.Module) -> nn.Module:
        """The model computes its share of each sequence; in eval mode it returns whole logits."""
        plan = family_of(model).context_parallel
        if plan is None:  # a factory that loads weights is checked here, after start (no meta build before)
            raise ConfigError(_no_plan(f"parallel.cp={self.split.size}", type(model).__name__, family_of(model).name))
        plan(model, self.split)
        model.register_forward_hook(_gather_logits(self.split))
        return model

    def loss(self, loss_fn: LossFn) -> LossFn:
        return ContextLoss(loss_fn, self.split)

    @contextlib.contextmanager
    def step(self, inputs: Any) -> Iterator[None]:
        """Around a training micro-step's forward and backward: torch's ring attention on CUDA
        (with NCCL, without packed documents); nothing elsewhere."""
        if not self.ring or (isinstance(inputs, dict) and "doc_ids" in inputs):
            yield
            return
        # written against torch 2.13's API; untested here (no GPU). Import deferred: CUDA runs only.
        from torch.distributed.tensor.experimental import context_parallel

        tokens = main_input(inputs)
        # context_parallel shards the buffers it is given in place; ours are sharded by the model
        # (the same head-tail layout), so it gets a throw-away one of the window's length
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        with context_parallel(self.mesh, buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions}):
            self.split.ring = True
            try:
                yield
            finally:
                self.split.ring = False


def context_parallel_of(mesh: DeviceMesh | None, topology: Topology, device: torch.device) -> ContextParallel | None:
    """The run's :class:`ContextParallel` when ``parallel.cp > 1`` (on the mesh's ``cp`` dim), else None."""
    if topology.cp == 1 or mesh is None:
        return None
    return ContextParallel(mesh["cp"], device)


def check_context_parallel(cfg: Config, topology: Topology) -> None:
    """What ``parallel.cp > 1`` cannot run, as a ConfigError (exit 2) before the process group."""
    p, cp = cfg.parallel, topology.cp
    refusals = (
        (cfg.train.task not in ("auto", "causal_lm"), f"train.task={cfg.train.task}", "train.task=causal_lm"),
        (cfg.train.loss is not None, f"train.loss={cfg.train.loss}", "the causal-LM task's own loss"),
        (cfg.model.use_model_loss, "model.use_model_loss=true", "model.use_model_loss=false (the task's loss)"),
        (p.strategy not in ("ddp", "zero1", *SHARDED), f"parallel.strategy={p.strategy}",
         "parallel.strategy=fsdp (or ddp)"),
        (topology.tp > 1 and p.strategy not in SHARDED, f"parallel.tp={p.tp} with strategy={p.strategy}",
         "parallel.strategy=fsdp"),
        (p.sequence_parallel, "parallel.sequence_parallel=true", "parallel.sequence_parallel=false"),
        (topology.ep > 1, f"parallel.ep={topology.ep}", "parallel.ep=1"),
    )
    for refused, what, hint in refusals:
        if refused:
            raise ConfigError(f"parallel.cp={cp} does not combine with {what}; hint: {hint}")
    if cfg.model.seq_len % (2 * cp):
        raise ConfigError(f"parallel.cp={cp} splits each sequence into 2 x {cp} equal chunks: model.seq_len "
                          f"({cfg.model.seq_len}) is not a multiple of {2 * cp}; hint: model.seq_len="
                          f"{(cfg.model.seq_len // (2 * cp) + 1) * 2 * cp}")
    _check_family(cfg, cp)


def _check_family(cfg: Config, cp: int) -> None:
    """The model's family must have a context-parallel plan (built on meta: no memory; a factory that
    loads weights has no meta build: :meth:`ContextParallel.apply` checks rank 0's structure after start)."""
    name = cfg.model.name
    task = CAUSAL_LM if ":" in name else None
    model = meta_structure(lambda: build_model(name, cfg.model.num_classes or None, config=cfg.model, task=task))
    family = family_of(model) if model is not None else None
    if family is not None and family.context_parallel is None:
        raise ConfigError(_no_plan(f"parallel.cp={cp}", f"model.name={name}", family.name))


def _no_plan(what: str, model: str, family: str) -> str:
    return (f"{what} cannot split {model} (model family {family!r} has no context-parallel plan); hint: gpt, "
            "llama or a Hugging Face Llama/Mistral/Qwen2, or parallel.cp=1")
