"""Tensor parallelism with DTensor's ``parallelize_module`` (Megatron-style plans), applying the
model family's :class:`~hpctrain.models.family.TensorPlan` (which modules of a block split by
columns or rows, the vocabulary-parallel ends, the heads tp must divide): this module names no
model.

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

from hpctrain.config.parallel import SHARDED
from hpctrain.core.section import ConfigError
from hpctrain.models.family import BLOCK_LAYERS, TensorPlan, family_of
from hpctrain.models.registry import build_model
from hpctrain.models.user import CAUSAL_LM
from hpctrain.parallel.meta import meta_structure

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.core.topology import Topology


def block_plan(block: nn.Module, plan: TensorPlan | None = None, *,
               sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The styles for one block, found by the family's module-name patterns (default: the
    ``blocks`` layout's q, k, v, gate, up / o, down and its norm types)."""
    plan = plan or _BLOCKS_PLAN
    styles: dict[str, ParallelStyle] = {}
    row_output = Shard(1) if sequence_parallel else Replicate()
    for name, module in block.named_modules():
        style = plan.style(name, module) if name else None
        if style == "colwise":
            styles[name] = ColwiseParallel()
            if sequence_parallel:
                styles[_parent(name)] = _gather_sequence()
        elif style == "rowwise":
            # under sequence parallel the residual stream stays a DTensor, so keep o/down's output one
            styles[name] = RowwiseParallel(output_layouts=row_output, use_local_output=not sequence_parallel)
        elif sequence_parallel and style == "sequence_parallel":
            styles[name] = SequenceParallel()
    if not any(isinstance(style, ColwiseParallel) for style in styles.values()):
        names = "/".join(plan.column_names)
        raise ValueError(f"tensor parallel found no Linear named {names} in {type(block).__name__}; "
                         "hint: name the attention projections q, k, v, o and the MLP's up, down"
                         + ("" if plan is _BLOCKS_PLAN else ", or give the model a family with its own tensor plan "
                            "(model.family, docs/models.md)"))
    return styles


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _gather_sequence() -> ParallelStyle:
    # attention/MLP see the whole sequence: all-gather the sequence-sharded input once.
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def model_plan(model: nn.Module) -> tuple[TensorPlan, nn.ModuleList]:
    """The tensor plan of ``model``'s family and the blocks it splits; a ValueError names what is missing."""
    family = family_of(model)
    plan = family.tensor_plan_of(model)
    blocks = _submodule(model, plan.blocks) if plan is not None else None
    if plan is None or not isinstance(blocks, nn.ModuleList):
        where = f"`{plan.blocks}`" if plan is not None else "`blocks`"
        raise ValueError(f"tensor parallel needs the model's transformer blocks as {where} (an nn.ModuleList); "
                         f"{type(model).__name__} has none")
    return plan, blocks


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def apply_tp(model: nn.Module, *, mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Parallelize every block of ``model`` over the 1D ``mesh`` (the ``tp`` dim) by its family's plan.
    A model the plan cannot split is a ConfigError (exit 2), on every rank alike: a factory that
    loads weights is checked here, on rank 0's structure, not before start (it has no meta build)."""
    try:
        check_tp_model(model, mesh.size())
    except ValueError as err:
        raise ConfigError(f"parallel.tp={mesh.size()} cannot split {type(model).__name__}: {err}; hint: "
                          f"{_hint(str(err))}") from err
    plan, blocks = model_plan(model)
    if sequence_parallel:
        _check_sequence_styles(model)
    for block in blocks:
        parallelize_module(block, mesh, block_plan(block, plan, sequence_parallel=sequence_parallel))
        _localize_heads(block, plan, mesh.size())
    if sequence_parallel:
        _shard_sequence_edges(blocks, mesh)
    if plan.ends:
        _shard_vocabulary(model, plan, mesh)
    return model


def _has_sequence_styles(plan: TensorPlan) -> bool:
    return bool(plan.norms) or "sequence_parallel" in plan.layers.values()


def _check_sequence_styles(model: nn.Module) -> None:
    if not _has_sequence_styles(model_plan(model)[0]):
        raise ValueError(f"parallel.sequence_parallel: the tensor plan of {type(model).__name__} names no norm "
                         "to run on a sequence shard")


def _localize_heads(block: nn.Module, plan: TensorPlan, tp: int) -> None:
    """Head counts a module reshapes by (``plan.divide``) become this rank's: heads / tp."""
    for module in block.modules():
        for attr in plan.divide:
            count = getattr(module, attr, None)
            if isinstance(count, int):
                setattr(module, attr, count // tp)


def _ends(model: nn.Module, plan: TensorPlan, style: str) -> tuple[str, nn.Module] | None:
    for path, kind in plan.ends.items():
        module = _submodule(model, path) if kind == style else None
        if module is not None:
            return path, module
    return None


def _shard_vocabulary(model: nn.Module, plan: TensorPlan, mesh: DeviceMesh) -> None:
    """Megatron's vocabulary-parallel ends (the llama's plan): each rank holds V/tp rows of the
    token embedding (it looks up its own rows; the partial sums are all-reduced) and of the
    output projection (its slice of the logits, all-gathered), so tp divides every large matrix,
    as ``hpctrain estimate --tp`` assumes. A pipeline stage may hold neither end (None). Tied
    weights: both ends shard the (V, h) matrix by rows, so the head takes the embedding's again."""
    emb, head = _ends(model, plan, "embedding"), _ends(model, plan, "head")
    tied = emb is not None and head is not None and head[1].weight is emb[1].weight
    styles: dict[str, ParallelStyle] = {}
    if emb is not None:
        styles[emb[0]] = RowwiseParallel(input_layouts=Replicate())
    if head is not None:
        styles[head[0]] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, styles)
    if emb is not None:
        # the all-reduced rows come back as a not-yet-waited collective, a wrapper without storage
        # of its own, which the first block would save for backward: a copy (any non-view op)
        # waits and gives a plain tensor inside autograd's graph (.wait() would leave the graph)
        emb[1].register_forward_hook(lambda _m, _i, out: out.clone() if isinstance(out, AsyncCollectiveTensor) else out)
    if tied and emb is not None and head is not None:  # each got its own sharded Parameter: share one again
        head[1].weight = emb[1].weight


def _shard_sequence_edges(blocks: nn.ModuleList, mesh: DeviceMesh) -> None:
    """Enter sequence sharding at the first block, leave it (gather) before the final norm/head."""
    first = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
    parallelize_module(blocks[0], mesh, first)
    last = blocks[len(blocks) - 1]
    # use_local_output: the rest of the model (final norm, head, loss) sees a plain full tensor.
    last.register_forward_hook(lambda _m, _i, out: out.redistribute(placements=[Replicate()]).to_local())


def check_tp_model(model: nn.Module, tp: int) -> None:
    """Can :func:`apply_tp` split ``model`` (built on meta: no memory) over ``tp`` ranks? A
    ValueError names what is missing or indivisible, before any rank starts."""
    plan, blocks = model_plan(model)
    if len(blocks) == 0:
        raise ValueError(f"tensor parallel needs the model's transformer blocks as `{plan.blocks}` (an "
                         f"nn.ModuleList); {type(model).__name__} has none")
    for index, block in enumerate(blocks):
        block_plan(block, plan)  # finds the column-split projections, or says which names it looked for
        for name, module in block.named_modules():
            _check_divisible(f"{plan.blocks}.{index}.{name}", name, module, plan, tp)
    emb = _ends(model, plan, "embedding")
    if emb is not None and isinstance(emb[1], nn.Embedding) and emb[1].num_embeddings % tp:
        raise ValueError(f"the vocabulary ({emb[1].num_embeddings} tokens, model.vocab) is not divisible by tp={tp} "
                         "(the embedding and output are split by vocabulary rows)")


def _check_divisible(where: str, name: str, module: nn.Module, plan: TensorPlan, tp: int) -> None:
    style = plan.style(name, module) if name else None
    if isinstance(module, nn.Linear) and style in ("colwise", "rowwise"):
        width = module.out_features if style == "colwise" else module.in_features
        if width % tp:
            raise ValueError(f"{where} has {width} {'output' if style == 'colwise' else 'input'} features, "
                             f"not divisible by tp={tp}")
    head_dim = getattr(module, "head_dim", None)
    for proj, what in plan.heads:
        linear = _head_projection(module, proj)
        if isinstance(head_dim, int) and isinstance(linear, nn.Linear) and (linear.out_features // head_dim) % tp:
            raise ValueError(f"{where} has {linear.out_features // head_dim} {what}, not divisible by tp={tp} "
                             "(each rank computes whole heads)")


def _head_projection(module: nn.Module, pattern: str) -> nn.Module | None:
    """The child of ``module`` named by the last part of ``pattern`` (the parent holds ``head_dim``)."""
    return getattr(module, pattern.rsplit(".", 1)[-1], None)


_BLOCKS_PLAN = TensorPlan(blocks="blocks", layers=BLOCK_LAYERS, norms=(nn.LayerNorm, nn.RMSNorm))
# the `blocks` layout's names (the planner's count of split weights): split outputs, split inputs
COLUMN = tuple(name for name, style in _BLOCKS_PLAN.layers.items() if style == "colwise")
ROW = tuple(name for name, style in _BLOCKS_PLAN.layers.items() if style == "rowwise")


def check_tensor_parallel(cfg: Config, topology: Topology) -> None:
    """parallel.tp > 1 splits the blocks of a model whose family has a tensor plan (gpt, llama, Hugging
    Face Llama/Mistral/Qwen2, a ``blocks`` layout): any other model, or widths tp does not divide,
    fails here, before the process group. The model is built on meta (no memory)."""
    p, name = cfg.parallel, cfg.model.name
    if cfg.precision == "fp16" and (topology.dp == 1 or p.strategy not in SHARDED):
        # without FSDP over dp the embedding, norms and head stay plain tensors beside the DTensor
        # blocks, and the fp16 scaler's unscale cannot take both in one call
        raise ConfigError(f"precision=fp16 with parallel.tp={p.tp} needs data parallelism under "
                          f"parallel.strategy=fsdp or hsdp (got dp={topology.dp}, strategy={p.strategy}); hint: "
                          "precision=bf16 (no loss scaling needed), or more ranks with parallel.strategy=fsdp")
    if cfg.train.compile and p.activation_checkpointing != "none":
        # torch 2.13's compiled activation checkpointing saves the DTensors' DeviceMesh for its
        # version check and fails in the first backward (found running tp2 + block + compile)
        raise ConfigError(f"parallel.tp={p.tp} with train.compile=true and parallel.activation_checkpointing="
                          f"{p.activation_checkpointing} fails inside torch.compile (DTensor in a checkpointed "
                          "region); hint: parallel.activation_checkpointing=none, or train.compile=false")
    # a user's model is built as a causal LM (a factory may need vocab_size), with placeholder sizes;
    # one that loads weights has no meta structure: apply_tp checks rank 0's after start
    task = CAUSAL_LM if ":" in name else None
    model = meta_structure(lambda: build_model(name, cfg.model.num_classes or None, config=cfg.model, task=task))
    if model is None:
        return
    try:
        check_tp_model(model, p.tp)
        if p.sequence_parallel:
            _check_sequence_styles(model)
    except ValueError as err:
        raise ConfigError(f"parallel.tp={p.tp} cannot split model.name={name}: {err}; hint: {_hint(str(err))}") from err


def _hint(err: str) -> str:
    return ("a parallel.tp that divides that count (every rank computes whole heads and equal slices)"
            if "not divisible" in err else
            "parallel.sequence_parallel=false" if "sequence_parallel" in err else
            "tensor parallelism runs on the models of a family with a tensor plan: gpt, llama, Hugging Face "
            "Llama/Mistral/Qwen2, a model with such `blocks`, or your own (model.family, see docs/models.md); "
            "for other models use parallel.tp=1 with parallel.strategy=fsdp")
