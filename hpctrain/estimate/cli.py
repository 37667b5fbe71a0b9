"""``hpctrain estimate``: will it fit, how long will it take, how often must it checkpoint."""

from __future__ import annotations

import argparse
import json
import re
from typing import NamedTuple

from hpctrain.errors import UserError
from hpctrain.estimate import activations, memory, model, reliability
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


def _shape(args: argparse.Namespace) -> model.TransformerShape | None:
    given = {attr: getattr(args, attr) for attr, _ in _SHAPE_FLAGS if getattr(args, attr) is not None}
    if not given:
        return None
    missing = [flag for attr, flag in _SHAPE_FLAGS if attr not in given]
    if missing:
        raise UserError(f"a transformer shape needs all of --layers --hidden --heads --seq-len --vocab; "
                        f"missing: {' '.join(missing)}")
    return model.TransformerShape(**given)


class _Size(NamedTuple):
    params: float
    source: str
    activations: float | None = None  # bytes saved for backward, measured on the meta device
    flops_per_sample: float | None = None  # forward+backward, counted on the meta device


def _size(args: argparse.Namespace, shape: model.TransformerShape | None) -> _Size:
    if args.model and (args.params or shape):
        raise UserError("--model gives the size on its own; drop --params or the shape flags")
    if args.params:
        return _Size(parse_count(args.params, "--params"), "--params")
    if shape is not None:
        return _Size(float(shape.params), "transformer shape (12Lh^2 + 13Lh + (V+s)h + 2h)")
    if args.model:
        return _measure(args.model, args.micro_batch, memory.compute_bytes(args.precision))
    raise UserError("no model size given: pass --params (e.g. 7.5B), --model NAME (see `hpctrain models`), "
                    "or a transformer shape --layers --hidden --heads --seq-len --vocab")


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


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    shape = _shape(args)
    size = _size(args, shape)
    return Inputs(params=size.params, source=size.source, gpu=lookup(args.gpu),
                  tokens=None if args.tokens is None else parse_count(args.tokens, "--tokens"),
                  gpus=args.gpus, strategy=args.strategy, tp=args.tp, pp=args.pp, precision=args.precision,
                  amp_layout=args.amp_layout, mfu=args.mfu, micro_batch=args.micro_batch,
                  recompute=args.activation_checkpointing, sequence_parallel=args.sequence_parallel,
                  gpu_mtbf_hours=args.mtbf_hours, ckpt_gbps=args.ckpt_bandwidth, shape=shape,
                  measured_activations=size.activations, counted_flops_per_sample=size.flops_per_sample)


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
    for attr, flag in _SHAPE_FLAGS:
        size.add_argument(flag, dest=attr, type=int, help="transformer shape (all five together)")
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
    run.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation, a fraction (default 0.4)")
    run.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-step (default 1)")
    run.add_argument("--activation-checkpointing", default="none", choices=activations.RECOMPUTE,
                     help="activation recomputation (default none)")
    rel = p.add_argument_group("checkpointing and failures")
    rel.add_argument("--mtbf-hours", type=float, default=reliability.DEFAULT_GPU_MTBF_HOURS,
                     help="mean time between failures of ONE GPU, in hours; the cluster's is this / --gpus "
                          f"(default {reliability.DEFAULT_GPU_MTBF_HOURS:,.0f}, from Llama 3's 54-day run)")
    rel.add_argument("--ckpt-bandwidth", type=float, default=reliability.DEFAULT_CKPT_GBPS,
                     help=f"aggregate checkpoint write bandwidth, GB/s (default {reliability.DEFAULT_CKPT_GBPS:g})")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=cmd_estimate)
