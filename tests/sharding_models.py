"""A toy GPT for the parallel-strategy tests, with the module names hpctrain's GPT uses
(``blocks`` ModuleList; per block ``attn.q/k/v/o`` and ``mlp.up/down`` Linear; attention
reshapes with ``view(B, T, -1, head_dim)`` so tensor parallel can halve the heads).

Pipeline stages drop the parts they do not run by setting them to None (``tok_emb``,
``pos_emb``, ``norm``, ``head``): ``forward`` skips a None part, and a stage after the
first receives hidden states instead of token ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, SEQ = 128, 64, 4, 16


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads)
        self.norm2, self.mlp = nn.LayerNorm(hidden), MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ToyGPT(nn.Module):
    def __init__(self, layers: int = 4, hidden: int = HIDDEN, heads: int = HEADS, vocab: int = VOCAB,
                 seq_len: int = SEQ) -> None:
        super().__init__()
        self.tok_emb: nn.Module | None = nn.Embedding(vocab, hidden)
        self.pos_emb: nn.Module | None = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm: nn.Module | None = nn.LayerNorm(hidden)
        self.head: nn.Module | None = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.tok_emb(x)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x


def toy_gpt(layers: int = 4) -> ToyGPT:
    return ToyGPT(layers=layers)


def real_gpt(layers: int = 4, tie_weights: bool = True) -> nn.Module:
    """hpctrain's own GPT at the toy's sizes."""
    from hpctrain.models.gpt import GPT, GPTShape

    return GPT(GPTShape(vocab=VOCAB, seq_len=SEQ, n_layers=layers, hidden=HIDDEN, heads=HEADS, tie_weights=tie_weights))


def pipelined_gpt(layers: int = 4) -> nn.Module:
    """hpctrain's GPT (untied) with the forward the pipeline contract asks for: skip a part a
    stage dropped (set to None), and take hidden states once the embeddings are gone."""

    return real_gpt(layers, tie_weights=False)  # the GPT's forward skips parts a stage does not hold


MODELS = {"toy": toy_gpt, "gpt": real_gpt, "gpt_untied": lambda layers: real_gpt(layers, False),
          "gpt_pipelined": pipelined_gpt}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def token_batches(steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (inputs, next-token targets), the same on every rank: counting
    sequences (each token is the previous + 1, from a random start), learnable in a few steps."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = (torch.randint(0, VOCAB, (batch, 1), generator=gen) + torch.arange(SEQ + 1)) % VOCAB
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


# ---------------------------------------------------------------- a tiny training run for parity tests

GLOBAL_BATCH = 8


def clean_name(name: str) -> str:
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "module."):
        name = name.replace(wrapper, "")
    return name


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (DTensor shards gathered), by its plain name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[clean_name(name)] = grad.detach().clone()
    return out


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {clean_name(k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def train_toy(env, overrides: dict, steps: int = 10, layers: int = 4, lr: float = 1e-2, clip: float = 0.0,
              model_name: str = "toy", accum: int = 1) -> dict:
    """``steps`` AdamW steps of the toy GPT under ``parallel.*`` = ``overrides``, each data-parallel
    rank on its slice of the same global batch. Returns the global losses, the step-0 gradients
    (whole), the final weights (whole) and this rank's parameter/gradient/optimizer bytes."""
    import contextlib

    import torch.distributed as dist

    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel import mesh_for, strategy_for
    from hpctrain.telemetry.footprint import state_bytes

    cfg = ParallelConfig(**overrides)
    mesh = mesh_for(env, cfg)[1] if env.distributed else None
    dp_rank, dp = (mesh["dp"].get_local_rank(), mesh["dp"].size()) if mesh is not None else (0, 1)
    strategy = strategy_for(cfg, env, torch.device("cpu"), seed=0, mesh=mesh)  # the strategy object's own parts
    model = strategy.model = strategy.build_model(lambda: MODELS[model_name](layers))
    optimizer = strategy.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=lr))  # zero1: ZeRO-1
    losses, grads0, norms = [], None, []
    per_rank = GLOBAL_BATCH // dp
    for step, (inputs, targets) in enumerate(token_batches(steps, GLOBAL_BATCH)):
        loss = torch.zeros(())
        for micro in range(accum):  # inner micro-steps skip the gradient reduction (hpctrain's no_sync)
            size = per_rank // accum
            part = slice(dp_rank * per_rank + micro * size, dp_rank * per_rank + (micro + 1) * size)
            with strategy.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                micro_loss = lm_loss(model(inputs[part]), targets[part]) / accum
                micro_loss.backward()
            loss += micro_loss.detach()
        if step == 0:
            grads0 = full_grads(model)
        if clip:
            from hpctrain.parallel.clip import clip_grad_norm_

            norms.append(float(clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        global_loss = loss.detach().clone()
        if env.distributed:
            dist.all_reduce(global_loss)
            global_loss /= env.world_size
        losses.append(float(global_loss))
    return {"losses": losses, "grads0": grads0, "weights": full_state(model), "norms": norms,
            "bytes": state_bytes(model, optimizer)}


def train_pp(env, overrides: dict, steps: int = 10, grad_accum: int = 1, layers: int = 4, lr: float = 1e-2,
             model_name: str = "toy") -> dict:
    """The toy GPT through a pipeline step function (with dp x tp around it when asked): global
    losses, and this rank's step-0 gradients (whole) under their one-process names."""
    import torch.distributed as dist

    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel import build_pipeline_step, mesh_for
    from hpctrain.parallel.pipeline import local_stage_ids, split_blocks

    cfg = ParallelConfig(**overrides)
    _, mesh = mesh_for(env, cfg)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    torch.manual_seed(0)
    step_fn = build_pipeline_step(MODELS[model_name](layers), env, cfg, device=torch.device("cpu"), loss_fn=lm_loss,
                                  grad_accum=grad_accum, mesh=mesh)
    ids = local_stage_ids(mesh["pp"].get_local_rank(), cfg.pp, cfg.pp_schedule, cfg.virtual_stages)
    ranges = split_blocks(layers, cfg.pp * len(ids))
    optimizer = torch.optim.AdamW(step_fn.parameters(), lr=lr)
    losses, grads0 = [], {}
    for step, (inputs, targets) in enumerate(token_batches(steps, GLOBAL_BATCH)):
        size = GLOBAL_BATCH // dp // grad_accum
        start = dp_rank * GLOBAL_BATCH // dp
        loss = sum(step_fn(inputs[start + i * size:start + (i + 1) * size],
                           targets[start + i * size:start + (i + 1) * size]) for i in range(grad_accum)) / grad_accum
        if step == 0:
            for stage, module in zip(ids, step_fn.modules):
                for name, grad in full_grads(module).items():
                    grads0[_global_block_name(name, ranges[stage])] = grad
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        losses.append(float(loss) / dp)
    return {"losses": losses, "grads0": grads0}


def _global_block_name(name: str, blocks: range) -> str:
    if not name.startswith("blocks."):
        return name
    _, local, rest = name.split(".", 2)
    return f"blocks.{blocks[int(local)]}.{rest}"


def train_deepspeed(env, stage: int, steps: int = 10, layers: int = 4, lr: float = 1e-2) -> dict:
    """The toy GPT through DeepSpeed ZeRO ``stage``: global losses and whole step-0 gradients."""
    import torch.distributed as dist

    from hpctrain.parallel.deepspeed import init_deepspeed

    torch.manual_seed(0)
    model = toy_gpt(layers)
    names = [clean_name(n) for n, _ in model.named_parameters()]
    per_rank = GLOBAL_BATCH // env.world_size
    engine = init_deepspeed(model, torch.optim.AdamW(model.parameters(), lr=lr), env=env, stage=stage,
                            micro_batch=per_rank)
    losses, grads0 = [], {}
    rank = dist.get_rank()
    for step, (inputs, targets) in enumerate(token_batches(steps, GLOBAL_BATCH)):
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = lm_loss(engine(inputs[part]), targets[part])
        engine.backward(loss)
        if step == 0:  # gradients are visible between backward and step only
            grads0 = _deepspeed_grads(engine, names)
        engine.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(float(global_loss) / env.world_size)
    return {"losses": losses, "grads0": grads0}


def train_deepspeed_stages(env, stages: tuple[int, ...]) -> dict[int, dict]:
    """:func:`train_deepspeed` for each stage in turn, in this group of ranks."""
    return {stage: train_deepspeed(env, stage) for stage in stages}


def _deepspeed_grads(engine, names: list[str]) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    return {name: safe_get_full_grad(p).detach().clone() for name, p in zip(names, engine.module.parameters())}


def scaler_step(env, inf_on_rank: int | None) -> dict:
    """One FSDP step with fp16-style loss scaling (ShardedGradScaler); when ``inf_on_rank`` is
    set, that rank's gradient shard holds an inf: every rank must skip the step and halve the scale."""
    from torch.distributed.tensor import DTensor

    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel import build_parallel
    from hpctrain.parallel.fsdp import sharded_grad_scaler

    model = build_parallel(toy_gpt, env, ParallelConfig(strategy="fsdp"), device=torch.device("cpu"), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = sharded_grad_scaler(torch.device("cpu"))
    before = full_state(model)
    inputs, targets = token_batches(1, GLOBAL_BATCH)[0]
    part = slice(env.rank * 4, (env.rank + 1) * 4)
    scaler.scale(lm_loss(model(inputs[part]), targets[part])).backward()
    if inf_on_rank == env.rank:
        grad = next(model.parameters()).grad
        (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
    scale = float(scaler.get_scale())
    scaler.step(optimizer)
    scaler.update()
    return {"changed": max_diff(before, full_state(model)) > 0, "scale": (scale, float(scaler.get_scale())),
            "weights": full_state(model)}


def compiled_grads(env, overrides: dict) -> dict[str, torch.Tensor]:
    """Step-0 gradients of the toy GPT built with ``compile=True`` (per block, after checkpointing)."""
    from hpctrain.config.parallel import ParallelConfig
    from hpctrain.parallel import build_parallel

    model = build_parallel(toy_gpt, env, ParallelConfig(**overrides), device=torch.device("cpu"), seed=0, compile=True)
    inputs, targets = token_batches(1, GLOBAL_BATCH)[0]
    part = slice(env.rank * GLOBAL_BATCH // env.world_size, (env.rank + 1) * GLOBAL_BATCH // env.world_size)
    lm_loss(model(inputs[part]), targets[part]).backward()
    return full_grads(model)
