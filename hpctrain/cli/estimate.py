"""``hpctrain estimate``: will it fit, how long will it take, how often must it checkpoint."""

from __future__ import annotations

import argparse
import json
import re
from typing import NamedTuple

from hpctrain.core.errors import UserError
from hpctrain.estimate import activations, hfconfig, memory, model, reliability
from hpctrain.estimate.hardware import ACCELERATORS, PRECISIONS, lookup
from hpctrain.estimate.plan import Inputs, estimate
from hpctrain.estimate.render import render

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_SHAPE_FLAGS = (("layers", "--layers"), ("hidden", "--hidden"), ("heads", "--heads"), ("seq_len", "--seq-len"),
                ("vocab", "--vocab"))


def parse_count(text: str, flag: str) -> float:
    """'175B', '7.5e9', '300b', '1.4T', '125M' -> a number; UserError naming ``flag`` otherwise."""
    match = re.fullmatch(r"\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*", text, re.IGNORECASE)
    if not match:
        raise UserError(f"{flag} {text!r} is not a count; examples: 7.5e9, 7.5B, 300B, 1.4T, 125M")
    return float(match.group(1).replace(",", "").replace("_", "")) * _SUFFIX[match.group(2).upper()]


# what today's models change; None when not given, so a --hf-config value stands
_ARCH_FIELDS = ("kv_heads", "ffn_hidden", "mlp", "tied", "positions", "norm", "bias", "experts", "top_k", "dropout")


def _given(args: argparse.Namespace, fields: tuple[str, ...]) -> dict[str, object]:
    return {attr: getattr(args, attr) for attr in fields if getattr(args, attr) is not None}


def _shape(args: argparse.Namespace) -> tuple[model.TransformerShape | None, str]:
    """The transformer shape from --hf-config and the shape flags (a flag overrides the config)."""
    base, arch = _given(args, tuple(attr for attr, _ in _SHAPE_FLAGS)), _given(args, _ARCH_FIELDS)
    if args.hf_config:
        fields, source = hfconfig.read(args.hf_config)
        try:
            return model.TransformerShape(**{**fields, **base, **arch}), source  # type: ignore[arg-type]
        except UserError as err:  # name the file whose values (or the flags over them) do not fit together
            raise UserError(f"{source}: {err}") from None
    if not base and not arch:
        return None, ""
    missing = [flag for attr, flag in _SHAPE_FLAGS if attr not in base]
    if missing:
        raise UserError(f"a transformer shape needs all of --layers --hidden --heads --seq-len --vocab "
                        f"(or --hf-config); missing: {' '.join(missing)}")
    return model.TransformerShape(**base, **arch), "transformer shape"  # type: ignore[arg-type]


class _Size(NamedTuple):
    params: float
    source: str
    activations: float | None = None  # bytes saved for backward, measured on the meta device
    flops_per_sample: float | None = None  # forward+backward, counted on the meta device


def _size(args: argparse.Namespace, shape: model.TransformerShape | None, shape_source: str) -> _Size:
    if args.model and (args.params or shape):
        raise UserError("--model gives the size on its own; drop --params, --hf-config or the shape flags")
    if args.params:
        return _Size(parse_count(args.params, "--params"), "--params")
    if shape is not None:
        return _Size(float(shape.params), shape_source)
    if args.model:
        return _measure(args.model, args.micro_batch, memory.compute_bytes(args.precision))
    raise UserError("no model size given: pass --params (e.g. 7.5B), --model NAME (see `hpctrain models`), "
                    "--hf-config config.json, or a transformer shape --layers --hidden --heads --seq-len --vocab")


def _measure(name: str, micro_batch: int, element_bytes: int) -> _Size:
    from hpctrain.estimate import measure  # builds the model: the one path that needs torch

    net = measure.meta_model(name)
    source = f"--model {name} (built on the meta device)"
    sample = measure.input_shape(name)
    if sample is None:  # a user factory declares no input shape: parameters only
        return _Size(float(model.count_params(net)), source)
    dtype = measure.input_dtype(name)
    acts = measure.saved_tensor_bytes(net, sample, micro_batch, element_bytes, dtype)
    return _Size(float(model.count_params(net)), source, acts, measure.counted_per_sample(net, sample, dtype=dtype))


def _mtbf(args: argparse.Namespace) -> tuple[float, str]:
    """Per-GPU MTBF and where it came from: --mtbf-hours, or a published failure log."""
    if args.mtbf_hours is not None:
        if args.failure_preset is not None:
            raise UserError("give --mtbf-hours or --failure-preset, not both")
        return args.mtbf_hours, "--mtbf-hours"
    preset = reliability.failure_preset(args.failure_preset or reliability.DEFAULT_FAILURE_PRESET)
    return preset.gpu_mtbf_hours, f"{preset.name} ({preset.source})"


def _hfu(args: argparse.Namespace, peak_flops: float) -> float | None:
    """Hardware FLOPs utilisation from --hfu or --achieved-tflops (what Megatron and BLOOM publish)."""
    given = [flag for flag, value in (("--mfu", args.mfu), ("--hfu", args.hfu),
                                      ("--achieved-tflops", args.achieved_tflops)) if value is not None]
    if len(given) > 1:
        raise UserError(f"give one of --mfu, --hfu, --achieved-tflops; got {' and '.join(given)}")
    if args.achieved_tflops is not None:
        return args.achieved_tflops * 1e12 / peak_flops
    return args.hfu


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    shape, shape_source = _shape(args)
    size = _size(args, shape, shape_source)
    gpu = lookup(args.gpu)
    mtbf_hours, mtbf_source = _mtbf(args)
    return Inputs(params=size.params, source=size.source, gpu=gpu,
                  tokens=None if args.tokens is None else parse_count(args.tokens, "--tokens"),
                  gpus=args.gpus, strategy=args.strategy, tp=args.tp, pp=args.pp, ep=args.ep,
                  precision=args.precision, amp_layout=args.amp_layout,
                  mfu=0.4 if args.mfu is None else args.mfu, hfu=_hfu(args, gpu.peak_flops(args.precision)),
                  micro_batch=args.micro_batch, recompute=args.activation_checkpointing,
                  sequence_parallel=args.sequence_parallel, gpu_mtbf_hours=mtbf_hours, mtbf_source=mtbf_source,
                  ckpt_gbps=args.ckpt_bandwidth, shape=shape, measured_activations=size.activations,
                  counted_flops_per_sample=size.flops_per_sample)


def cmd_estimate(args: argparse.Namespace) -> int:
    result = estimate(inputs_from_args(args))
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="size a training run: FLOPs and time, memory per GPU by strategy, "
                                        "checkpoint cost, Young-Daly interval")
    size = p.add_argument_group("model size (one of)")
    size.add_argument("--params", help="parameter count: 7.5e9, 7.5B, 125M")
    size.add_argument("--model", help="a registered model name (or package.module:factory), built on the meta device")
    size.add_argument("--hf-config", metavar="PATH", help="a transformers config.json (llama, mistral, mixtral, "
                                                          "qwen2, gpt2, gpt_neox), read offline; flags override it")
    for attr, flag in _SHAPE_FLAGS:
        size.add_argument(flag, dest=attr, type=int, help="transformer shape (all five together)")
    _add_architecture(p)
    run = p.add_argument_group("run")
    run.add_argument("--tokens", help="training tokens: 300B, 1.4T; samples for an image --model "
                                      "(needed for FLOPs and time)")
    run.add_argument("--gpus", type=int, default=1, help="GPUs in the job (default 1)")
    run.add_argument("--gpu", default="h100-sxm", help=f"accelerator: {', '.join(ACCELERATORS)} (default h100-sxm)")
    run.add_argument("--strategy", help=f"mark one strategy: {', '.join(memory.STRATEGIES)} (all are shown)")
    run.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    run.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    run.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism with --tp")
    run.add_argument("--precision", default="bf16", choices=PRECISIONS, help="training precision (default bf16)")
    run.add_argument("--amp-layout", default="master", choices=["master", "autocast"],
                     help="16-bit states: master = 2+2+12 B/param (Megatron, DeepSpeed), "
                          "autocast = 4+4+8 (torch AMP, FSDP2 mixed precision)")
    run.add_argument("--ep", type=int, default=1, help="expert-parallel degree (a mixture of experts; divides dp)")
    run.add_argument("--mfu", type=float, help="model FLOPs utilisation, a fraction (default 0.4)")
    run.add_argument("--hfu", type=float, help="hardware FLOPs utilisation (recomputation counted), instead of --mfu")
    run.add_argument("--achieved-tflops", type=float, metavar="TFLOPS",
                     help="achieved hardware TFLOP/s per GPU as papers report it, instead of --mfu")
    run.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-step (default 1)")
    run.add_argument("--activation-checkpointing", default="none", choices=activations.RECOMPUTE,
                     help="activation recomputation (default none)")
    rel = p.add_argument_group("checkpointing and failures")
    rel.add_argument("--mtbf-hours", type=float,
                     help="mean time between failures of ONE GPU, in hours; the cluster's is this / --gpus")
    rel.add_argument("--failure-preset", metavar="NAME",
                     help=f"per-GPU MTBF from a published log: {', '.join(reliability.FAILURE_PRESETS)} "
                          f"(default {reliability.DEFAULT_FAILURE_PRESET}, "
                          f"{reliability.DEFAULT_GPU_MTBF_HOURS:,.0f} h: a shared research cluster)")
    rel.add_argument("--ckpt-bandwidth", type=float, default=reliability.DEFAULT_CKPT_GBPS,
                     help=f"aggregate checkpoint write bandwidth, GB/s (default {reliability.DEFAULT_CKPT_GBPS:g})")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=cmd_estimate)


def _add_architecture(p: argparse.ArgumentParser) -> None:
    arch = p.add_argument_group("architecture (with a shape or --hf-config; defaults: GPT-2's)")
    arch.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default --heads)")
    arch.add_argument("--ffn-hidden", type=int, help="MLP width (default 4h; Llama's 8h/3 rounded up to 256 "
                                                     "with --mlp swiglu)")
    arch.add_argument("--mlp", choices=model.MLPS, help="gelu: two matrices (default); swiglu: three")
    arch.add_argument("--untied-embeddings", dest="tied", action="store_const", const=False,
                      help="a separate output projection (V x h more parameters)")
    arch.add_argument("--positions", choices=model.POSITIONS, help="learned (s x h parameters, default), rotary, alibi")
    arch.add_argument("--norm", choices=model.NORMS, help="layernorm (default) or rmsnorm (no bias)")
    arch.add_argument("--bias", choices=model.BIASES, help="linear-layer biases: all (default), qkv, none")
    arch.add_argument("--experts", type=int, help="experts per MoE layer (default 1: a dense MLP)")
    arch.add_argument("--top-k", type=int, help="experts each token is routed to (default 1)")
    arch.add_argument("--no-dropout", dest="dropout", action="store_const", const=False,
                      help="no dropout masks in the activations (today's LLMs)")
