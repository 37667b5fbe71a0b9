"""``hpctrain estimate``: will it fit, how long will it take, how often must it checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import NamedTuple, NoReturn

from hpctrain.core.errors import UserError
from hpctrain.estimate import bounds, gpu_memory, hfconfig, reliability, strategy_memory
from hpctrain.estimate.render import render
from hpctrain.estimate.sizing import Inputs, estimate
from hpctrain.models.shape import BIASES, MLPS, NORMS, POSITIONS, TransformerShape
from hpctrain.telemetry.accelerators import ACCELERATORS, PRECISIONS, Accelerator, lookup

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_SHAPE_FLAGS = (("layers", "--layers"), ("hidden", "--hidden"), ("heads", "--heads"), ("seq_len", "--seq-len"),
                ("vocab", "--vocab"))


def parse_count(text: str, flag: str, maximum: float = bounds.MAX_PARAMS) -> float:
    """'175B', '7.5e9', '300b', '1.4T', '125M' -> a number of at least 1 and at most ``maximum``;
    UserError naming ``flag`` otherwise (float('1e400') is inf: refused, never reported as 'infT')."""
    match = re.fullmatch(r"\s*([+-]?)([0-9][0-9_,]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*", text,
                         re.IGNORECASE)
    if not match:
        raise UserError(f"{flag} {text[:40]!r} is not a count; examples: 7.5e9, 7.5B, 300B, 1.4T, 125M")
    value = float(match.group(2).replace(",", "").replace("_", "")) * _SUFFIX[match.group(3).upper()]
    if match.group(1) == "-" or value < 1:
        raise UserError(f"{flag} {text.strip()[:40]} must be a count of at least 1; examples: 7.5B, 300B, 125M")
    if value > maximum:  # an overflow to inf too: named as written, not as 'inf'
        raise UserError(f"{flag} {text.strip()[:40]} is beyond any real job (at most {maximum:,.4g})")
    return value


# what today's models change; None when not given, so a --hf-config value stands
_ARCH_FIELDS = ("kv_heads", "ffn_hidden", "mlp", "tied", "positions", "norm", "bias", "experts", "top_k", "dropout",
                "head_dim")
LONG_CONTEXT = 8_192  # above this, a config's max_position_embeddings is rarely the length a model trains at
_DESCRIBED = "--gpu-memory-gb and --peak-tflops"  # the source of a part the table lacks
SEQ_STAND_IN = 1  # a shape without --seq-len: its seq_len, read by nothing the report shows (Inputs.seq_len_known)


_INT_FLAGS = {**dict(_SHAPE_FLAGS), "kv_heads": "--kv-heads", "ffn_hidden": "--ffn-hidden", "experts": "--experts",
              "top_k": "--top-k", "head_dim": "--head-dim"}


def _given(args: argparse.Namespace, fields: tuple[str, ...]) -> dict[str, object]:
    given = {attr: getattr(args, attr) for attr in fields if getattr(args, attr) is not None}
    # before a shape is built of them: its own checks divide by --heads
    bounds.check_dims({_INT_FLAGS[attr]: value for attr, value in given.items() if attr in _INT_FLAGS})
    return given


class _Shape(NamedTuple):
    shape: TransformerShape | None
    source: str = ""
    seq_len_source: str = ""
    seq_len_known: bool = True
    warnings: tuple[str, ...] = ()


def _shape(args: argparse.Namespace) -> _Shape:
    """The transformer shape from --hf-config and the shape flags (a flag overrides the config).
    --seq-len may be left out: a parameter count does not need it (unless positions are learned)."""
    base, arch = _given(args, tuple(attr for attr, _ in _SHAPE_FLAGS)), _given(args, _ARCH_FIELDS)
    if args.hf_config:
        return _hf_shape(args.hf_config, base, arch)
    if not base and not arch:
        return _Shape(None)
    missing = [flag for attr, flag in _SHAPE_FLAGS if attr not in base and attr != "seq_len"]
    if missing:
        raise UserError(f"a transformer shape needs all of --layers --hidden --heads --vocab, and --seq-len for "
                        f"FLOPs, time and activations (or --hf-config); missing: {' '.join(missing)}")
    if "seq_len" in base:
        shape = TransformerShape(**base, **arch)  # type: ignore[arg-type]
        bounds.check_shape(shape)
        return _Shape(shape, "transformer shape", "--seq-len")
    if arch.get("positions", "learned") == "learned":
        raise UserError("--seq-len missing: learned positions (the default) are a table of --seq-len x --hidden "
                        "parameters; give --seq-len, or --positions rotary|alibi to count parameters without it")
    shape = TransformerShape(**base, seq_len=SEQ_STAND_IN, **arch)  # type: ignore[arg-type]
    bounds.check_shape(shape)
    return _Shape(shape, "transformer shape", "", seq_len_known=False)


def _hf_shape(path: str, base: dict[str, object], arch: dict[str, object]) -> _Shape:
    """A config's shape. Its context length stands in for --seq-len; above LONG_CONTEXT that is
    rarely the training length (Llama 3.1: 131,072, 5x the FLOPs of its 8,192), so it warns."""
    config = hfconfig.load(path)
    try:
        shape = TransformerShape(**{**config.fields, **base, **arch})
        bounds.check_shape(shape)
    except UserError as err:  # name the file whose values (or the flags over them) do not fit together
        raise UserError(f"{config.source}: {err}") from None
    if "seq_len" in base:
        return _Shape(shape, config.source, "--seq-len")
    warnings: tuple[str, ...] = ()
    if shape.seq_len > LONG_CONTEXT:
        warnings = (f"sequence length {shape.seq_len:,} is {config.context_key} from {path}: the longest context "
                    "the model accepts, rarely the length it trains at; FLOPs, time and activations assume it. "
                    f"Give the training length with --seq-len, e.g. --seq-len {LONG_CONTEXT}",)
    return _Shape(shape, config.source, f"{config.context_key} in {path}", True, warnings)


class _Size(NamedTuple):
    params: float
    source: str
    activations: float | None = None  # bytes saved for backward, measured on the meta device
    flops_per_sample: float | None = None  # forward+backward, counted on the meta device


def _size(args: argparse.Namespace, shape: TransformerShape | None, shape_source: str) -> _Size:
    """The parameter count: --params, else the shape's, else a --model measured on the meta device."""
    if args.model and (args.params or shape):
        raise UserError("--model gives the size on its own; drop --params, --hf-config or the shape flags")
    if args.params:
        return _Size(parse_count(args.params, "--params"), "--params")
    if shape is not None:
        return _Size(float(shape.params), shape_source)
    if args.model:
        bounds.check_number("--micro-batch", args.micro_batch, bounds.MAX_ELEMENTS)  # before a meta batch of it
        return _measure(args.model, args.micro_batch, gpu_memory.compute_bytes(args.precision))
    raise UserError("no model size given: pass --params (e.g. 7.5B), --model NAME (see `hpctrain models`), "
                    "--hf-config config.json, or a transformer shape --layers --hidden --heads --seq-len --vocab")


def _measure(name: str, micro_batch: int, element_bytes: int) -> _Size:
    """--model: built on the meta device and measured there (the one path that imports torch)."""
    from hpctrain.models import REGISTRY, build_model  # torch: only --model needs it (the login-node path does not)
    from hpctrain.telemetry import measure

    try:
        net = measure.on_meta(lambda: build_model(name))
    except UserError as err:
        raise UserError(f"--model: {err}") from err
    source = f"--model {name} (built on the meta device)"
    params = float(measure.param_count([net]))
    spec = REGISTRY.get(name)
    if spec is None:  # a user factory declares no input shape: parameters only
        return _Size(params, source)
    acts = measure.saved_tensor_bytes(net, spec.input_shape, micro_batch, element_bytes, spec.input_dtype)
    return _Size(params, source, acts, measure.counted_per_sample(net, spec.input_shape, dtype=spec.input_dtype))


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
    if args.achieved_tflops is not None:  # named as given, not as the fraction it becomes
        bounds.check_number("--achieved-tflops", args.achieved_tflops, bounds.MAX_TFLOPS)
        if args.achieved_tflops * 1e12 > peak_flops:
            raise UserError(f"--achieved-tflops {args.achieved_tflops:g} exceeds the dense peak of {args.gpu} at "
                            f"{args.precision}, {peak_flops / 1e12:g} TFLOP/s; hint: a figure of at most that (or "
                            "the part's own peak with --peak-tflops)")
        return args.achieved_tflops * 1e12 / peak_flops
    return args.hfu


def _gpu(args: argparse.Namespace) -> Accelerator:
    """--gpu from the table, with --gpu-memory-gb and --peak-tflops (at --precision) over its row; a part
    the table lacks needs both."""
    for flag, value, most in (("--gpu-memory-gb", args.gpu_memory_gb, bounds.MAX_MEMORY_GB),
                              ("--peak-tflops", args.peak_tflops, bounds.MAX_TFLOPS)):
        if value is not None:  # NaN and inf too: a budget that is no number plans nothing
            bounds.check_number(flag, value, most)
    try:
        gpu = lookup(args.gpu)
    except UserError as err:
        if args.gpu_memory_gb is None or args.peak_tflops is None:
            raise UserError(f"{err}; or describe it with --gpu-memory-gb and --peak-tflops") from None
        gpu = Accelerator(args.gpu, args.gpu_memory_gb, dict.fromkeys(PRECISIONS), _DESCRIBED)
    return _override(gpu, args)


def _override(gpu: Accelerator, args: argparse.Namespace) -> Accelerator:
    """The row with the flags' values, its source naming them (so the report says the figures are the user's)."""
    flags: list[str] = []
    if args.gpu_memory_gb is not None:
        gpu = dataclasses.replace(gpu, memory_gb=args.gpu_memory_gb)
        flags.append("--gpu-memory-gb")
    if args.peak_tflops is not None:
        gpu = dataclasses.replace(gpu, tflops={**gpu.tflops, args.precision: args.peak_tflops})
        flags.append(f"--peak-tflops ({args.precision})")
    if not flags or gpu.source == _DESCRIBED:
        return gpu
    return dataclasses.replace(gpu, source=f"{gpu.source}, overridden by {' and '.join(flags)}")


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    found = _shape(args)
    shape = found.shape
    size = _size(args, shape, found.source)
    gpu = _gpu(args)
    mtbf_hours, mtbf_source = _mtbf(args)
    return Inputs(params=size.params, source=size.source, gpu=gpu,
                  tokens=None if args.tokens is None else parse_count(args.tokens, "--tokens", bounds.MAX_TOKENS),
                  gpus=args.gpus, strategy=args.strategy, tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp,
                  precision=args.precision, amp_layout=args.amp_layout,
                  mfu=0.4 if args.mfu is None else args.mfu, hfu=_hfu(args, gpu.peak_flops(args.precision)),
                  micro_batch=args.micro_batch, recompute=args.activation_checkpointing,
                  sequence_parallel=args.sequence_parallel, gpu_mtbf_hours=mtbf_hours, mtbf_source=mtbf_source,
                  ckpt_gbps=args.ckpt_bandwidth, shape=shape, measured_activations=size.activations,
                  counted_flops_per_sample=size.flops_per_sample, seq_len_known=found.seq_len_known,
                  seq_len_source=found.seq_len_source, warnings=found.warnings, grad_accum=args.grad_accum,
                  microbatches=args.microbatches, pp_schedule=args.pp_schedule, attention=args.attention,
                  loss_parallel=args.loss_parallel, vocab_parallel=args.vocab_parallel,
                  deepspeed_stage=args.deepspeed_stage, dp_replicate=args.dp_replicate, cpu_offload=args.cpu_offload,
                  reduce_every_microstep=args.reduce_every_microstep)


def cmd_estimate(args: argparse.Namespace) -> int:
    result = estimate(inputs_from_args(args))
    for warning in result["warnings"]:  # on stderr too, so neither a pipe nor --json hides it
        sys.stderr.write(f"hpctrain estimate: warning: {warning}\n")
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def one_line_errors(parser: argparse.ArgumentParser, command: str) -> None:
    """argparse's errors as the project's: one line and exit 2, not the usage block (28 lines for
    ``--params -7B``, which argparse reads as an unknown flag: the hint says how to pass it)."""

    def error(message: str) -> NoReturn:
        hint = "see hpctrain " + command + " --help"
        if "expected one argument" in message:
            hint = f"a value that starts with '-' reads as a flag: write it as FLAG=VALUE (e.g. --params=-7B); {hint}"
        parser.exit(2, f"hpctrain {command}: error: {message}; hint: {hint}\n")

    parser.error = error  # type: ignore[method-assign]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="size a training run: FLOPs and time, memory per GPU by strategy, "
                                        "checkpoint cost, Young-Daly interval")
    one_line_errors(p, "estimate")
    size = p.add_argument_group("model size (one of)")
    size.add_argument("--params", help="parameter count: 7.5e9, 7.5B, 125M")
    size.add_argument("--model", help="a registered model name (or package.module:factory), built on the meta device")
    size.add_argument("--hf-config", metavar="PATH", help="a transformers config.json (llama, mistral, mixtral, "
                      "qwen2, qwen3, qwen3_moe, deepseek_v3, gemma2, phi3, gpt2, gpt_neox), read offline; flags "
                      "override it")
    for attr, flag in _SHAPE_FLAGS:
        size.add_argument(flag, dest=attr, type=int, help="transformer shape (all five together)")
    _add_architecture(p)
    _add_run(p)
    _add_declared(p)
    _add_reliability(p)
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=cmd_estimate)


def _add_run(p: argparse.ArgumentParser) -> None:
    run = p.add_argument_group("run")
    run.add_argument("--tokens", help="training tokens: 300B, 1.4T; samples for an image --model "
                                      "(needed for FLOPs and time)")
    run.add_argument("--gpus", type=int, default=1, help="GPUs in the job (default 1)")
    run.add_argument("--gpu", default="h100-sxm", help=f"accelerator: {', '.join(ACCELERATORS)} (default h100-sxm), "
                                                       "or any name with --gpu-memory-gb and --peak-tflops")
    run.add_argument("--gpu-memory-gb", type=float, metavar="GB",
                     help="device memory in GB (1e9 bytes), over the table's")
    run.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                     help="dense peak TFLOP/s per GPU at --precision, over the table's")
    run.add_argument("--strategy", help=f"mark one strategy: {', '.join(gpu_memory.STRATEGIES)} (all are shown); "
                     "hsdp or deepspeed (the declared memory only); the declared memory is fsdp's unless given")
    run.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    run.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    run.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism with --tp")
    run.add_argument("--precision", default="bf16", choices=PRECISIONS, help="training precision (default bf16)")
    run.add_argument("--amp-layout", default="master", choices=list(gpu_memory.AMP_LAYOUTS),
                     help="16-bit states: master = 2+2+12 B/param (16-bit grads: DeepSpeed, the ZeRO paper), "
                          "megatron = 2+4+12 (fp32 main grads: Megatron-LM in bf16), "
                          "autocast = 4+4+8 (torch AMP, FSDP2 mixed precision)")
    run.add_argument("--ep", type=int, default=1, help="expert-parallel degree (a mixture of experts; divides dp)")
    run.add_argument("--cp", type=int, default=1, help="context-parallel degree: each GPU holds seq-len / cp tokens "
                                                       "(gpus = dp x tp x pp x cp)")
    run.add_argument("--mfu", type=float, help="model FLOPs utilisation, a fraction (default 0.4)")
    run.add_argument("--hfu", type=float, help="hardware FLOPs utilisation (recomputation counted), instead of --mfu")
    run.add_argument("--achieved-tflops", type=float, metavar="TFLOPS",
                     help="achieved hardware TFLOP/s per GPU as papers report it, instead of --mfu")
    run.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-step (default 1)")
    run.add_argument("--activation-checkpointing", default="none", choices=strategy_memory.RECOMPUTE,
                     help="activation recomputation (default none): selective keeps every matmul's output "
                          "(hpctrain's), selective_op every other one (torchtitan's op-level policy), full each "
                          "block's input")


def _add_declared(p: argparse.ArgumentParser) -> None:
    declared = p.add_argument_group("what the strategy holds (the declared memory, docs/estimate.md)")
    declared.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (default 1)")
    declared.add_argument("--microbatches", type=int, help="with --pp: pipeline micro-batches per step, each of "
                          "--micro-batch sequences (default --pp)")
    declared.add_argument("--pp-schedule", default="1f1b", choices=strategy_memory.SCHEDULES,
                          help="pipeline schedule (default 1f1b; gpipe holds every micro-batch's activations)")
    declared.add_argument("--attention", default="flash", choices=strategy_memory.ATTENTION,
                          help="attention kernel: flash (also memory-efficient SDPA: no s x s scores kept; default, "
                               "CUDA) or math (keeps the softmax)")
    declared.add_argument("--loss-parallel", action="store_true",
                          help="with --tp: the logits and the loss split over the tp ranks (Megatron, torchtitan)")
    declared.add_argument("--no-vocab-parallel", dest="vocab_parallel", action="store_false",
                          help="with --tp: the embedding and the head whole on every tp rank (hpctrain's gpt)")
    declared.add_argument("--deepspeed-stage", type=int, default=2, choices=(1, 2, 3),
                          help="--strategy deepspeed: ZeRO stage (default 2)")
    declared.add_argument("--dp-replicate", type=int, default=1, help="--strategy hsdp: replicas (default 1)")
    declared.add_argument("--cpu-offload", action="store_true", help="fsdp/hsdp: sharded state in host memory")
    declared.add_argument("--no-reduce-every-microstep", dest="reduce_every_microstep", action="store_false",
                          help="fsdp/hsdp with --grad-accum: whole gradients between reduce-scatters")


def _add_reliability(p: argparse.ArgumentParser) -> None:
    rel = p.add_argument_group("checkpointing and failures")
    rel.add_argument("--mtbf-hours", type=float,
                     help="mean time between failures of ONE GPU, in hours; the cluster's is this / --gpus")
    rel.add_argument("--failure-preset", metavar="NAME",
                     help=f"per-GPU MTBF from a published log: {', '.join(reliability.FAILURE_PRESETS)} "
                          f"(default {reliability.DEFAULT_FAILURE_PRESET}, "
                          f"{reliability.DEFAULT_GPU_MTBF_HOURS:,.0f} h: a shared research cluster)")
    rel.add_argument("--ckpt-bandwidth", type=float, default=reliability.DEFAULT_CKPT_GBPS,
                     help=f"aggregate checkpoint write bandwidth, GB/s (default {reliability.DEFAULT_CKPT_GBPS:g})")


def _add_architecture(p: argparse.ArgumentParser) -> None:
    arch = p.add_argument_group("architecture (with a shape or --hf-config; defaults: GPT-2's)")
    arch.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default --heads)")
    arch.add_argument("--head-dim", type=int, help="width of one head (default --hidden / --heads; a config's "
                                                   "head_dim, e.g. Mistral NeMo's 128)")
    arch.add_argument("--ffn-hidden", type=int, help="MLP width (default 4h; Llama's 8h/3 rounded up to 256 "
                                                     "with --mlp swiglu)")
    arch.add_argument("--mlp", choices=MLPS, help="gelu: two matrices (default); swiglu: three")
    arch.add_argument("--untied-embeddings", dest="tied", action="store_const", const=False,
                      help="a separate output projection (V x h more parameters)")
    arch.add_argument("--positions", choices=POSITIONS, help="learned (s x h parameters, default), rotary, alibi")
    arch.add_argument("--norm", choices=NORMS, help="layernorm (default) or rmsnorm (no bias)")
    arch.add_argument("--bias", choices=BIASES, help="linear-layer biases: all (default), qkv, none")
    arch.add_argument("--experts", type=int, help="experts per MoE layer (default 1: a dense MLP)")
    arch.add_argument("--top-k", type=int, help="experts each token is routed to (default 1)")
    arch.add_argument("--no-dropout", dest="dropout", action="store_const", const=False,
                      help="no dropout masks in the activations (today's LLMs)")
