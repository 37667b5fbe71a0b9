"""``parallel.strategy=auto`` (and ``hpctrain plan``, :mod:`hpctrain.cli.plan`): choose strategy,
tp, pp, activation checkpointing and micro-batch for this world, before anything is built.

The model is measured on the meta device (:mod:`hpctrain.planning.autosize`). Every layout
the model allows (ddp, zero1, fsdp over all ranks; tp and pp within a node for a model with
transformer blocks, fsdp over the remaining data-parallel ranks) is tried with every
activation-checkpointing mode and every micro-batch that keeps the global batch; the trainer's
own checks (:func:`hpctrain.planning.layout.make_layout`) reject what it cannot run. Each candidate
gets an estimate of the memory of its busiest rank and of its throughput; the fastest one
whose estimate fits ``budget x (1 - parallel.memory_margin)`` is chosen, and its values
replace ``auto`` in the config (so config.yaml records them).

Memory of one rank (its largest pipeline stage): parameters, gradients (their own dtype,
tensor-parallel Linears divided by tp) and optimizer state (AdamW 2, SGD with momentum 1
element per parameter; another optimizer is taken as AdamW), sharded by the estimator's rules
(:func:`hpctrain.estimate.gpu_memory.states_per_rank`: zero1 the optimizer state, fsdp all three);
under fsdp two blocks gathered unsharded with their gradients; the activations measured per
sample, times the samples in flight (a pipeline stage's micro-batches under its schedule),
split by tp as Korthikanti et al.'s formula splits them (:mod:`hpctrain.estimate.activations`),
plus, under checkpointing, one block's full activations while it is recomputed.

Time of one optimizer step (a simple cost model, to rank the candidates, not to predict a run):
the counted FLOPs of the rank's share at a nominal device rate (the estimator's peak table for
a known GPU at 40% utilisation; a nominal 50 GFLOP/s for a CPU rank), plus block
checkpointing's second forward, plus a fixed cost per module per micro-step (kernel launches,
Python), plus the pipeline bubble ((pp - 1) / micro-batches of the compute), plus the
communication: tensor-parallel all-reduces (4 per block per micro-step) and pipeline sends on
the critical path, data-parallel collectives (DDP's all-reduce; ZeRO-1's also the parameters;
FSDP's two all-gathers per micro-step and a reduce-scatter) only where they outlast the
backward they overlap with. Ring collectives move 2(n-1)/n of the bytes; bandwidths are
nominal (NVLink 150 GB/s and 20 GB/s between nodes on GPUs, 2 GB/s for gloo on a CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from hpctrain.config.parallel import AUTO, resolve_param_dtype
from hpctrain.core.section import ConfigError
from hpctrain.estimate.activations import layer_bytes
from hpctrain.estimate.gpu_memory import PREFETCHED_LAYERS, StateLayout, compute_bytes, states_per_rank
from hpctrain.estimate.model import stage_layers
from hpctrain.estimate.render import sig3
from hpctrain.planning.layout import make_layout
from hpctrain.telemetry.accelerators import ACCELERATORS

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.core.env import ClusterEnv
    from hpctrain.planning.autosize import Profile

log = logging.getLogger("hpctrain")

STRATEGIES = ("ddp", "zero1", "fsdp")  # over the data-parallel ranks alone; tp / pp take fsdp (ddp at dp=1)
_RECOMPUTE = {"none": "none", "selective": "selective", "block": "full"}  # the estimator's names
SELECTIVE_SHARE = 0.1  # selective recompute redoes the element-wise ops: taken as 10% of the blocks' forward
MODULE_COST_S = {"cuda": 10e-6, "cpu": 30e-6}  # per module per micro-step (forward + backward launches)


@dataclass(frozen=True)
class Machine:
    """What one rank has: memory budget, a nominal compute rate and link bandwidths (bytes/s)."""

    kind: str  # cuda | cpu
    name: str
    budget: float  # bytes
    usable: float  # bytes: budget less the margin
    flops: float  # sustained FLOP/s assumed
    intra: float
    inter: float
    local: int  # ranks per node: data parallelism within them uses the fast link


@dataclass(frozen=True)
class Candidate:
    strategy: str
    tp: int
    pp: int
    dp: int
    checkpointing: str
    micro_batch: int
    grad_accum: int
    memory: dict[str, float]  # bytes on the busiest rank: params, grads, optimizer, gathered, activations
    seconds: float  # per optimizer step
    samples_per_s: float
    fits: bool

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    @property
    def label(self) -> str:
        parts = [f"{self.strategy} dp{self.dp}"] if self.dp > 1 else []
        parts += [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp)) if v > 1]
        return " ".join(parts) or self.strategy


@dataclass(frozen=True)
class Choice:
    config: Config
    chosen: Candidate
    candidates: list[Candidate]  # the best micro-batch of each layout and checkpointing mode
    rejected: dict[str, str]  # layout -> why the trainer cannot run it
    machine: Machine
    global_batch: int
    tokens_per_sample: int | None


# ---------------------------------------------------------------- entry points


def resolve_auto(cfg: Config, env: ClusterEnv) -> Config:
    """``cfg`` with ``parallel.strategy=auto`` replaced by the chosen plan's values (and the
    table logged on the main rank); any other config unchanged."""
    if cfg.parallel.strategy != AUTO:
        return cfg
    choice = choose(cfg, env)
    if env.is_main:
        for line in render(choice).splitlines():
            log.info("%s", line)
    return choice.config


def choose(cfg: Config, env: ClusterEnv) -> Choice:
    """The fastest candidate that fits; ConfigError (exit 2) naming the smallest need when none does."""
    from hpctrain.planning.autosize import profile  # torch: loaded only when auto is asked for

    prof = profile(cfg)
    machine = detect_machine(cfg, env)
    total = global_batch(cfg, env.world_size)
    candidates: list[Candidate] = []
    rejected: dict[str, str] = {}
    for strategy, tp, pp in layouts(prof, env):
        dp = env.world_size // (tp * pp)
        why = _rejected(cfg, env, strategy, tp, pp, total // dp)
        if why is not None:
            rejected[Candidate(strategy, tp, pp, dp, "", 0, 0, {}, 0, 0, False).label] = why
            continue
        for mode in _modes(cfg, prof):
            options = [_candidate(cfg, prof, machine, strategy, tp, pp, dp, mode, m, total // dp // m)
                       for m in micro_batches(total // dp, pp, cfg.parallel.microbatches)]
            candidates.append(_best(options))
    if not candidates:
        raise ConfigError(f"parallel.strategy=auto found no layout the trainer can run on {env.world_size} ranks: "
                          + "; ".join(f"{k}: {v}" for k, v in rejected.items()))
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise ConfigError(_none_fits(cfg, env, machine, min(candidates, key=lambda c: c.total)))
    chosen = max(fitting, key=_rank)
    return Choice(apply(cfg, chosen), chosen, sorted(candidates, key=_rank, reverse=True), rejected, machine,
                  total, prof.tokens_per_sample)


def apply(cfg: Config, c: Candidate) -> Config:
    """``cfg`` as the candidate runs it, written as a user would: the chosen parallel keys, and the
    micro-batch as ``data.batch_size`` (with ``data.global_batch_size`` kept, or ``train.grad_accum``)."""
    parallel = replace(cfg.parallel, strategy=c.strategy, tp=c.tp, pp=c.pp, dp=0,
                       activation_checkpointing=c.checkpointing)  # type: ignore[arg-type]
    data = replace(cfg.data, batch_size=c.micro_batch)
    accum = 1 if cfg.data.global_batch_size is not None else c.grad_accum
    return replace(cfg, parallel=parallel, data=data, train=replace(cfg.train, grad_accum=accum))


# ---------------------------------------------------------------- the search space


def global_batch(cfg: Config, world_size: int) -> int:
    """Samples per optimizer step that every candidate keeps: ``data.global_batch_size``, else what
    ``data.batch_size`` x ``train.grad_accum`` gives on every rank as plain data parallelism."""
    return cfg.data.global_batch_size or cfg.data.batch_size * cfg.train.grad_accum * world_size


def layouts(prof: Profile, env: ClusterEnv) -> Iterator[tuple[str, int, int]]:
    """(strategy, tp, pp): data parallelism over every rank, then tp x pp splits (tp within a node)."""
    for strategy in STRATEGIES:
        yield strategy, 1, 1
    if not prof.block_params:
        return
    for tp in _divisors(env.world_size):
        if tp > 1 and not (prof.tensor_parallel and tp <= env.local_world_size and _heads_split(prof, tp)):
            continue
        for pp in _divisors(env.world_size // tp):
            if tp * pp > 1 and pp <= len(prof.block_params):
                yield ("fsdp" if env.world_size > tp * pp else "ddp"), tp, pp


def _heads_split(prof: Profile, tp: int) -> bool:
    return prof.shape is not None and prof.shape.heads % tp == 0 and prof.shape.kv % tp == 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batches(per_replica: int, pp: int, pipeline_microbatches: int) -> list[int]:
    """Micro-batches that divide the replica's samples per step; a pipeline also splits each into
    ``parallel.microbatches``."""
    step = pipeline_microbatches if pp > 1 else 1
    return [m for m in _divisors(per_replica) if m % step == 0]


def _modes(cfg: Config, prof: Profile) -> tuple[str, ...]:
    from hpctrain.planning.autosize import MODES  # torch: loaded only when auto is asked for

    return MODES if prof.block_params else ("none", "block")  # selective keeps matmul outputs: transformers


def _rejected(cfg: Config, env: ClusterEnv, strategy: str, tp: int, pp: int, per_replica: int) -> str | None:
    """Why the trainer's own checks refuse the layout (a tied embedding under pp, ...), or None."""
    micro = micro_batches(per_replica, pp, cfg.parallel.microbatches)
    if not micro:
        return (f"the {per_replica} samples per replica and step do not split into parallel.microbatches="
                f"{cfg.parallel.microbatches}")
    probe = Candidate(strategy, tp, pp, env.world_size // (tp * pp), "none", micro[0], per_replica // micro[0],
                      {}, 0, 0, False)
    quiet = replace(cfg, checkpoint=replace(cfg.checkpoint, enabled=False))  # no log line per probe
    try:
        make_layout(apply(quiet, probe), env)
    except ConfigError as err:
        return str(err)
    return None


def _best(options: list[Candidate]) -> Candidate:
    """The fastest micro-batch that fits, else the one needing the least memory."""
    fitting = [c for c in options if c.fits]
    return max(fitting, key=_rank) if fitting else min(options, key=lambda c: c.total)


def _rank(c: Candidate) -> tuple[bool, float, int, int, int]:
    """Fits, then throughput; ties: less model parallelism, less sharding, less recompute."""
    return (c.fits, round(c.samples_per_s, 6), -c.tp * c.pp, -STRATEGIES.index(c.strategy),
            -("none", "selective", "block").index(c.checkpointing))


# ---------------------------------------------------------------- memory and time


def _candidate(cfg: Config, prof: Profile, machine: Machine, strategy: str, tp: int, pp: int, dp: int, mode: str,
               micro: int, accum: int) -> Candidate:
    memory = max((_stage_memory(cfg, prof, strategy, tp, pp, dp, mode, micro, stage, accum) for stage in range(pp)),
                 key=lambda row: sum(row.values()))
    seconds = _step_seconds(cfg, prof, machine, strategy, tp, pp, dp, mode, micro, accum)
    return Candidate(strategy, tp, pp, dp, mode, micro, accum, memory, seconds, micro * accum * dp / seconds,
                     sum(memory.values()) <= machine.usable)


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
    return held + first * prof.first_params + last * prof.last_params - (first and last) * prof.shared_params


def _optimizer_elements(cfg: Config) -> int:
    """Optimizer state per parameter, in parameter elements: AdamW's two moments, SGD's momentum."""
    if cfg.optim.name == "sgd":
        return 1 if cfg.optim.momentum else 0
    return 2


def _stage_memory(cfg: Config, prof: Profile, strategy: str, tp: int, pp: int, dp: int, mode: str, micro: int,
                  stage: int, accum: int = 1) -> dict[str, float]:
    e = prof.param_bytes
    layout = StateLayout("auto", e, e, e * _optimizer_elements(cfg), 0)
    weights, grads, optimizer = states_per_rank(_stage_params(prof, tp, pp, stage), layout, strategy, dp)
    if strategy == "fsdp" and dp > 1 and accum > 1 and not cfg.parallel.reduce_every_microstep:
        # inner micro-steps skip the reduce-scatter: whole gradients, in the reduce dtype, until the last
        grads = _stage_params(prof, tp, pp, stage) * (4 if cfg.parallel.reduce_dtype == "fp32" else 2)
    blocks = _stage_blocks(prof, pp, stage)
    gathered = 0.0
    if strategy == "fsdp" and dp > 1 and blocks:
        gather = compute_bytes(resolve_param_dtype(cfg.parallel, cfg.precision))
        gathered = PREFETCHED_LAYERS * max(prof.block_params[i] for i in blocks) / tp * (gather + e)
    return {"params": weights, "grads": grads, "optimizer": optimizer, "gathered": gathered,
            "activations": _stage_activations(cfg, prof, tp, pp, mode, micro, stage)}


def _tp_share(cfg: Config, prof: Profile, tp: int, mode: str) -> float:
    """Of a block's saved bytes, the share one tp rank keeps (Korthikanti et al.'s split)."""
    if tp == 1 or prof.shape is None:
        return 1.0
    kw = {"element_bytes": compute_bytes(cfg.precision), "recompute": _RECOMPUTE[mode],
          "sequence_parallel": cfg.parallel.sequence_parallel}
    return layer_bytes(prof.shape, 1, tp=tp, **kw) / layer_bytes(prof.shape, 1, tp=1, **kw)  # type: ignore[arg-type]


def _stage_activations(cfg: Config, prof: Profile, tp: int, pp: int, mode: str, micro: int, stage: int) -> float:
    saved, full = prof.saved[mode], prof.saved["none"]
    blocks = _stage_blocks(prof, pp, stage)
    per_sample = sum(saved.blocks[i] for i in blocks) * _tp_share(cfg, prof, tp, mode)
    per_sample += (stage == 0) * saved.first + (stage == pp - 1) * saved.last
    samples = micro * _in_flight(cfg, pp, stage) / (cfg.parallel.microbatches if pp > 1 else 1)
    recompute = 0.0
    if mode != "none" and blocks:  # the block being recomputed holds its full set during its backward
        one = micro / (cfg.parallel.microbatches if pp > 1 else 1)
        recompute = max(full.blocks[i] for i in blocks) * _tp_share(cfg, prof, tp, "none") * one
    return per_sample * samples + recompute


def _in_flight(cfg: Config, pp: int, stage: int) -> int:
    """Pipeline micro-batches a stage holds activations for: all of them under GPipe, at most
    ``pp - stage`` under 1F1B (interleaved taken alike)."""
    if pp == 1:
        return 1
    m = cfg.parallel.microbatches
    return m if cfg.parallel.pp_schedule == "gpipe" else min(pp - stage, m)


def _step_seconds(cfg: Config, prof: Profile, machine: Machine, strategy: str, tp: int, pp: int, dp: int,
                  mode: str, micro: int, accum: int) -> float:
    samples = micro * accum
    recompute = {"none": 0.0, "selective": SELECTIVE_SHARE / 3, "block": 1 / 3}[mode] * prof.block_flops_per_sample
    compute = (prof.flops_per_sample + recompute) * samples / (tp * pp) / machine.flops
    pipeline_steps = cfg.parallel.microbatches if pp > 1 else 1
    overhead = accum * pipeline_steps * prof.modules / pp * MODULE_COST_S[machine.kind]
    bubble = compute * (pp - 1) / pipeline_steps
    return compute + overhead + bubble + _exposed_comm(cfg, prof, machine, strategy, tp, pp, dp, micro, accum,
                                                       compute)


def _exposed_comm(cfg: Config, prof: Profile, machine: Machine, strategy: str, tp: int, pp: int, dp: int,
                  micro: int, accum: int, compute: float) -> float:
    e = prof.param_bytes
    params = max(_stage_params(prof, tp, pp, s) for s in range(pp))
    ring = (dp - 1) / dp
    if strategy == "ddp":
        moved = 2 * ring * params * e
    elif strategy == "zero1":
        moved = 3 * ring * params * e
    else:
        gather = compute_bytes(resolve_param_dtype(cfg.parallel, cfg.precision))
        passes = 2 if cfg.parallel.reshard_after_forward else 1
        reduces = accum if cfg.parallel.reduce_every_microstep else 1  # reduce-scatters per step
        moved = ring * params * (passes * gather * accum + reduces * (4 if cfg.parallel.reduce_dtype == "fp32" else 2))
    dp_link = machine.intra if dp * tp * pp <= machine.local else machine.inter
    exposed = max(0.0, moved / dp_link - compute * 2 / 3)  # overlapped with the backward
    shape = prof.shape
    if shape is None:
        return exposed
    activation = shape.seq_len * micro * shape.hidden * compute_bytes(cfg.precision)
    layers = max(len(_stage_blocks(prof, pp, s)) for s in range(pp))
    tp_time = 4 * 2 * (tp - 1) / tp * activation * layers * accum / machine.intra
    pp_time = (2 * activation * accum / machine.intra) if pp > 1 else 0.0
    return exposed + tp_time + pp_time


def detect_machine(cfg: Config, env: ClusterEnv) -> Machine:
    """The budget (``parallel.memory_budget_gb``, else the GPU's total memory) and nominal rates."""
    import torch

    budget_gb = cfg.parallel.memory_budget_gb
    margin = 1 - cfg.parallel.memory_margin
    if torch.cuda.is_available():  # the trainer's device
        index = env.local_rank % torch.cuda.device_count()
        props = torch.cuda.get_device_properties(index)
        budget = budget_gb * 1e9 if budget_gb is not None else float(props.total_memory)
        return Machine("cuda", props.name, budget, budget * margin, _gpu_flops(props.name, cfg.precision),
                       150e9, 20e9, env.local_world_size)
    if budget_gb is None:
        raise ConfigError("parallel.strategy=auto on CPU needs parallel.memory_budget_gb (the memory one rank may "
                          "use, in GB); hint: parallel.memory_budget_gb=8")
    return Machine("cpu", "cpu", budget_gb * 1e9, budget_gb * 1e9 * margin, 50e9, 2e9, 2e9, env.local_world_size)


def _gpu_flops(name: str, precision: str) -> float:
    """40% of the estimator's dense peak for a GPU it knows (the estimator's default MFU), else 100 TFLOP/s."""
    key = next((k for k in ACCELERATORS if k.split("-")[0] in name.lower()), None)
    if key is None:
        return 100e12
    peak = ACCELERATORS[key].tflops.get(precision if precision in ("bf16", "fp16") else "fp32")
    return 100e12 if peak is None else 0.4 * peak * 1e12  # None: no such path (bf16 on a V100)


# ---------------------------------------------------------------- reporting


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{sig3(nbytes / scale)} {unit}"  # 1,580 GB, not 1.58e+03 GB
    return f"{nbytes:.0f} B"


def _what(c: Candidate) -> str:
    return (f"{c.label}, activation_checkpointing={c.checkpointing}, micro-batch {c.micro_batch} x "
            f"{c.grad_accum} micro-steps")


def _none_fits(cfg: Config, env: ClusterEnv, machine: Machine, smallest: Candidate) -> str:
    given = (f"parallel.memory_budget_gb={cfg.parallel.memory_budget_gb:g}" if cfg.parallel.memory_budget_gb
             is not None else f"the {machine.name}'s {_size(machine.budget)}")
    return (f"parallel.strategy=auto: no plan fits {given} on {env.world_size} ranks ({_size(machine.usable)} per "
            f"rank after parallel.memory_margin={cfg.parallel.memory_margin:g}); the smallest need is "
            f"{_size(smallest.total)} per rank ({_what(smallest)}); hint: raise parallel.memory_budget_gb, use more "
            "ranks, or a smaller model or model.seq_len")


def candidate_rows(choice: Choice) -> list[dict[str, Any]]:
    """The table as data (``hpctrain plan --json``): every candidate, the chosen one marked."""
    rows = []
    for c in choice.candidates:
        row = {k: v for k, v in asdict(c).items() if k != "memory"}
        rows.append({**row, "memory_bytes": c.memory, "total_bytes": c.total, "chosen": c == choice.chosen,
                     "tokens_per_s": None if choice.tokens_per_sample is None
                     else c.samples_per_s * choice.tokens_per_sample})
    return rows


def render(choice: Choice) -> str:
    m, c = choice.machine, choice.chosen
    rate = "tokens/s" if choice.tokens_per_sample else "samples/s"
    scale = choice.tokens_per_sample or 1
    lines = [f"parallel.strategy=auto: {c.dp * c.tp * c.pp} ranks ({m.local} per node), budget {_size(m.budget)} "
             f"per rank on {m.name} ({_size(m.usable)} usable), global batch {choice.global_batch}",
             f"  {'plan':<16} {'checkpointing':<13} {'micro x accum':>13} {'memory/rank':>12} {'fits':>4} "
             f"{'est. ' + rate:>16}"]
    for row in choice.candidates:
        mark = "  <- chosen" if row == c else ""
        lines.append(f"  {row.label:<16} {row.checkpointing:<13} {f'{row.micro_batch} x {row.grad_accum}':>13} "
                     f"{_size(row.total):>12} {'yes' if row.fits else 'no':>4} "
                     f"{row.samples_per_s * scale:>16,.0f}{mark}")
    lines += [f"  {label:<16} rejected: {why}" for label, why in choice.rejected.items()]
    lines.append(f"chosen: {_what(c)}: the highest estimated throughput of the {sum(r.fits for r in choice.candidates)}"
                 f" plans that fit; estimated {_size(c.total)} per rank (" +
                 ", ".join(f"{k} {_size(v)}" for k, v in c.memory.items() if v) + ")")
    lines.append("config: " + " ".join(overrides(c, choice.config)))
    return "\n".join(lines)


def overrides(c: Candidate, cfg: Config) -> list[str]:
    """The chosen values as command-line keys."""
    keys = [f"parallel.strategy={c.strategy}", f"parallel.tp={c.tp}", f"parallel.pp={c.pp}",
            f"parallel.activation_checkpointing={c.checkpointing}", f"data.batch_size={c.micro_batch}"]
    return keys + ([] if cfg.data.global_batch_size is not None else [f"train.grad_accum={c.grad_accum}"])
