"""Tensor parallelism with DTensor's ``parallelize_module`` (Megatron-style plans).

In every transformer block, the attention's q, k, v and the MLP's up (and, in a SwiGLU MLP,
gate) projections are split by output columns (each rank computes a slice of the heads / hidden
units), o and down by input rows (their partial results are summed once per sub-layer). The
attention must reshape with ``view(B, T, -1, head_dim)`` so a rank sees its local heads: the
gpt's plan is colwise q/k/v/up, the llama's colwise q/k/v/gate/up, both rowwise o/down. Under
grouped-query attention a rank holds ``heads / tp`` query heads and ``kv_heads / tp`` key/value
heads, so tp must divide both.

Sequence parallel also shards the layer norms and the residual stream along the sequence
(``Shard(1)``): activations outside attention/MLP take 1/tp of the memory, and the two
all-reduces per block become an all-gather plus a reduce-scatter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.parallel.plan import Plan

COLUMN = ("q", "k", "v", "gate", "up")  # split the output features
ROW = ("o", "down")  # split the input features, sum the partial outputs
NORMS = (nn.LayerNorm, nn.RMSNorm)


def block_plan(block: nn.Module, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The plan for one block, found by module names (q, k, v, gate, o, up, down) and norm types."""
    plan: dict[str, ParallelStyle] = {}
    row_output = Shard(1) if sequence_parallel else Replicate()
    for name, module in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in COLUMN:
            plan[name] = ColwiseParallel()
            if sequence_parallel:
                plan[_parent(name)] = _gather_sequence()
        elif isinstance(module, nn.Linear) and leaf in ROW:
            # under sequence parallel the residual stream stays a DTensor, so keep o/down's output one
            plan[name] = RowwiseParallel(output_layouts=row_output, use_local_output=not sequence_parallel)
        elif sequence_parallel and isinstance(module, NORMS):
            plan[name] = SequenceParallel()
    if not any(isinstance(style, ColwiseParallel) for style in plan.values()):
        raise ValueError(f"tensor parallel found no Linear named {'/'.join(COLUMN)} in {type(block).__name__}; "
                         "hint: name the attention projections q, k, v, o and the MLP's up, down")
    return plan


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _gather_sequence() -> ParallelStyle:
    # attention/MLP see the whole sequence: all-gather the sequence-sharded input once.
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def apply_tp(model: nn.Module, *, mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Parallelize every block of ``model.blocks`` over the 1D ``mesh`` (the ``tp`` dim)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"tensor parallel needs the model's transformer blocks as `blocks` (an nn.ModuleList); "
                         f"{type(model).__name__} has none")
    for block in blocks:
        parallelize_module(block, mesh, block_plan(block, sequence_parallel=sequence_parallel))
    if sequence_parallel:
        _shard_sequence_edges(model, blocks, mesh)
    if getattr(model, "vocab_parallel", False):
        _shard_vocabulary(model, mesh)
    return model


def _shard_vocabulary(model: nn.Module, mesh: DeviceMesh) -> None:
    """Megatron's vocabulary-parallel ends (the llama's plan): each rank holds V/tp rows of the
    token embedding (it looks up its own rows; the partial sums are all-reduced) and of the
    output projection (its slice of the logits, all-gathered), so tp divides every large matrix,
    as ``hpctrain estimate --tp`` assumes. A pipeline stage may hold neither end (None). Tied
    weights: both ends shard the (V, h) matrix by rows, so the head takes the embedding's again."""
    emb, head = getattr(model, "tok_emb", None), getattr(model, "head", None)
    tied = emb is not None and head is not None and head.weight is emb.weight
    plan: dict[str, ParallelStyle] = {}
    if emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
    if head is not None:
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, plan)
    if emb is not None:
        # the all-reduced rows come back as a not-yet-waited collective, a wrapper without storage
        # of its own, which the first block would save for backward: a copy (any non-view op)
        # waits and gives a plain tensor inside autograd's graph (.wait() would leave the graph)
        emb.register_forward_hook(lambda _m, _i, out: out.clone() if isinstance(out, AsyncCollectiveTensor) else out)
    if tied and emb is not None and head is not None:  # each got its own sharded Parameter: share one again
        head.weight = emb.weight


def _shard_sequence_edges(model: nn.Module, blocks: nn.ModuleList, mesh: DeviceMesh) -> None:
    """Enter sequence sharding at the first block, leave it (gather) before the final norm/head."""
    first = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
    parallelize_module(blocks[0], mesh, first)
    last = blocks[len(blocks) - 1]
    # use_local_output: the rest of the model (final norm, head, loss) sees a plain full tensor.
    last.register_forward_hook(lambda _m, _i, out: out.redistribute(placements=[Replicate()]).to_local())



def check_tp_model(model: nn.Module, tp: int) -> None:
    """Can :func:`apply_tp` split ``model`` (built on meta: no memory) over ``tp`` ranks? A
    ValueError names what is missing or indivisible, before any rank starts."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"tensor parallel needs the model's transformer blocks as `blocks` (an nn.ModuleList); "
                         f"{type(model).__name__} has none")
    for index, block in enumerate(blocks):
        block_plan(block)  # finds the q/k/v/up columns, or says which names it looked for
        for name, module in block.named_modules():
            _check_divisible(f"blocks.{index}.{name}", module, tp)
    emb = getattr(model, "tok_emb", None)
    if getattr(model, "vocab_parallel", False) and isinstance(emb, nn.Embedding) and emb.num_embeddings % tp:
        raise ValueError(f"the vocabulary ({emb.num_embeddings} tokens, model.vocab) is not divisible by tp={tp} "
                         "(the embedding and output are split by vocabulary rows)")


def _check_divisible(name: str, module: nn.Module, tp: int) -> None:
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, nn.Linear) and leaf in COLUMN + ROW:
        width = module.out_features if leaf in COLUMN else module.in_features
        if width % tp:
            raise ValueError(f"{name} has {width} {'output' if leaf in COLUMN else 'input'} features, "
                             f"not divisible by tp={tp}")
    head_dim = getattr(module, "head_dim", None)
    for proj, what in (("q", "heads"), ("k", "key/value heads (model.kv_heads)")):
        linear = getattr(module, proj, None)
        if isinstance(head_dim, int) and isinstance(linear, nn.Linear) and (linear.out_features // head_dim) % tp:
            raise ValueError(f"{name} has {linear.out_features // head_dim} {what}, not divisible by tp={tp} "
                             "(each rank computes whole heads)")


def check_tensor_parallel(cfg: Config, plan: Plan) -> None:
    """parallel.tp > 1 splits the q/k/v/gate/o/up/down Linears of the model's ``blocks`` (gpt, llama):
    any other model, or widths tp does not divide, fails here, before the process group. The
    model is built on meta (no memory)."""
    from hpctrain.config.parallel import SHARDED
    from hpctrain.core.section import ConfigError
    from hpctrain.models import build_model
    from hpctrain.parallel.meta import on_meta

    p, name = cfg.parallel, cfg.model.name
    if cfg.precision == "fp16" and (plan.dp == 1 or p.strategy not in SHARDED):
        # without FSDP over dp the embedding, norms and head stay plain tensors beside the DTensor
        # blocks, and the fp16 scaler's unscale cannot take both in one call
        raise ConfigError(f"precision=fp16 with parallel.tp={p.tp} needs data parallelism under "
                          f"parallel.strategy=fsdp or hsdp (got dp={plan.dp}, strategy={p.strategy}); hint: "
                          "precision=bf16 (no loss scaling needed), or more ranks with parallel.strategy=fsdp")
    if cfg.train.compile and p.activation_checkpointing != "none":
        # torch 2.13's compiled activation checkpointing saves the DTensors' DeviceMesh for its
        # version check and fails in the first backward (found running tp2 + block + compile)
        raise ConfigError(f"parallel.tp={p.tp} with train.compile=true and parallel.activation_checkpointing="
                          f"{p.activation_checkpointing} fails inside torch.compile (DTensor in a checkpointed "
                          "region); hint: parallel.activation_checkpointing=none, or train.compile=false")
    model = on_meta(lambda: build_model(name, cfg.model.num_classes or None, config=cfg.model))
    try:
        check_tp_model(model, p.tp)
    except ValueError as err:
        hint = ("a parallel.tp that divides that count (every rank computes whole heads and equal slices)"
                if "not divisible" in str(err) else
                "tensor parallelism runs on the gpt and llama (or a model with such `blocks`, see docs/parallel.md); "
                "for other models use parallel.tp=1 with parallel.strategy=fsdp")
        raise ConfigError(f"parallel.tp={p.tp} cannot split model.name={name}: {err}; hint: {hint}") from err
