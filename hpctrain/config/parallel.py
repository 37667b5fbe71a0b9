"""The ``parallel`` config section: the strategy, the mesh (dp x tp x pp) and its knobs.

The section checks what it can alone (ranges, combinations no strategy supports);
:func:`check_topology` checks what needs the world size, before any process group work,
and names the numbers in its message. The sizes it resolves are a
:class:`hpctrain.core.topology.Topology` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.core.section import ConfigError, at_least, opt, positive
from hpctrain.core.topology import Topology

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Checkpointing = Literal["none", "block", "selective"]
DTypeName = Literal["auto", "fp32", "bf16", "fp16"]

# The values parallel.strategy takes: the user-facing names of hpctrain.parallel.registry, which
# adds to this list when a strategy is registered (kept here so that checking a config imports
# no strategy module).
STRATEGY_NAMES: list[str] = ["ddp", "zero1", "fsdp", "hsdp", "deepspeed"]

# Strategies that shard over the data-parallel dimension and so compose with tp / pp.
SHARDED = ("fsdp", "hsdp")

# parallel.strategy=auto: hpctrain.planning.auto chooses strategy, tp, pp, activation
# checkpointing and micro-batch for the world before anything is built (docs/parallel.md)
AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    strategy: str = opt("ddp", "Data-parallel strategy: ddp | zero1 (optimizer state sharded, over DDP) | fsdp (FSDP2; ZeRO-3, or ZeRO-2 with reshard_after_forward=false) | hsdp (replicate across nodes, shard within) | deepspeed (ZeRO stage from deepspeed_stage; needs the deepspeed extra) | auto (choose strategy, tp, pp, activation_checkpointing and the micro-batch that fit parallel.memory_budget_gb or the GPU with the fastest estimate, keeping the global batch; `hpctrain plan` prints the choice; docs/parallel.md).")
    dp: int = opt(0, "Data-parallel degree; 0 = world size / (tp x pp). dp x tp x pp must equal the world size.")
    tp: int = opt(1, "Tensor-parallel degree (DTensor column/row plans for attention and MLP; keep it within a node). Needs a model whose `blocks` hold Linears q, k, v, o, up, down (the gpt), with heads divisible by tp; the tp ranks of one replica read the same batches. tp > 1 with dp > 1 needs strategy fsdp or hsdp.")
    pp: int = opt(1, "Pipeline-parallel degree (torch.distributed.pipelining stages; blocks split as evenly as possible, the extra ones to the middle stages, as hpctrain estimate --pp sizes them). pp > 1 with dp > 1 needs strategy fsdp or hsdp.")
    cp: int = opt(1, "Context-parallel degree: the ranks of a cp group share each sequence (2 x cp chunks, rank r computes chunks r and 2cp-1-r; keys and values all-gathered in each attention layer, torch's ring attention on CUDA): activations per rank fall about 1/cp. For gpt, llama and Hugging Face Llama/Mistral/Qwen2 with train.task=causal_lm; model.seq_len must be a multiple of 2 x cp; the cp ranks of one replica read the same batches; gradients are averaged over dp x cp (fsdp shards over dp x cp). With tp > 1 needs strategy fsdp or hsdp; no pp, sequence_parallel or deepspeed (docs/parallel.md).")
    ep: int = opt(1, "Expert-parallel degree (a mixture of experts: model.experts): each expert lives on one of ep ranks, tokens travel to it and back by all-to-all. Its ranks are data-parallel ranks: ep must divide dp (and model.experts); needs strategy fsdp, which shards the other weights over dp and each rank's experts over the dp / ep ranks that hold the same ones (docs/parallel.md).")
    dp_replicate: int = opt(0, "hsdp: replicas (outer mesh dim); 0 = the number of nodes. Shards per replica = dp / dp_replicate.")
    sequence_parallel: bool = opt(False, "With tp > 1: also shard layer norms and the residual stream along the sequence (Megatron sequence parallelism).")
    reshard_after_forward: bool = opt(True, "fsdp/hsdp: free gathered parameters after forward (true = ZeRO-3) or keep them until backward (false = ZeRO-2: more memory, one all-gather less).")
    reduce_every_microstep: bool = opt(True, "fsdp/hsdp with gradient accumulation (train.grad_accum > 1, or a global batch split into micro-steps): reduce-scatter the gradients after every micro-step, so each rank only ever holds its shard of them (true, as torchtitan), or only after the last one (false: every rank accumulates whole, unsharded gradients over the inner micro-steps, 4 bytes a parameter of its tp/pp part at reduce_dtype=fp32, for accum - 1 fewer reduce-scatters per step; the planner counts them).")
    param_dtype: DTypeName = opt("auto", "fsdp/hsdp mixed precision: dtype of the gathered parameters in forward/backward; auto = bf16 under precision=bf16, fp16 under fp16, else fp32. Sharded master weights stay fp32.")
    reduce_dtype: Literal["fp32", "bf16"] = opt("fp32", "fsdp/hsdp mixed precision: dtype of the gradient reduce-scatter (fp32 keeps the sum exact to fp32).")
    cpu_offload: bool = opt(False, "fsdp/hsdp: keep sharded parameters, gradients and optimizer state in CPU memory (optimizer step on CPU).")
    meta_init: bool = opt(False, "fsdp/hsdp: build the model on the meta device, shard it, and load rank 0's one-process init (identical initial weights without the full model on any accelerator).")
    microbatches: int = opt(4, "pp > 1: micro-batches per step through the pipeline schedule; the per-rank batch must be divisible by it.")
    pp_schedule: PipelineSchedule = opt("1f1b", "pp > 1: pipeline schedule: gpipe | 1f1b | interleaved_1f1b.")
    virtual_stages: int = opt(2, "pp_schedule=interleaved_1f1b: stages per pipeline rank (blocks split into pp x virtual_stages stages).")
    activation_checkpointing: Checkpointing = opt("none", "Recompute activations in backward: none | block (each transformer block / child module) | selective (save matmul outputs, recompute the rest).")
    deepspeed_stage: int = opt(2, "strategy=deepspeed: ZeRO stage 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).")
    memory_budget_gb: float | None = opt(None, "strategy=auto: memory one rank may use, in GB (1e9 bytes); default: the GPU's total memory; required on CPU.")
    memory_margin: float = opt(0.1, "strategy=auto: fraction of the memory budget kept free (the estimate's error, allocator fragmentation); a plan fits when its estimate is within budget x (1 - margin).")
    target_gpu: str | None = opt(None, "strategy=auto: the GPU the plan is for, by its name in the accelerator table (hpctrain estimate --gpu: h100-sxm, a100-40gb, ...): its memory (unless parallel.memory_budget_gb) and its peak rate; default: the GPU found at run time (its reported memory). `hpctrain plan --gpu` sets it: put the same value in the job's config and auto chooses exactly the plan that `hpctrain plan` printed (docs/parallel.md).")
    target_peak_tflops: float | None = opt(None, "strategy=auto with parallel.target_gpu: the GPU's dense peak TFLOP/s at the run's precision (a part the table lacks, or to override its row; hpctrain plan --peak-tflops).")
    backend: Literal["auto", "nccl", "gloo"] = opt("auto", "Process-group backend; auto = nccl with CUDA, else gloo.")
    init_timeout_s: float = opt(600.0, "Seconds to wait for all ranks in init_process_group and collectives.")
    bucket_cap_mb: float = opt(25.0, "DDP gradient bucket size in MiB.")
    gradient_as_bucket_view: bool = opt(True, "DDP: gradients are views into buckets (saves a copy and memory).")
    static_graph: bool = opt(False, "DDP: the graph is the same every step (enables extra optimizations).")
    find_unused_parameters: bool = opt(False, "DDP: search for parameters that get no gradient (slower).")
    broadcast_buffers: bool = opt(True, "DDP: broadcast buffers (e.g. BatchNorm stats) from rank 0 each forward. (Every strategy also sets all ranks' buffers to rank 0's before each validation, checkpoint and model.pt; docs/parallel.md.)")
    sync_batchnorm: bool = opt(False, "Convert every BatchNorm to torch's SyncBatchNorm: batch statistics over the data-parallel ranks' whole batch (CUDA with NCCL only; refused on CPU/gloo).")

    def __post_init__(self) -> None:
        _one_of("parallel.strategy", self.strategy, (*STRATEGY_NAMES, AUTO))
        positive("parallel", self, "init_timeout_s", "bucket_cap_mb", "tp", "pp", "cp", "ep", "microbatches",
                 "virtual_stages", "memory_budget_gb", "target_peak_tflops")
        if not 0 <= self.memory_margin < 1:
            raise ConfigError(f"parallel.memory_margin={self.memory_margin} must be a fraction in [0, 1), e.g. 0.1")
        at_least("parallel", self, "dp", 0)
        at_least("parallel", self, "dp_replicate", 0)
        if self.deepspeed_stage not in (1, 2, 3):
            raise ConfigError(f"parallel.deepspeed_stage={self.deepspeed_stage} must be 1, 2 or 3")
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.strategy in ("zero1", "deepspeed") and (self.tp > 1 or self.pp > 1):
            raise ConfigError(f"parallel.strategy={self.strategy} does not combine with tp={self.tp} / pp={self.pp}; "
                              "hint: use parallel.strategy=fsdp (or hsdp) for dp x tp x pp")
        if self.strategy not in SHARDED:
            for key in ("cpu_offload", "meta_init"):
                if getattr(self, key):
                    raise ConfigError(f"parallel.{key}=true needs parallel.strategy=fsdp or hsdp "
                                      f"(got {self.strategy}); hint: for DeepSpeed offload, use its own config")
        if self.dp_replicate and self.strategy != "hsdp":
            raise ConfigError(f"parallel.dp_replicate={self.dp_replicate} applies to strategy=hsdp only "
                              f"(got {self.strategy})")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (got tp=1)")


def _one_of(key: str, value: str, names: tuple[str, ...]) -> None:
    if value not in names:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(names)}")


def check_topology(cfg: ParallelConfig, world_size: int, *, num_nodes: int = 1) -> Topology:
    """The topology of ``world_size`` ranks (:meth:`hpctrain.core.topology.Topology.from_config`)
    after the checks that need the world size, or a ConfigError naming the numbers."""
    topo = Topology.from_config(cfg, world_size, num_nodes=num_nodes)
    # context parallel alone keeps whole weights on every rank: DDP averages over dp x cp
    if topo.dp > 1 and (topo.tp > 1 or topo.pp > 1) and cfg.strategy not in SHARDED:
        raise ConfigError(f"parallel.strategy={cfg.strategy} with dp={topo.dp} x tp={cfg.tp} x pp={cfg.pp} is not "
                          "supported; hint: use parallel.strategy=fsdp (or hsdp) to combine data with "
                          "tensor/pipeline parallelism")
    _check_pipeline(cfg)
    return topo


def _check_pipeline(cfg: ParallelConfig) -> None:
    if cfg.pp == 1:
        return
    if cfg.pp_schedule == "1f1b" and cfg.microbatches < cfg.pp:
        raise ConfigError(f"parallel.microbatches ({cfg.microbatches}) < pipeline stages parallel.pp ({cfg.pp}) for "
                          f"pp_schedule=1f1b: the schedule cannot fill the pipeline; hint: "
                          f"parallel.microbatches >= {cfg.pp} (a multiple of it, e.g. {2 * cfg.pp})")
    # Interleaved 1F1B runs the micro-batches in rounds of about pp each; they must divide evenly.
    rounds = max(1, cfg.microbatches // cfg.pp)
    if cfg.pp_schedule == "interleaved_1f1b" and cfg.microbatches % rounds:
        raise ConfigError(f"parallel.microbatches ({cfg.microbatches}) is not a multiple of its {rounds} rounds of "
                          f"parallel.pp ({cfg.pp}) for pp_schedule=interleaved_1f1b "
                          f"({cfg.pp * cfg.virtual_stages} stages); hint: use a multiple of {cfg.pp}")


def resolve_param_dtype(cfg: ParallelConfig, precision: str) -> str:
    """``param_dtype`` with ``auto`` resolved from the top-level ``precision`` key."""
    if cfg.param_dtype != "auto":
        return cfg.param_dtype
    if precision == "fp8":  # float8 matmuls on bf16 parameters: FSDP gathers them in bf16
        return "bf16"
    return precision if precision in ("bf16", "fp16") else "fp32"
