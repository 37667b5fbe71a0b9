"""``parallel.strategy=auto`` (and ``hpctrain plan``, :mod:`hpctrain.cli.plan`): choose the strategy,
tp, pp, pipeline micro-batches and schedule, cpu offload, activation checkpointing and micro-batch
for the machine the job runs on, before anything is built.

The machine (:mod:`hpctrain.planning.machine`) is the GPU named by ``parallel.target_gpu`` (what
``hpctrain plan --gpu`` sets), else the device found at run time. The model
(:mod:`hpctrain.planning.profile`): the built-in transformers by their shape alone, torch-free;
any other model measured on the meta device (:mod:`hpctrain.planning.autosize`). Given the same
config and world, ``hpctrain plan`` on a login node and ``auto`` on the GPU node run the same
function on the same numbers, so they choose the same plan.

The search: every layout the model and the world allow (ddp, zero1, fsdp, fsdp with cpu offload,
hsdp across nodes, DeepSpeed ZeRO 1-3 where the package is installed, over all ranks; tp within
a node and pp for a model with transformer blocks, fsdp over the remaining data-parallel ranks;
context parallel for long sequences and expert parallel for a mixture of experts where the config
offers them), with every activation-checkpointing mode, every micro-batch that keeps the global
batch, and under pp ``parallel.microbatches`` in {pp, 2pp, 4pp, 8pp} x the three schedules. The
trainer's own rules reject what it cannot run. Each candidate's memory on its busiest rank is the
strategies' declaration (:mod:`hpctrain.estimate.strategy_memory`: weights, gradients at their
peak under accumulation, optimizer state, gathered parameters, what a pipeline stage holds,
activations for the target's attention kernel); a measured model without a transformer shape
keeps the estimator's rules and its measured saved tensors. The fastest candidate whose memory
fits ``budget x (1 - parallel.memory_margin)`` is chosen and its values replace ``auto`` in the
config (config.yaml records them).

Time of one optimizer step (a cost model to rank candidates, not to predict a run): the counted
FLOPs of the rank's share at 40% of the target's dense peak, plus recomputation, a fixed cost per
module per micro-step, the pipeline bubble ((pp - 1) / micro-batches, / virtual stages when
interleaved), cpu offload's host traffic and optimizer step, and the communication that outlasts
the backward it overlaps with (data-parallel collectives; tp's all-reduces and pp's sends on the
critical path; cp's key/value all-gathers; ep's all-to-alls). Bandwidths are nominal.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from hpctrain.config.model import check_experts
from hpctrain.config.parallel import AUTO, resolve_param_dtype
from hpctrain.core.errors import UserError
from hpctrain.core.section import ConfigError
from hpctrain.core.topology import Topology
from hpctrain.estimate import bounds
from hpctrain.estimate.activations import layer_bytes
from hpctrain.estimate.gpu_memory import PREFETCHED_LAYERS, StateLayout, compute_bytes, states_per_rank
from hpctrain.estimate.render import sig3
from hpctrain.estimate.strategy_memory import (
    MemoryInputs,
    StrategyMemory,
    optimizer_elements,
    recompute_of,
    strategy_memory,
)
from hpctrain.models.shape import stage_layers
from hpctrain.planning.layout import make_layout, world_layout
from hpctrain.planning.machine import Machine, detect_machine
from hpctrain.planning.profile import Profile, builtin_shape, shape_profile

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.core.env import ClusterEnv

__all__ = ["Candidate", "Choice", "Machine", "NoPlanFits", "apply", "choose", "detect_machine", "render",
           "resolve_auto"]

log = logging.getLogger("hpctrain")

STRATEGIES = ("ddp", "zero1", "fsdp", "hsdp", "deepspeed")  # ties go to the first: less sharding, native first
MODES = ("none", "selective", "block")  # parallel.activation_checkpointing, least recompute first
# gpipe is not tried: it has 1f1b's bubble and holds every micro-batch's activations at once
SCHEDULES = ("1f1b", "interleaved_1f1b")
PIPELINE_DEPTHS = (1, 2, 4, 8, 16, 32)  # parallel.microbatches tried: these multiples of pp
SELECTIVE_SHARE = 0.1  # selective recompute redoes the element-wise ops: taken as 10% of the blocks' forward
MODULE_COST_S = {"cuda": 10e-6, "cpu": 30e-6}  # per module per micro-step (forward + backward launches)
HOST_LINK = 25e9  # bytes/s between host and GPU (PCIe 4 x16, nominal): cpu offload's traffic
HOST_ADAM = 2e9  # parameters/s a host's optimizer step updates (cpu offload)
DEEPSPEED_HOOKS = 2.0  # DeepSpeed's engine runs Python hooks around every module: twice the cost per module
LONG_SEQUENCE = 8192  # context parallel is considered above this many tokens per sample (Llama 3: its 128k phase)


@dataclass(frozen=True)
class Candidate:
    strategy: str
    tp: int
    pp: int
    dp: int
    checkpointing: str
    micro_batch: int
    grad_accum: int
    memory: dict[str, float]  # bytes on the busiest rank, by part
    seconds: float  # per optimizer step
    samples_per_s: float
    fits: bool
    microbatches: int = 1  # pp > 1: pipeline micro-batches per micro-step
    schedule: str = ""  # pp > 1: the pipeline schedule
    cpu_offload: bool = False
    deepspeed_stage: int = 0
    cp: int = 1
    ep: int = 1
    host: float = 0.0  # bytes of host memory the rank's offloaded states take (cpu offload; not in memory)

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    @property
    def label(self) -> str:
        name = self.strategy + (f"-z{self.deepspeed_stage}" if self.strategy == "deepspeed" else "") + \
            ("+offload" if self.cpu_offload else "")
        parts = [f"{name} dp{self.dp}"] if self.dp > 1 or self.cpu_offload else []
        parts += [f"{k}{v}" for k, v in (("cp", self.cp), ("tp", self.tp), ("ep", self.ep), ("pp", self.pp)) if v > 1]
        if self.pp > 1 and self.schedule:
            parts.append(f"{_SHORT[self.schedule]}x{self.microbatches}")
        return " ".join(parts) or name

    @property
    def layout(self) -> tuple[str, int, int, int, int, int, bool, int]:
        return (self.strategy, self.tp, self.pp, self.dp, self.cp, self.ep, self.cpu_offload, self.deepspeed_stage)


_SHORT = {"1f1b": "1f1b", "interleaved_1f1b": "i1f1b", "gpipe": "gpipe"}


@dataclass(frozen=True)
class Choice:
    config: Config
    chosen: Candidate
    candidates: list[Candidate]  # the best micro-batch of each layout and checkpointing mode
    rejected: dict[str, str]  # layout -> why the trainer cannot run it
    machine: Machine
    global_batch: int
    tokens_per_sample: int | None

    def assumptions(self) -> dict[str, Any]:
        """What the plan takes for granted, as ``--json`` carries it (the table's first lines say it)."""
        cfg = self.config
        return {"precision": cfg.precision, "optimizer": cfg.optim.name,
                "optimizer_state_elements": optimizer_elements(cfg),
                "global_batch_from": "data.global_batch_size" if cfg.data.global_batch_size is not None else
                "data.batch_size x train.grad_accum x ranks", "micro_batch": self.chosen.micro_batch}


class NoPlanFits(ConfigError):
    """No candidate fits the budget: the one-line message, and the smallest need for ``--json``."""

    def __init__(self, message: str, smallest: Candidate, machine: Machine) -> None:
        super().__init__(message)
        self.smallest, self.machine = smallest, machine

    def as_json(self) -> dict[str, Any]:
        c = self.smallest
        return {"smallest_need_bytes": round(c.total), "smallest_need": size(c.total), "smallest_plan": c.label,
                "smallest_checkpointing": c.checkpointing, "smallest_micro_batch": c.micro_batch,
                "smallest_memory_bytes": {k: round(v) for k, v in c.memory.items()},
                "usable_bytes": round(self.machine.usable), "budget_bytes": round(self.machine.budget)}


# ---------------------------------------------------------------- entry points


def resolve_auto(cfg: Config, env: ClusterEnv) -> Config:
    """``cfg`` with ``parallel.strategy=auto`` replaced by the chosen plan's values (the table and
    the choice logged on the main rank, so the job's log says what it runs and why); any other
    config unchanged."""
    if cfg.parallel.strategy != AUTO:
        return cfg
    choice = choose(cfg, env)
    if env.is_main:
        for line in render(choice).splitlines():
            log.info("%s", line)
    return choice.config


def choose(cfg: Config, env: ClusterEnv, *, network_gbps: float | None = None) -> Choice:
    """The fastest candidate that fits; ConfigError (exit 2) naming the smallest need when none does.
    ``network_gbps``: the network between nodes, Gb/s per GPU, over the GPU family's default."""
    check_sizes(cfg, env)
    prof = model_profile(cfg)
    machine = detect_machine(cfg, env, network_gbps)
    total = global_batch(cfg, env.world_size)
    candidates: list[Candidate] = []
    rejected: dict[str, str] = {}
    for probe in layouts(cfg, prof, env, machine):
        why = _rejected(cfg, prof, env, probe, total // probe.dp) if total % probe.dp == 0 else \
            f"the global batch of {total} samples does not split over its {probe.dp} data-parallel replicas"
        if why is not None:
            rejected[probe.label] = why
            continue
        for mode in _modes(prof):
            candidates.append(_best_of_layout(cfg, prof, machine, probe, mode, total // probe.dp))
    if not candidates:
        raise ConfigError(_no_layout(cfg, env, total, rejected))
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise NoPlanFits(_none_fits(cfg, env, machine, candidates), min(candidates, key=lambda c: c.total), machine)
    # PCIe between a node's GPUs (L40S, H100 PCIe): tensor parallelism only where nothing else fits,
    # whatever the nominal cost model says (its all-reduces sit on the critical path of every block)
    chosen = max(fitting, key=lambda c: (not (machine.pcie and c.tp > 1), _rank(c)))
    return Choice(apply(cfg, chosen), chosen, sorted(candidates, key=_rank, reverse=True), rejected, machine,
                  total, prof.tokens_per_sample)


def check_sizes(cfg: Config, env: ClusterEnv) -> None:
    """Sizes beyond physical sense refused before the search (:mod:`hpctrain.estimate.bounds`): a
    world larger than any machine, a budget that is NaN or infinite, a model or a global batch of
    more than 2^40 elements in a layer or a step (a search over them runs for minutes, or builds
    lists that exhaust memory)."""
    try:
        bounds.check_world(env.world_size, env.local_world_size, f"{env.world_size} ranks")
        p = cfg.parallel
        for key, most in (("memory_budget_gb", bounds.MAX_MEMORY_GB), ("target_peak_tflops", bounds.MAX_TFLOPS)):
            if getattr(p, key) is not None:
                bounds.check_number(f"parallel.{key}", getattr(p, key), most)
        total = global_batch(cfg, env.world_size)
        bounds.check_batch(total, 1, _batch_keys(cfg))  # before the next check multiplies by the sample
        builtin = builtin_shape_checked(cfg)
        if builtin is not None:
            per_sample = builtin.seq_len
        else:  # a model that will be measured: one sample's input values (torch, but nothing built yet)
            from hpctrain.planning.autosize import sample_elements

            per_sample = sample_elements(cfg)
        bounds.check_batch(total, per_sample, _batch_keys(cfg))
    except UserError as err:
        raise ConfigError(str(err)) from None


def builtin_shape_checked(cfg: Config) -> Any:
    """A built-in transformer's shape once its sizes are within the bounds (model.* keys named), or None."""
    m = cfg.model
    if m.name not in ("gpt", "llama") or m.family is not None:
        return None
    bounds.check_dims({"model.n_layers": m.n_layers, "model.hidden": m.hidden, "model.heads": m.heads,
                       "model.kv_heads": m.kv_heads, "model.ffn_hidden": m.ffn_hidden, "model.seq_len": m.seq_len,
                       "model.vocab": m.vocab, "model.experts": getattr(m, "experts", None) or None})
    found = builtin_shape(m)
    if found is None:
        return None
    bounds.check_shape(found[0], "model")
    return found[0]


def _batch_keys(cfg: Config) -> str:
    if cfg.data.global_batch_size is not None:
        return f"data.global_batch_size={cfg.data.global_batch_size:,}"
    return f"data.batch_size={cfg.data.batch_size:,} x train.grad_accum={cfg.train.grad_accum:,} x the ranks"


def model_profile(cfg: Config) -> Profile:
    """The built-in transformers from their shape (no torch); any other model measured on meta."""
    builtin = builtin_shape(cfg.model)
    if builtin is not None:
        shape, vocab_parallel = builtin
        return shape_profile(cfg.model, shape, vocab_parallel=vocab_parallel)
    from hpctrain.planning.autosize import profile  # torch: a model without a declared shape is measured

    return profile(cfg)


def apply(cfg: Config, c: Candidate) -> Config:
    """``cfg`` as the candidate runs it, written as a user would: the chosen parallel keys, and the
    micro-batch as ``data.batch_size`` (with ``data.global_batch_size`` kept, or ``train.grad_accum``)."""
    extra: dict[str, Any] = {"cpu_offload": c.cpu_offload}
    if c.strategy == "deepspeed":
        extra["deepspeed_stage"] = c.deepspeed_stage
    if c.pp > 1:
        extra |= {"microbatches": c.microbatches, "pp_schedule": c.schedule}
    if c.strategy != "hsdp":
        extra["dp_replicate"] = 0
    for dim in ("cp", "ep"):  # the dimensions exist where context / expert parallel are built
        if hasattr(cfg.parallel, dim):
            extra[dim] = getattr(c, dim)
    parallel = replace(cfg.parallel, strategy=c.strategy, tp=c.tp, pp=c.pp, dp=0,
                       activation_checkpointing=c.checkpointing, **extra)  # type: ignore[arg-type]
    data = replace(cfg.data, batch_size=c.micro_batch)
    accum = 1 if cfg.data.global_batch_size is not None else c.grad_accum
    return replace(cfg, parallel=parallel, data=data, train=replace(cfg.train, grad_accum=accum))


# ---------------------------------------------------------------- the search space


def global_batch(cfg: Config, world_size: int) -> int:
    """Samples per optimizer step that every candidate keeps: ``data.global_batch_size``, else what
    ``data.batch_size`` x ``train.grad_accum`` gives on every rank as plain data parallelism."""
    return cfg.data.global_batch_size or cfg.data.batch_size * cfg.train.grad_accum * world_size


def _probe(strategy: str, tp: int, pp: int, dp: int, **kw: Any) -> Candidate:
    return Candidate(strategy, tp, pp, dp, "none", 0, 0, {}, 0.0, 0.0, False, **kw)


def layouts(cfg: Config, prof: Profile, env: ClusterEnv, machine: Machine) -> Iterator[Candidate]:
    """Layouts as probes (no micro-batch yet): data parallelism over every rank in each strategy
    and variant, then the model splits (cp, ep, tp within a node, pp) with fsdp over the rest."""
    world = env.world_size
    offload = machine.kind == "cuda"  # on a CPU rank the host's memory is the budget already
    for variant in _data_parallel(env, offload):
        yield _probe(dp=world, tp=1, pp=1, **variant)
    if not prof.block_params:
        return
    for cp, ep in _cp_ep(cfg, prof, world):
        for tp in _divisors(world // cp):
            if tp > 1 and not (prof.tensor_parallel and tp * cp <= env.local_world_size and _heads_split(prof, tp)):
                continue
            for pp in _divisors(world // (cp * tp)):
                if cp * tp * pp * ep == 1 or pp > len(prof.block_params) or (cp > 1 and pp > 1):  # cp: no pp
                    continue
                dp = world // (cp * tp * pp)
                yield _probe("fsdp" if dp > 1 or cp > 1 else "ddp", tp, pp, dp, cp=cp, ep=ep)
                if offload and dp > 1 and tp * pp == 1 and ep == 1:
                    yield _probe("fsdp", tp, pp, dp, cp=cp, cpu_offload=True)


def _data_parallel(env: ClusterEnv, offload: bool) -> Iterator[dict[str, Any]]:
    """Strategies over the data-parallel ranks alone: ddp, zero1, fsdp, fsdp with cpu offload,
    hsdp (replicas across nodes, shards within), DeepSpeed ZeRO 1-3 (where it is installed)."""
    yield from ({"strategy": s} for s in ("ddp", "zero1", "fsdp"))
    if offload and env.world_size > 1:
        yield {"strategy": "fsdp", "cpu_offload": True}
    if env.num_nodes > 1:
        yield {"strategy": "hsdp"}
    if importlib.util.find_spec("deepspeed") is not None:  # a plan the environment cannot run is no plan
        yield from ({"strategy": "deepspeed", "deepspeed_stage": stage} for stage in (1, 2, 3))


def _cp_ep(cfg: Config, prof: Profile, world: int) -> list[tuple[int, int]]:
    """(cp, ep) pairs to try: context parallel for a long sequence, expert parallel for a mixture of
    experts, each only where the config has the dimension (the trainer builds it)."""
    shape = prof.shape
    cps = [1]
    if hasattr(cfg.parallel, "cp") and shape is not None and shape.seq_len > LONG_SEQUENCE:
        cps += [c for c in (2, 4, 8) if world % c == 0 and shape.seq_len % (2 * c) == 0]
    eps = [1]
    if hasattr(cfg.parallel, "ep") and shape is not None and shape.experts > 1:
        eps += [e for e in _divisors(shape.experts) if 1 < e <= world and world % e == 0]
    return [(c, e) for c in cps for e in eps if c == 1 or e == 1]


def _heads_split(prof: Profile, tp: int) -> bool:
    return prof.shape is not None and prof.shape.heads % tp == 0 and prof.shape.kv % tp == 0


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n`` in order, found up to its square root (a global batch of 2^40 samples
    is a million trials, not a trillion); cached: the search asks for the same ones per layout."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return (*small, *(n // d for d in reversed(small) if d * d != n))


def _pipelines(probe: Candidate, micro: int, layers: int, virtual: int = 2) -> list[tuple[int, str]]:
    """(parallel.microbatches, pp_schedule) for a micro-step of ``micro`` samples: none without pp."""
    if probe.pp == 1:
        return [(1, "")]
    out = []
    for depth in PIPELINE_DEPTHS:
        m = depth * probe.pp
        if micro % m:
            continue
        for schedule in SCHEDULES:
            if schedule == "interleaved_1f1b" and layers < virtual * probe.pp:  # parallel.virtual_stages
                continue
            out.append((m, schedule))
    return out


def _modes(prof: Profile) -> tuple[str, ...]:
    return MODES if prof.block_params else ("none", "block")  # selective keeps matmul outputs: transformers


def _rejected(cfg: Config, prof: Profile, env: ClusterEnv, probe: Candidate, per_replica: int) -> str | None:
    """Why the trainer's rules refuse the layout, or None. A declared model is checked torch-free
    by the rules that read its shape; a measured one by the trainer's own checks (torch is loaded)."""
    layers, virtual = len(prof.block_params), cfg.parallel.virtual_stages
    micro = [m for m in _divisors(per_replica) if _pipelines(probe, m, layers, virtual)]
    if not micro:  # the micro-batches tried are multiples of pp (PIPELINE_DEPTHS), each of whole samples
        return (f"the {per_replica} samples per replica and step are not a multiple of parallel.pp={probe.pp} "
                f"(the pipeline's micro-batches are {probe.pp} x 1, 2, 4, ... samples)")
    first = _pipelines(probe, micro[0], layers, virtual)[0]
    quiet = replace(cfg, checkpoint=replace(cfg.checkpoint, enabled=False))  # no log line per probe
    try:
        runs = apply(quiet, replace(probe, micro_batch=micro[0], grad_accum=per_replica // micro[0],
                                    microbatches=first[0], schedule=first[1]))
        if prof.builtin or probe.strategy == "deepspeed":  # importing DeepSpeed to check it costs seconds
            _, topology = world_layout(runs, env)
            return _shape_rules(runs, prof, topology)
        make_layout(runs, env)
    except ConfigError as err:
        return str(err)
    return None


def _shape_rules(cfg: Config, prof: Profile, topology: Topology) -> str | None:
    """The strategies' own checks that a built-in transformer's shape answers (the trainer's
    make_layout runs them again on the chosen plan): head counts under tp, a tied embedding or
    too few blocks under pp, the combinations a strategy refuses (DeepSpeed's from its config
    alone: installed is checked by the search)."""
    p, shape = cfg.parallel, prof.shape
    if p.strategy == "deepspeed" and cfg.precision == "fp8":
        return "precision=fp8 is not available with parallel.strategy=deepspeed"
    check_experts(cfg.model, p)  # a mixture of experts runs with data and expert parallelism only
    if shape is None:
        return None
    if p.tp > 1 and cfg.precision == "fp16" and (topology.dp == 1 or p.strategy not in ("fsdp", "hsdp")):
        return f"precision=fp16 with parallel.tp={p.tp} needs data parallelism under fsdp or hsdp"
    if p.tp > 1 and cfg.train.compile and p.activation_checkpointing != "none":
        return f"parallel.tp={p.tp} with train.compile=true cannot checkpoint activations"
    if p.pp > 1:
        stages = p.pp * (p.virtual_stages if p.pp_schedule == "interleaved_1f1b" else 1)
        if shape.tied:
            return f"parallel.pp={p.pp}: the first and last stages cannot share the tied embedding"
        if shape.layers < stages:
            return f"parallel.pp={p.pp} makes {stages} pipeline stages, more than model.n_layers={shape.layers}"
        if cfg.train.compile or p.meta_init or not cfg.data.drop_last:
            return f"parallel.pp={p.pp} needs train.compile=false, parallel.meta_init=false and data.drop_last=true"
    cp = getattr(p, "cp", 1)
    if cp > 1 and (cfg.train.task not in ("auto", "causal_lm") or cfg.train.loss is not None or p.sequence_parallel
                   or cfg.model.use_model_loss or shape.seq_len % (2 * cp)):
        return (f"parallel.cp={cp} needs the causal-LM task's own loss, no sequence parallelism and model.seq_len "
                f"a multiple of {2 * cp}")
    if p.strategy == "zero1" and cfg.checkpoint.format == "dcp" and topology.world > 1 and cfg.checkpoint.enabled:
        return "parallel.strategy=zero1 checkpoints with checkpoint.format=torch"
    return None


def _best_of_layout(cfg: Config, prof: Profile, machine: Machine, probe: Candidate, mode: str,
                    per_replica: int) -> Candidate:
    """The fastest plan of one layout and checkpointing mode that fits, else the one needing the
    least memory. Memory grows and time falls with the micro-batch, so the largest micro-batch
    that fits is the fastest of each pipeline setting: found by bisection."""
    best: Candidate | None = None
    smallest: Candidate | None = None
    layers, virtual = len(prof.block_params), cfg.parallel.virtual_stages
    micros = [m for m in _divisors(per_replica) if _pipelines(probe, m, layers, virtual)]
    for pipeline in sorted({p for m in micros for p in _pipelines(probe, m, layers, virtual)}):
        options = [m for m in micros if pipeline in _pipelines(probe, m, layers, virtual)]

        made: dict[int, Candidate] = {}

        def make(m: int, pipeline: tuple[int, str] = pipeline, made: dict[int, Candidate] = made) -> Candidate:
            if m not in made:
                made[m] = _candidate(cfg, prof, machine, probe, mode, m, per_replica // m, pipeline)
            return made[m]

        low = make(options[0])
        if smallest is None or low.total < smallest.total:
            smallest = low
        if not low.fits:
            continue
        lo, hi = 0, len(options) - 1  # options[lo] fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if make(options[mid]).fits:
                lo = mid
            else:
                hi = mid - 1
        found = make(options[lo])
        if best is None or _rank(found) > _rank(best):
            best = found
    assert smallest is not None
    return best or smallest


def _rank(c: Candidate) -> tuple[bool, float, int, int, bool, int]:
    """Fits, then throughput; ties: less model parallelism, less sharding, no offload, less recompute."""
    return (c.fits, round(c.samples_per_s, 6), -c.tp * c.pp * c.cp * c.ep, -STRATEGIES.index(c.strategy),
            not c.cpu_offload, -MODES.index(c.checkpointing))


# ---------------------------------------------------------------- memory


def _candidate(cfg: Config, prof: Profile, machine: Machine, probe: Candidate, mode: str, micro: int, accum: int,
               pipeline: tuple[int, str]) -> Candidate:
    c = replace(probe, checkpointing=mode, micro_batch=micro, grad_accum=accum, microbatches=pipeline[0],
                schedule=pipeline[1])
    host = 0.0
    if prof.declared:
        declared = strategy_memory(memory_inputs(cfg, prof, machine, c))
        memory, host = _parts(declared), declared.offloaded
    else:
        memory = max((_measured_memory(cfg, prof, c, stage) for stage in range(c.pp)),
                     key=lambda row: sum(row.values()))
        if c.cpu_offload:  # the states the device does not hold live in the host's memory
            host = max(sum(_measured_memory(cfg, prof, replace(c, cpu_offload=False), stage)[part]
                           for part in ("params", "grads", "optimizer")) for stage in range(c.pp))
    seconds = _step_seconds(cfg, prof, machine, c)
    return replace(c, memory=memory, seconds=seconds, samples_per_s=micro * accum * c.dp / seconds,
                   fits=sum(memory.values()) <= machine.usable, host=host)


def memory_inputs(cfg: Config, prof: Profile, machine: Machine, c: Candidate) -> MemoryInputs:
    """The declaration's inputs for candidate ``c`` of the built-in transformer ``prof``."""
    assert prof.shape is not None
    p = cfg.parallel
    replicas = max(1, min(p.dp_replicate or machine_nodes(machine, c), c.dp)) if c.strategy == "hsdp" else 1
    topology = _topology(c, replicas)
    master = c.strategy == "deepspeed" and cfg.precision in ("bf16", "fp16")  # DeepSpeed's 16-bit optimizer
    return MemoryInputs(
        shape=prof.shape, topology=topology, strategy=c.strategy, deepspeed_stage=c.deepspeed_stage or 2,
        precision=cfg.precision, amp_layout="master" if master else "autocast",
        param_dtype_bytes=compute_bytes(resolve_param_dtype(p, cfg.precision)),
        reduce_dtype_bytes=4 if p.reduce_dtype == "fp32" else 2,
        optimizer_elements=optimizer_elements(cfg), micro_batch=c.micro_batch // c.microbatches,
        grad_accum=c.grad_accum, reduce_every_microstep=p.reduce_every_microstep,
        reshard_after_forward=p.reshard_after_forward, cpu_offload=c.cpu_offload,
        recompute=recompute_of(c.checkpointing), sequence_parallel=p.sequence_parallel and c.tp > 1,
        microbatches=c.microbatches, pp_schedule=c.schedule or "1f1b", attention=machine.attention,
        vocab_parallel=prof.vocab_parallel, loss_parallel=False,
        params=None if prof.builtin else float(prof.params))  # a measured model: its own count


def machine_nodes(machine: Machine, c: Candidate) -> int:
    """Nodes the candidate's ranks span (hsdp's replicas by default)."""
    return max(1, c.dp * c.tp * c.pp * c.cp // max(1, machine.local))


def _topology(c: Candidate, replicas: int) -> Topology:
    return Topology(pp=c.pp, dp_replicate=replicas, dp_shard=c.dp // replicas, tp=c.tp, cp=c.cp, ep=c.ep)


def declared_memory(cfg: Config, prof: Profile, machine: Machine, c: Candidate) -> dict[str, float]:
    """Bytes on the candidate's busiest rank, by part, from the strategies' declaration."""
    return _parts(strategy_memory(memory_inputs(cfg, prof, machine, c)))


def _parts(m: StrategyMemory) -> dict[str, float]:
    return {"params": m.weights, "grads": m.gradients, "optimizer": m.optimizer, "gathered": m.gathered,
            "pipeline": m.pipeline_held, "activations": m.activations, "recomputed": m.recomputed,
            "transient": m.transient}


def _stage_blocks(prof: Profile, pp: int, stage: int) -> range:
    if not prof.block_params:
        return range(0)
    counts = stage_layers(len(prof.block_params), pp)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def _stage_params(prof: Profile, tp: int, pp: int, stage: int) -> float:
    """Elements one rank of ``stage`` holds: its blocks (tp's share of the split Linears) and the ends it holds."""
    blocks = _stage_blocks(prof, pp, stage)
    held = sum(prof.block_params[i] - prof.block_split[i] * (1 - 1 / tp) for i in blocks)
    first, last = stage == 0, stage == pp - 1
    ends = first * prof.first_params + last * prof.last_params - (first and last) * prof.shared_params
    return held + ends / (tp if prof.vocab_parallel else 1)


@functools.lru_cache(maxsize=1024)
def _busiest(prof: Profile, tp: int, pp: int) -> tuple[float, int]:
    """(elements, blocks) of the pipeline stage that holds the most of each (a profile is hashed by
    identity: one search asks this for every candidate of a layout)."""
    return (max(_stage_params(prof, tp, pp, s) for s in range(pp)),
            max(len(_stage_blocks(prof, pp, s)) for s in range(pp)))


def _measured_memory(cfg: Config, prof: Profile, c: Candidate, stage: int) -> dict[str, float]:
    """A model without a declared shape: the estimator's sharding rules over its measured pieces."""
    e = prof.param_bytes
    layout = StateLayout("auto", e, e, e * int(optimizer_elements(cfg)), 0)
    strategy = "zero3" if c.strategy in ("hsdp", "deepspeed") and c.deepspeed_stage in (0, 3) else \
        {1: "zero1", 2: "zero2"}.get(c.deepspeed_stage, c.strategy)
    params = _stage_params(prof, c.tp, c.pp, stage)
    weights, grads, optimizer = states_per_rank(params, layout, strategy, c.dp)
    if c.cpu_offload:
        weights = grads = optimizer = 0.0
    if strategy in ("fsdp", "zero3") and c.dp > 1 and c.grad_accum > 1 and not cfg.parallel.reduce_every_microstep:
        grads = params * (4 if cfg.parallel.reduce_dtype == "fp32" else 2)  # whole until the last micro-step
    blocks = _stage_blocks(prof, c.pp, stage)
    gathered = 0.0
    if strategy in ("fsdp", "zero3") and c.dp > 1 and blocks:
        gather = compute_bytes(resolve_param_dtype(cfg.parallel, cfg.precision))
        gathered = PREFETCHED_LAYERS * max(prof.block_params[i] for i in blocks) / c.tp * (gather + e)
    return {"params": weights, "grads": grads, "optimizer": optimizer, "gathered": gathered,
            "activations": _measured_activations(cfg, prof, c, stage)}


def _tp_share(cfg: Config, prof: Profile, tp: int, mode: str) -> float:
    """Of a block's saved bytes, the share one tp rank keeps (Korthikanti et al.'s split)."""
    if tp == 1 or prof.shape is None:
        return 1.0
    kw = {"element_bytes": compute_bytes(cfg.precision), "recompute": recompute_of(mode),
          "sequence_parallel": cfg.parallel.sequence_parallel}
    return layer_bytes(prof.shape, 1, tp=tp, **kw) / layer_bytes(prof.shape, 1, tp=1, **kw)  # type: ignore[arg-type]


def _measured_activations(cfg: Config, prof: Profile, c: Candidate, stage: int) -> float:
    assert prof.saved is not None
    saved, full = prof.saved[c.checkpointing], prof.saved["none"]
    blocks = _stage_blocks(prof, c.pp, stage)
    per_sample = sum(saved.blocks[i] for i in blocks) * _tp_share(cfg, prof, c.tp, c.checkpointing)
    per_sample += (stage == 0) * saved.first + (stage == c.pp - 1) * saved.last
    one = c.micro_batch / c.microbatches
    in_flight = 1 if c.pp == 1 else c.microbatches if c.schedule == "gpipe" else min(c.pp - stage, c.microbatches)
    recompute = 0.0
    if c.checkpointing != "none" and blocks:  # the block being recomputed holds its full set during its backward
        recompute = max(full.blocks[i] for i in blocks) * _tp_share(cfg, prof, c.tp, "none") * one
    return per_sample * one * in_flight + recompute


# ---------------------------------------------------------------- time


def _step_seconds(cfg: Config, prof: Profile, machine: Machine, c: Candidate) -> float:
    samples = c.micro_batch * c.grad_accum
    compute = _stage_flops(prof, c) * samples / (c.tp * c.cp) / machine.flops
    steps = c.grad_accum * c.microbatches
    hooks = DEEPSPEED_HOOKS if c.strategy == "deepspeed" else 1.0
    overhead = steps * prof.modules / c.pp * MODULE_COST_S[machine.kind] * hooks
    virtual = cfg.parallel.virtual_stages if c.schedule == "interleaved_1f1b" else 1
    bubble = compute * (c.pp - 1) / (c.microbatches * virtual)
    return compute + overhead + bubble + _offload_seconds(cfg, prof, c) + \
        _exposed_comm(cfg, prof, machine, c, compute)


def _stage_flops(prof: Profile, c: Candidate) -> float:
    """FLOPs per sample of the slowest pipeline stage, which sets the pace: its blocks (with their
    recomputation) and, on the last, the head and loss (a large vocabulary makes it the heaviest)."""
    recompute = {"none": 0.0, "selective": SELECTIVE_SHARE / 3, "block": 1 / 3}[c.checkpointing]
    blocks = prof.block_flops_per_sample * (1 + recompute)
    ends = prof.flops_per_sample - prof.block_flops_per_sample
    if c.pp == 1 or not prof.block_params:
        return blocks + ends
    per_block = blocks / len(prof.block_params)
    counts = stage_layers(len(prof.block_params), c.pp)
    return max(n * per_block + (i == c.pp - 1) * ends for i, n in enumerate(counts))


def _offload_seconds(cfg: Config, prof: Profile, c: Candidate) -> float:
    """cpu offload: the shard's parameters up and gradients down each micro-step, and the host's
    optimizer step, none of it hidden."""
    if not c.cpu_offload:
        return 0.0
    shard = _busiest(prof, c.tp, c.pp)[0] / c.dp
    gather = compute_bytes(resolve_param_dtype(cfg.parallel, cfg.precision))
    return shard * (gather + 4) * c.grad_accum / HOST_LINK + shard / HOST_ADAM


def _dp_bytes(cfg: Config, prof: Profile, c: Candidate) -> float:
    """Bytes one rank's data-parallel collectives move per step (ring: 2(n-1)/n of an all-reduce)."""
    e = prof.param_bytes
    params = _busiest(prof, c.tp, c.pp)[0]
    ring = (c.dp - 1) / c.dp
    if c.strategy == "ddp":
        return 2 * ring * params * e
    if c.strategy == "zero1" or (c.strategy == "deepspeed" and c.deepspeed_stage < 3):
        return 3 * ring * params * e
    gather = compute_bytes(resolve_param_dtype(cfg.parallel, cfg.precision))
    passes = 2 if cfg.parallel.reshard_after_forward else 1
    reduces = c.grad_accum if cfg.parallel.reduce_every_microstep else 1  # reduce-scatters per step
    reduce = 4 if cfg.parallel.reduce_dtype == "fp32" else 2
    return ring * params * (passes * gather * c.grad_accum + reduces * reduce)


def _exposed_comm(cfg: Config, prof: Profile, machine: Machine, c: Candidate, compute: float) -> float:
    dp_link = machine.intra if c.dp * c.tp * c.pp * c.cp <= machine.local else machine.inter
    moved = _dp_bytes(cfg, prof, c)
    exposed = max(0.0, moved / dp_link - compute * 2 / 3)  # overlapped with the backward
    shape = prof.shape
    if shape is None:
        return exposed
    e = compute_bytes(cfg.precision)
    activation = shape.seq_len / c.cp * c.micro_batch * shape.hidden * e
    layers = _busiest(prof, c.tp, c.pp)[1]
    tp_time = 4 * 2 * (c.tp - 1) / c.tp * activation * layers * c.grad_accum / machine.intra
    # a stage's neighbour is dp x cp x tp ranks away (pp is the outermost dimension): across nodes once
    # the job spans more than one
    pp_link = machine.intra if c.dp * c.cp * c.tp * c.pp <= machine.local else machine.inter
    pp_time = (2 * activation * c.grad_accum / pp_link) if c.pp > 1 else 0.0
    # cp: each block all-gathers the keys and values of the group (forward) and reduce-scatters their
    # gradients (backward), half of it hidden behind attention
    kv = 2 * shape.seq_len * c.micro_batch * shape.kv_dim * e / c.tp
    cp_time = 2 * (c.cp - 1) / c.cp * kv * layers * c.grad_accum / machine.intra / 2
    # ep: each token's hidden state to its top_k experts' ranks and back, forward and backward
    ep_time = 4 * (c.ep - 1) / c.ep * activation * shape.top_k * layers * c.grad_accum / \
        (machine.intra if c.ep <= machine.local else machine.inter)
    return exposed + tp_time + pp_time + cp_time + ep_time


# ---------------------------------------------------------------- reporting


def size(nbytes: float) -> str:
    """Bytes for people: 1,580 GB, not 1.58e+03 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{sig3(nbytes / scale)} {unit}"
    return f"{nbytes:.0f} B"


def describe(c: Candidate) -> str:
    return (f"{c.label}, activation_checkpointing={c.checkpointing}, micro-batch {c.micro_batch} x "
            f"{c.grad_accum} micro-steps")


NO_LAYOUT_REASONS = 3  # distinct reasons a no-layout error shows (each once, with how many layouts it refused)


def _no_layout(cfg: Config, env: ClusterEnv, total: int, rejected: dict[str, str]) -> str:
    """One short line: each rule that refused layouts once (one example, and how many more it
    refused), not every layout's reason (33,697 characters for DeepSeek-V3 on 2,048 GPUs)."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for label, why in rejected.items():  # the same rule with other numbers is the same reason
        groups.setdefault(re.sub(r"\d+", "#", why), []).append((label, why))
    shown = []
    for rows in sorted(groups.values(), key=len, reverse=True)[:NO_LAYOUT_REASONS]:
        label, why = rows[0][0], rows[0][1].split("; hint:")[0]  # the rule alone: the hints are per layout
        more = f" (and {len(rows) - 1} more layouts alike)" if len(rows) > 1 else ""
        shown.append(f"{label}: {why}{more}")
    if len(groups) > NO_LAYOUT_REASONS:
        others = len(groups) - NO_LAYOUT_REASONS
        shown.append(f"{others} other reason{'s' if others > 1 else ''}")
    hint = ""
    if total % env.world_size:  # a batch every rank can share: the smallest multiple of the world above it
        better = -(-total // env.world_size) * env.world_size
        hint = (f"; hint: a global batch that is a multiple of the {env.world_size} ranks, e.g. "
                f"data.global_batch_size={better}")
    return (f"parallel.strategy=auto found no layout the trainer can run on {env.world_size} ranks with a global "
            f"batch of {total} samples: " + "; ".join(shown) + hint)


def _none_fits(cfg: Config, env: ClusterEnv, machine: Machine, candidates: list[Candidate]) -> str:
    """One message: what was given, the smallest need and what it is made of, and what would help."""
    smallest = min(candidates, key=lambda c: c.total)
    given = (f"parallel.memory_budget_gb={cfg.parallel.memory_budget_gb:g}" if cfg.parallel.memory_budget_gb
             is not None else f"the {machine.name}'s {size(machine.budget)}")
    parts = ", ".join(f"{k} {size(v)}" for k, v in sorted(smallest.memory.items(), key=lambda kv: -kv[1]) if v)
    need_gb = smallest.total / (1 - cfg.parallel.memory_margin) / 1e9
    helps = [f"a GPU with at least {sig3(need_gb)} GB (parallel.target_gpu, or parallel.memory_budget_gb)"]
    offload = [c for c in candidates if c.cpu_offload]
    if smallest.cpu_offload:
        helps.append("parallel.cpu_offload=true is in that need already (its states live in host memory)")
    elif offload:
        helps.append(f"parallel.cpu_offload=true (needs {size(min(c.total for c in offload))})")
    elif machine.kind == "cuda":
        helps.append("parallel.cpu_offload=true with parallel.strategy=fsdp (not possible in this layout)")
    helps.append(f"more ranks than {env.world_size} (fsdp shards the states over all of them)")
    if smallest.memory.get("activations", 0) > smallest.total / 4:
        helps.append("a smaller data.global_batch_size or model.seq_len (activations are "
                     f"{size(smallest.memory['activations'])})")
    return (f"parallel.strategy=auto: no plan fits {given} on {env.world_size} ranks ({size(machine.usable)} per "
            f"rank after parallel.memory_margin={cfg.parallel.memory_margin:g}); the smallest need is "
            f"{size(smallest.total)} per rank ({describe(smallest)}: {parts}); hint: " + "; or ".join(helps))


def candidate_rows(choice: Choice) -> list[dict[str, Any]]:
    """The table as data (``hpctrain plan --json``): every candidate, the chosen one marked; bytes
    as integers, rates rounded (no exponents)."""
    rows = []
    for c in choice.candidates:
        row = {k: v for k, v in asdict(c).items() if k not in ("memory", "seconds", "samples_per_s")}
        rate = c.samples_per_s * (choice.tokens_per_sample or 1)
        rows.append({**row, "label": c.label, "memory_bytes": {k: round(v) for k, v in c.memory.items()},
                     "total_bytes": round(c.total), "memory": size(c.total), "step_seconds": float(f"{c.seconds:.4g}"),
                     "samples_per_s": round(c.samples_per_s, 3), "chosen": c == choice.chosen,
                     "tokens_per_s": None if choice.tokens_per_sample is None else round(rate)})
    return rows


def assumed_line(choice: Choice, assumed: list[str] | tuple[str, ...] = ()) -> str:
    """The plan's second line: precision, optimizer (its fp32 states per parameter), where the
    global batch came from, and the keys taken by default (``hpctrain plan``'s LLM defaults)."""
    a = choice.assumptions()

    def said(key: str, value: str) -> str:
        return f"{key}={value}" + (" (not given: a language model's default)" if f"{key}={value}" in assumed else "")

    return (f"  assumes: {said('precision', a['precision'])}, {said('optim.name', a['optimizer'])} "
            f"({a['optimizer_state_elements']:g} fp32 states per parameter), global batch from {a['global_batch_from']}"
            f", micro-batch chosen per plan (data.batch_size; chosen: {a['micro_batch']})")


def host_line(choice: Choice) -> str | None:
    """cpu offload: the host memory the chosen plan's states take, per rank and per node."""
    c, m = choice.chosen, choice.machine
    if not c.cpu_offload:
        return None
    per_node = c.host * max(1, min(m.local, c.dp * c.tp * c.pp * c.cp))
    return (f"host memory (cpu offload): {size(c.host)} per rank, {size(per_node)} per node of {m.local} ranks "
            "(pinned CPU memory the node must have free)")


def render(choice: Choice, assumed: list[str] | tuple[str, ...] = ()) -> str:
    m, c = choice.machine, choice.chosen
    rate = "tokens/s" if choice.tokens_per_sample else "samples/s"
    scale = choice.tokens_per_sample or 1
    lines = [f"parallel.strategy=auto: {c.dp * c.tp * c.pp * c.cp} ranks ({m.local} per node), budget "
             f"{size(m.budget)} per rank on {m.name} ({size(m.usable)} usable, {m.attention} attention), global "
             f"batch {choice.global_batch}" + (f"; links: {m.intra_name} in a node, {m.network_name} between nodes"
                                               if m.intra_name else ""),
             assumed_line(choice, assumed),
             f"  {'plan':<26} {'checkpointing':<13} {'micro x accum':>13} {'memory/rank':>12} {'fits':>4} "
             f"{'est. ' + rate:>16}"]
    for row in choice.candidates:
        mark = "  <- chosen" if row == c else ""
        lines.append(f"  {row.label:<26} {row.checkpointing:<13} {f'{row.micro_batch} x {row.grad_accum}':>13} "
                     f"{size(row.total):>12} {'yes' if row.fits else 'no':>4} "
                     f"{row.samples_per_s * scale:>16,.0f}{mark}")
    lines += [f"  {label:<26} rejected: {why}" for label, why in choice.rejected.items()]
    lines.append(f"chosen: {describe(c)}: the highest estimated throughput of the "
                 f"{sum(r.fits for r in choice.candidates)} plans that fit; estimated {size(c.total)} per rank (" +
                 ", ".join(f"{k} {size(v)}" for k, v in c.memory.items() if v) + ")")
    host = host_line(choice)
    lines += [host] if host else []
    lines += [f"why: {line}" for line in _why(choice)]
    lines.append("config: " + " ".join([*overrides(c, choice.config, m), *assumed]))
    return "\n".join(lines)


def _why(choice: Choice) -> list[str]:
    """Context and expert parallelism explained where they were considered."""
    c, out = choice.chosen, []
    tried = {dim: any(getattr(r, dim) > 1 for r in choice.candidates) or
             any(word.startswith(dim) for label in choice.rejected for word in label.split()) for dim in ("cp", "ep")}
    if c.cp > 1:
        out.append(f"cp{c.cp}: the sequence is split over {c.cp} ranks, each keeping 1/{c.cp} of its activations, for "
                   "an all-gather of the keys and values in every block")
    elif tried["cp"]:
        out.append(f"context parallel was considered (sequences of {choice.tokens_per_sample:,} tokens) and not "
                   "chosen: the plan fits without it, and its key/value traffic costs more than the data-parallel "
                   "ranks it takes")
    if c.ep > 1:
        out.append(f"ep{c.ep}: each rank holds 1/{c.ep} of the experts; tokens reach them by all-to-all")
    elif tried["ep"]:
        out.append("expert parallel was considered (a mixture of experts) and not chosen: the experts fit sharded by "
                   "the data-parallel strategy, and its all-to-alls cost more than they save")
    return out


def overrides(c: Candidate, cfg: Config, machine: Machine | None = None) -> list[str]:
    """The chosen values as command-line keys (with the target machine, so the job plans alike)."""
    keys = [f"parallel.strategy={c.strategy}", f"parallel.tp={c.tp}", f"parallel.pp={c.pp}",
            f"parallel.activation_checkpointing={c.checkpointing}", f"data.batch_size={c.micro_batch}"]
    if c.strategy == "deepspeed":
        keys.append(f"parallel.deepspeed_stage={c.deepspeed_stage}")
    if c.cpu_offload:
        keys.append("parallel.cpu_offload=true")
    if c.pp > 1:
        keys += [f"parallel.microbatches={c.microbatches}", f"parallel.pp_schedule={c.schedule}"]
    keys += [f"parallel.{dim}={getattr(c, dim)}" for dim in ("cp", "ep") if getattr(c, dim) > 1]
    keys += [] if cfg.data.global_batch_size is not None else [f"train.grad_accum={c.grad_accum}"]
    if machine is not None and machine.target is not None:  # the machine, as the job must name it to agree
        p = cfg.parallel
        keys.append(f"parallel.target_gpu={machine.target}")
        keys += [f"parallel.{key}={getattr(p, key):g}" for key in ("memory_budget_gb", "target_peak_tflops")
                 if getattr(p, key) is not None]
    return keys
