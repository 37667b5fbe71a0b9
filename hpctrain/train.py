"""The reference training loop behind ``hpctrain train``, built only from the parts:
env -> data -> model -> parallel -> precision -> optim -> evaluate -> run dir."""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from hpctrain.checkpoint import Checkpointer
from hpctrain.checkpoint.preempt import Preempted, SignalFlag, signal_names
from hpctrain.checkpoint.state import Counters
from hpctrain.config import Config, ConfigError, to_yaml
from hpctrain.config.mix import data_text
from hpctrain.core import env as cluster
from hpctrain.core import protocol
from hpctrain.core.atomic import atomic_write_text, write_json
from hpctrain.core.protocol import write_status
from hpctrain.core.run_lock import RunDirLock
from hpctrain.core.rundir import (
    SUMMARY,
    RunDirError,
    check_run_dir,
    failure_recorded,
    finished_run_error,
    missing_dirs,
    prepare_run_dir_together,
    remove_empty_dirs,
    reopen_finished_run,
    resolve_run_dir,
)
from hpctrain.core.section import to_dict
from hpctrain.data import Batch, DataBundle, EvalBatches, TrainLoader, build_data, eval_batch_size
from hpctrain.data.batch import main_input
from hpctrain.data.mixture import mix_row, mix_summary
from hpctrain.data.user import bound_stream
from hpctrain.estimate.strategy_memory import run_breakdown
from hpctrain.evaluation.evaluate import EvalResult
from hpctrain.launch.rank import first_cause
from hpctrain.models.moe import expert_load, expert_summary
from hpctrain.models.registry import resolve_num_classes
from hpctrain.optim import build_optimizer, build_scheduler, epoch_over, peak_lr
from hpctrain.parallel import checkpoint_formats  # noqa: F401  # every format's view, for resume's format check
from hpctrain.parallel.base import Strategy
from hpctrain.parallel.clip import clip_grads, grad_norm, local_grad_norm
from hpctrain.planning.auto import resolve_auto
from hpctrain.planning.layout import RunLayout, build_strategy, make_layout
from hpctrain.precision import LateRead, NumericsWatch, Precision, local_max_abs
from hpctrain.tasks import Classification, Task, data_targets, resolve_task, training_loss
from hpctrain.tasks.inputs import build_task_model
from hpctrain.tasks.metrics import Metric, user_metrics
from hpctrain.telemetry.loop import Telemetry
from hpctrain.telemetry.meter import BACKWARD, CKPT, DATA, EVAL, FORWARD, OPTIM, OTHER
from hpctrain.weights import save_model_streamed
from hpctrain.weights.model import Digests

log = logging.getLogger("hpctrain")


@dataclass
class Components:
    """Everything the loop needs; built by :func:`build_components` or by hand. The strategy
    owns model, optimizer, schedule and precision (hpctrain.parallel.base.Strategy)."""

    strategy: Strategy
    train_loader: TrainLoader
    val_loader: EvalBatches | None
    metrics: list[Metric]
    layout: RunLayout
    counters: Counters = field(default_factory=Counters)
    task: Task = field(default_factory=Classification)  # split, loss and metrics (hpctrain.tasks)

    @property
    def model(self) -> nn.Module:
        return self.strategy.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        assert self.strategy.optimizer is not None, "strategy.setup() first"
        return self.strategy.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        return self.strategy.scheduler

    @property
    def precision(self) -> Precision:
        return self.strategy.precision

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint saves, as Stateful objects by name (hpctrain.checkpoint.Checkpointer)."""
        return {"model": self.strategy.checkpoint_state(), "scheduler": self.scheduler, "scaler": self.precision,
                "counters": self.counters, "loader": self.train_loader}


@dataclass
class LoopResult:
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    last_eval: EvalResult | None = None
    last_eval_step: int = -1
    best: dict[str, Any] = field(default_factory=dict)
    preempted: bool = False  # stopped by a signal after a committed checkpoint
    numerics: dict[str, Any] = field(default_factory=dict)  # non-finite steps (NumericsWatch.summary)
    telemetry: dict[str, Any] = field(default_factory=dict)  # the meter's run means, stragglers, top ops


# ---------------------------------------------------------------- set-up


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def configure_runtime(cfg: Config, env: cluster.ClusterEnv) -> None:
    # the CPUs this process may run on (a Slurm step binds each task to its --cpus-per-task), not the node's
    threads = cfg.train.threads or max(1, len(os.sched_getaffinity(0)) // env.local_world_size)
    torch.set_num_threads(threads)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def total_steps(cfg: Config, batches_per_epoch: int) -> int:
    per_epoch = batches_per_epoch // cfg.train.grad_accum
    steps = per_epoch * cfg.train.epochs
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps else steps


def load_data(cfg: Config, env: cluster.ClusterEnv, device: torch.device, *, with_val: bool = True) -> DataBundle:
    """The run's data, as ``env`` (the run layout's data view: one rank per data-parallel replica) sees it."""
    return build_data(cfg.data, env, device, seed=cfg.seed, seq_len=cfg.model.seq_len,
                      num_classes=cfg.model.num_classes or None, with_val=with_val,
                      targets=data_targets(cfg.train.task, cfg.train.loss))


def build_components(cfg: Config, env: cluster.ClusterEnv, device: torch.device, data: DataBundle,
                     layout: RunLayout | None = None) -> Components:
    """``cfg`` as this world size runs it and its ``layout`` (both from
    :func:`hpctrain.planning.layout.make_layout`; computed here when not given)."""
    if layout is None:
        resolved, layout = make_layout(cfg, env)
        if (resolved.data.batch_size, resolved.train.grad_accum) != (cfg.data.batch_size, cfg.train.grad_accum):
            raise ConfigError(f"data.global_batch_size={cfg.data.global_batch_size} needs the per-rank split first; "
                              "hint: cfg, layout = hpctrain.planning.layout.make_layout(cfg, env) before build_data")
    task = resolve_task(cfg.train.task, data.task, cfg.data.name, loss=cfg.train.loss,
                        class_targets=data.class_targets)
    num_classes = resolve_num_classes(cfg.model, data.num_classes, data.input_shape, data.input_dtype, cfg.data.name)

    def factory() -> nn.Module:  # dict inputs reach the model as model(**inputs) (hpctrain.tasks.inputs)
        return build_task_model(task, cfg.model.name, num_classes, data.input_shape, data.input_dtype, cfg.model)

    strategy = build_strategy(layout, env, device, cfg.parallel, precision=cfg.precision,
                              compile=cfg.train.compile, seed=cfg.seed, clip_grad_norm=cfg.train.clip_grad_norm)
    if loop_clips(strategy):
        strategy.max_norm = None  # the loop clips (Loop.clip): the clip's norm is also the non-finite watch's
    # a stream without __len__: one epoch of train.max_steps (refused without it)
    data.train_size = bound_stream(data.train_loader, cfg.train.max_steps, cfg.train.grad_accum) or data.train_size
    steps = total_steps(cfg, len(data.train_loader))
    needs_schedule = cfg.optim.schedule != "constant" or cfg.optim.warmup_steps > 0
    lr = peak_lr(cfg.optim, layout.global_batch)
    # seeded: identical initial weights on every rank (under parallel.meta_init, rank 0's, scattered)
    epoch_end = epoch_over(data.train_loader, cfg.train.grad_accum)  # optim.schedule_interval=epoch steps there
    strategy.setup(factory, loss_fn=training_loss(task, cfg.train.loss),
                   make_optimizer=lambda model: build_optimizer(model, cfg.optim, lr),
                   make_scheduler=lambda opt: build_scheduler(opt, cfg.optim, steps, epoch_end)
                   if needs_schedule else None)
    metrics = [*task.metrics(num_classes), *user_metrics(cfg.train.metrics)]  # train.metrics: the user's, by path
    return Components(strategy, data.train_loader, data.val_loader, metrics, layout, task=task)


def loop_clips(strategy: Strategy) -> bool:
    """Does the loop clip for ``strategy`` (train.clip_grad_norm)? Where its step is the base one
    (clip, step, zero, schedule), the loop computes the clip's norm itself, judges the step by it
    (train.nonfinite) and clips with it: one pass over the gradients. Not where the strategy clips
    its own way (pipeline stages sum their norms; DeepSpeed's engine clips), nor under fp16 (the
    grad scaler unscales inside the step, after the judgement)."""
    kind = type(strategy)
    return (kind.optimizer_step is Strategy.optimizer_step and kind.clip_grad_norm is Strategy.clip_grad_norm
            and strategy.precision_mode != "fp16")


# ---------------------------------------------------------------- the loop


@dataclass
class Loop:
    """One run's loop state, handed whole to each phase of the loop."""

    cfg: Config
    env: cluster.ClusterEnv
    device: torch.device
    parts: Components
    tel: Telemetry
    ckpt: Checkpointer | None = None
    result: LoopResult = field(default_factory=LoopResult)
    steps_goal: int = 0  # optimizer steps of the whole run

    def __post_init__(self) -> None:
        self.forward_done = functools.partial(self.tel.meter.lap, FORWARD)  # bound once: the hot path
        train = self.cfg.train
        if train.nonfinite == "skip" and self.parts.strategy.steps_in_engine:
            raise ConfigError("train.nonfinite=skip needs the loop to own the optimizer step, but parallel.strategy="
                              f"{self.parts.strategy.name} steps inside its engine (which skips fp16 overflows "
                              "itself); hint: train.nonfinite=stop")
        self.watch = NumericsWatch(train.nonfinite, train.nonfinite_patience)
        self.params = list(self.parts.model.parameters())  # listed once: the per-step gradient check
        strategy = self.parts.strategy
        # train.clip_grad_norm clipped here, not in the strategy's step (build_components, loop_clips)
        self.clip = train.clip_grad_norm if strategy.max_norm is None and loop_clips(strategy) else None
        self.sharded = strategy.holds_part  # the clip's norm over DTensor shards (hpctrain.parallel.clip)
        # skip: a skipped step restores the buffers its forward changed (BatchNorm's statistics)
        self.buffers = list(self.parts.model.buffers()) if train.nonfinite == "skip" else []
        self.kept_buffers: list[torch.Tensor] = []
        self.late = _late_read(self)


def fit(cfg: Config, env: cluster.ClusterEnv, device: torch.device, parts: Components,
        telemetry: Telemetry | None = None, ckpt: Checkpointer | None = None) -> LoopResult:
    """Train until ``train.epochs`` or ``train.max_steps``; validate as configured.
    Without ``telemetry`` the loop is measured but logs nowhere."""
    tel = telemetry or Telemetry.build(cfg.telemetry, env, device, parts.counters.step, batch=parts.layout,
                                       precision=cfg.precision, log_every=cfg.train.log_every)
    return _fit(Loop(cfg, env, device, parts, tel, ckpt))


def _fit(loop: Loop) -> LoopResult:
    cfg, counters, result, tel = loop.cfg, loop.parts.counters, loop.result, loop.tel
    result.best = dict(loop.ckpt.best) if loop.ckpt is not None else {}
    loop.steps_goal = total_steps(cfg, len(loop.parts.train_loader))
    # disable=None: tqdm draws only on a terminal (a log file would fill with carriage returns)
    bar = tqdm(total=loop.steps_goal, initial=counters.step, unit="step", dynamic_ncols=True,
               disable=None if cfg.train.progress and loop.env.is_main else True, mininterval=0.5, file=sys.stderr)
    tel.memory.arm(loop.parts.model, loop.parts.optimizer)  # once: the first step's memory breakdown
    tel.start(counters.step)
    try:
        while counters.epoch < cfg.train.epochs and counters.step < loop.steps_goal:
            t0 = time.perf_counter()
            finished = _train_epoch(loop, bar)
            result.train_seconds += time.perf_counter() - t0
            if not finished:
                break  # stopped by max_steps or a preemption mid-epoch
            counters.epoch += 1
            if cfg.train.eval_each_epoch:
                tel.meter.lap(OTHER)  # the epoch's end; the heartbeat then shows validation (a long phase)
                _validate(loop)
                tel.meter.lap(EVAL)
        pending = loop.late.take() if loop.late is not None else None
        if pending is not None:  # the last step's values, read late: judged before the final save
            _judge(loop, *pending, late=True)
    finally:
        bar.close()
        tel.stop()
    result.telemetry = tel.summary(counters.step)
    result.numerics = loop.watch.summary()
    return result


def _train_epoch(loop: Loop, bar: tqdm) -> bool:
    """One epoch (or its rest, after a resume); False if max_steps or a preemption stopped it
    early. ``meter.lap(PHASE)`` after each phase: the time since the previous lap was spent in it."""
    parts, meter, accum = loop.parts, loop.tel.meter, loop.cfg.train.grad_accum
    counters, loader = parts.counters, parts.train_loader
    loader.set_epoch(counters.epoch)
    start, usable = accumulation_window(loader.batches_done, len(loader), accum)
    losses: list[torch.Tensor] = []  # summed only when a row is logged: no per-step tensor op
    on_device, show = loop.device.type != "cpu", not bar.disable  # hot path: no call where nothing happens
    batches = _epoch_batches(loader) if start < usable else iter(())
    for micro in range(start, usable):
        batch = next(batches, None)
        if batch is None:
            break
        if on_device:
            batch = batch.to(loop.device, non_blocking=True)
        meter.lap(DATA)
        last_micro = (micro - start + 1) % accum == 0
        if loop.buffers and (micro - start) % accum == 0:  # train.nonfinite=skip: the step's first micro-batch
            loop.kept_buffers = [b.clone() for b in loop.buffers]
        losses.append(_micro_step(loop, batch, sync=last_micro))
        if not last_micro:
            continue
        if _finite_step(loop, losses[-accum:]):  # clipped there (Loop.clip)
            loop.parts.strategy.optimizer_step()
        else:
            _skip_update(loop)
        counters.step += 1
        counters.samples_seen += meter.global_batch
        meter.lap(OPTIM)
        if show:
            bar.update(1)
        if counters.step % loop.cfg.train.log_every == 0:
            _log_row(loop, losses)
            losses = []
        if _after_step(loop):
            return False
        if counters.step >= loop.steps_goal:
            return micro + 1 >= usable
    return True


def _micro_step(loop: Loop, batch: Batch, sync: bool) -> torch.Tensor:
    """Forward and backward of one micro-batch (the strategy's); the gradient sync only when
    ``sync``. The task turns the batch into the model's inputs and targets and owns the loss."""
    parts, meter = loop.parts, loop.tel.meter
    inputs, targets = parts.task.split(batch)
    if not meter.counted:
        _count_first_batch(loop, batch, inputs, targets)
    if meter.tokens_each_step:  # padded text: each batch's real tokens (a device tensor, no sync)
        meter.add_tokens(parts.task.count_tokens(inputs, targets))
    loss = parts.strategy.micro_step(inputs, targets, batch.mask, sync=sync, accum=loop.cfg.train.grad_accum,
                                     forward_done=loop.forward_done)
    meter.lap(BACKWARD)
    return loss


def _finite_step(loop: Loop, window: list[torch.Tensor]) -> bool:
    """Apply this step's update? Its loss and gradients, judged by ``train.nonfinite``
    (NonFiniteError: stop); the update's gradients clipped (``Loop.clip``). The gradients are read
    once: their L2 norm, the clip's own when the loop clips (non-finite exactly when a gradient
    is), else one fused ``torch._foreach_norm`` pass. With several ranks one 8-byte all-reduce of
    [loss, norm] makes every rank decide alike: a loss that is nan on one rank only, or a shard's
    inf (FSDP, tensor and pipeline parallel), reaches all. Reading the two numbers makes the CPU
    wait for the backward (the GPU then idles while it queues the update and the next forward),
    except for stop on a GPU: that step is judged one step late (:func:`_late_read`)."""
    step = loop.parts.counters.step + 1
    norm = grad_norm(loop.params, sharded=loop.sharded) if loop.clip is not None else None
    values = _step_values(loop, window, norm)
    if loop.late is not None:
        previous = loop.late.put(step, values)
        if previous is not None:
            _judge(loop, *previous, late=True)
        apply = True
    else:
        apply = _judge(loop, step, _exact(loop, values.tolist()))
    if apply and loop.clip is not None and norm is not None:
        clip_grads(loop.params, loop.clip, norm, sharded=loop.sharded)
    return apply


def _step_values(loop: Loop, window: list[torch.Tensor], norm: torch.Tensor | None = None) -> torch.Tensor:
    """[the step's loss summed over ranks, the gradients' norm (summed over ranks)], queued on the device.
    ``norm``: the clip's (already global); else this rank's, in one fused pass."""
    loss = window[0] if len(window) == 1 else torch.stack(window).sum()
    grads = norm if norm is not None else local_grad_norm(loop.params)
    values = torch.stack([loss.detach().float(), grads.float().to(loss.device)])
    if loop.env.distributed:
        values = values.to(cluster.collective_device())
        torch.distributed.all_reduce(values)  # a sum: nan or inf anywhere is nan or inf everywhere
    return values


def _exact(loop: Loop, values: list[float]) -> list[float]:
    """An infinite norm may be the overflow of finite gradients (beyond ~1e19): only then (every
    rank alike: the values are reduced), a second pass reads their largest magnitude, which is
    what the step is judged by (the watch's verdict and message as before the norm did the work)."""
    if values[1] != math.inf:
        return values
    largest = local_max_abs(p.grad for p in loop.params if p.grad is not None).reshape(1)
    if loop.env.distributed:
        largest = largest.to(cluster.collective_device())
        torch.distributed.all_reduce(largest)
    return [values[0], float(largest)]


def _judge(loop: Loop, step: int, values: list[float], late: bool = False) -> bool:
    scaler = loop.parts.precision.scaler
    scale = scaler.get_scale() if scaler is not None else None  # fp16 reads at once: no wait past the values'
    return loop.watch.judge(step, values[0] / loop.env.world_size, values[1], scale, late=late)


def _late_read(loop: Loop) -> LateRead | None:
    """train.nonfinite=stop on a GPU: the step's values are read one step later, from pinned memory,
    so the CPU never waits for the GPU (the update of a non-finite step is then applied, and the run
    ends at the next step, its checkpoint refused if the weights went nan). Not for skip (it must
    decide before the update), nor fp16 (its grad scaler waits for the gradients each step anyway)."""
    if loop.cfg.train.nonfinite != "stop" or loop.device.type != "cuda" or loop.parts.precision.scaler is not None:
        return None
    if loop.env.distributed and cluster.collective_device().type != "cuda":
        return None  # gloo: the values travel through host memory anyway
    return LateRead(cuda=True)


def _skip_update(loop: Loop) -> None:
    """A skipped step: the weights, buffers and the optimizer's state stay as they were; the gradients
    go, and the schedule advances as the step counter does (the strategy's optimizer_step, less the update)."""
    parts = loop.parts
    if parts.strategy.steps_in_engine:
        return  # its engine stepped in the micro-step (train.nonfinite=skip is refused for it)
    with torch.no_grad():
        for buffer, kept in zip(loop.buffers, loop.kept_buffers, strict=True):
            buffer.copy_(kept)
    parts.optimizer.zero_grad(set_to_none=True)
    if parts.scheduler is not None:
        parts.scheduler.step()


def _count_first_batch(loop: Loop, batch: Batch, inputs: Any, targets: torch.Tensor) -> None:
    """Once: FLOPs of a step (on meta, from the inputs the model reads; this rank's share of
    them, by the run layout) and, for a token task, the tokens in this rank's micro-batch (for tokens/s;
    padding, attention_mask 0 or target -100, not counted)."""
    count = getattr(loop.parts.task, "count_tokens", None)  # a user's registered task may not have it
    tokens = count(inputs, targets) if count is not None else None
    if tokens is None and not isinstance(inputs, dict):
        per_sample = loop.parts.task.tokens_per_sample(tuple(inputs.shape[1:]))
        tokens = per_sample * int(inputs.shape[0]) if per_sample is not None else None
    # FLOPs are counted with hooks off (no model(**inputs)): from a dict, the main input (input_ids)
    model_view = Batch(main_input(inputs), batch.targets, batch.keys, batch.mask)
    loop.tel.meter.first_batch(loop.parts.strategy.flops_module(), model_view,
                               tokens=int(tokens) if tokens is not None else None,
                               positions=int(model_view.inputs.numel()))
    # padded batches (an attention_mask) and packed documents (doc_ids) hold different token counts: counted
    # step by step (MFU then counts the real tokens' FLOPs, hpctrain.telemetry.meter)
    loop.tel.meter.tokens_each_step = count is not None and isinstance(inputs, dict) and (
        "attention_mask" in inputs or "doc_ids" in inputs)


def _after_step(loop: Loop) -> bool:
    """Profiler, stragglers, validation and the checkpoint hook after an optimizer step.
    True = stop now (preempted; the checkpoint is committed)."""
    cfg, step, meter = loop.cfg, loop.parts.counters.step, loop.tel.meter
    loop.tel.after_step(step)
    meter.lap(OTHER)
    if cfg.train.eval_every_steps and step % cfg.train.eval_every_steps == 0:
        _validate(loop)
        meter.lap(EVAL)
    loop.result.preempted = loop.ckpt is not None and loop.ckpt.at_step(loop.result.best)  # schedule or signal
    meter.lap(CKPT)
    return loop.result.preempted


def accumulation_window(batches_done: int, batches: int, accum: int) -> tuple[int, int]:
    """The micro-batches [start, end) of this epoch that form whole optimizer steps.

    Steps are counted from where the loader resumes, so every optimizer step takes exactly
    ``accum`` micro-batches of the configured size, also when a resume at another world
    size lands mid-accumulation (the saved position is a step boundary of the old split,
    not necessarily of the new one). Nothing is skipped at the start; the epoch's last
    ``< accum`` micro-batches are dropped, as in an uninterrupted epoch."""
    return batches_done, batches_done + (batches - batches_done) // accum * accum


def _epoch_batches(loader: TrainLoader) -> Iterator[Batch]:
    """The epoch's batches. Starting a DataLoader iterator draws a worker seed from the
    global torch RNG; isolating that draw keeps the dropout stream of a run resumed
    mid-epoch identical to an uninterrupted one."""
    batches = iter(loader)
    rng = torch.get_rng_state()
    first = next(batches, None)
    torch.set_rng_state(rng)
    return batches if first is None else itertools.chain((first,), batches)


def _log_row(loop: Loop, losses: list[torch.Tensor]) -> None:
    counters, meter = loop.parts.counters, loop.tel.meter
    steps = max(counters.step - meter.log_step, 1)
    loss = _mean_over_ranks(torch.stack(losses).sum() / steps, loop.env)  # every rank: a collective
    loop.tel.loggers.log({
        "step": counters.step, "epoch": counters.epoch,
        "loss": loss,  # mean over ranks of the steps' mean losses since the last row
        "lr": loop.parts.optimizer.param_groups[0]["lr"],
        **meter.interval(counters.step),  # samples/s (tokens/s), data-wait share, step-time breakdown, MFU, memory
        "skipped_samples": getattr(loop.parts.train_loader, "skipped", 0),  # this rank's; the summary has the total
        **expert_load(loop.parts.strategy.inner, loop.env.world_size),  # model.experts: aux loss, tokens per expert
        **mix_row(loop.parts.train_loader),  # data.mix: samples per source so far (all ranks)
    })


def _mean_over_ranks(value: torch.Tensor, env: cluster.ClusterEnv) -> float:
    """One small all-reduce per log row (not per step), so the logged loss is the global
    batch's, comparable across world sizes, not rank 0's share."""
    if env.distributed:
        value = value.detach().float().to(cluster.collective_device()).clone()
        torch.distributed.all_reduce(value)
        value = value / env.world_size
    return float(value)


def _validate(loop: Loop) -> None:
    parts, result = loop.parts, loop.result
    if parts.val_loader is None:
        return
    with protocol.during(protocol.VALIDATING):  # the watchdog's long allowance, for validation only
        res = parts.strategy.evaluate(parts.val_loader, parts.metrics, parts.task,
                                      batch_size=eval_batch_size(loop.cfg.data))
    result.eval_seconds += res.seconds
    result.last_eval, result.last_eval_step = res, parts.counters.step
    scalars = {f"val_{k}": v for k, v in res.metrics.items() if isinstance(v, (int, float))}
    row = {"step": parts.counters.step, "epoch": parts.counters.epoch, **scalars,
           "eval_samples_per_s": res.samples_per_s}
    loop.tel.loggers.log(row)
    if loop.env.is_main:
        shown = ("val_loss", "val_perplexity", "val_accuracy", "val_count")
        log.info("step %d  %s", row["step"], "  ".join(f"{k} {_shown(row[k])}" for k in shown if k in row))
    name = best_metric(loop.cfg, parts.task)
    if _improved(loop.cfg, name, row, result.best):
        result.best = {"metric": name, "value": row[name], "step": row["step"]}
        if loop.ckpt is not None:
            loop.ckpt.note_best(result.best)


def best_metric(cfg: Config, task: Task) -> str:
    """``train.best_metric``, with ``auto`` resolved by the task (val_loss for causal_lm)."""
    return task.best_metric if cfg.train.best_metric == "auto" else cfg.train.best_metric


def _improved(cfg: Config, name: str, row: dict[str, Any], best: dict[str, Any]) -> bool:
    """Is this validation the best so far by the metric ``name``?"""
    if name not in row:
        choices = ", ".join(k for k in row if k.startswith("val_"))
        raise ConfigError(f"train.best_metric={name!r} is not a validation metric; choose one of: {choices}")
    if not all(_finite(row[k]) for k in (name, "val_loss") if k in row):
        return False  # a nan val_loss is never the best (nor the accuracy of a model whose loss is nan)
    if best.get("metric") != name or not _finite(best.get("value")):  # none yet (or another metric's, or
        return True  # a nan one an older version recorded) before a resume
    lower_is_better = cfg.train.best_mode == "min" or (
        cfg.train.best_mode == "auto" and name.split("/")[0].endswith(("loss", "perplexity")))  # val_loss/SOURCE too
    return row[name] < best["value"] if lower_is_better else row[name] > best["value"]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# ---------------------------------------------------------------- the job


def train(cfg: Config, env: cluster.ClusterEnv | None = None) -> dict[str, Any]:
    """``hpctrain train``: returns the summary (written to RUN_DIR/summary.json by rank 0).
    ``env``: this rank's place (default: detected from the launcher, or a running process group)."""
    env = env or cluster.detect()
    given = cfg = resolve_auto(cfg, env)  # parallel.strategy=auto: config.yaml records the choice
    cfg, layout = make_layout(cfg, env)  # every rank, before the group: bad combinations fail all alike with exit 2
    run_dir = resolve_run_dir(cfg.run.dir, cfg)
    resume = cfg.resume if cfg.checkpoint.enabled else "never"
    # read-only, every rank: all fail alike before the group; a finished run asked for more steps continues
    check_run_dir(run_dir, cfg.run.overwrite, resume, cfg.train)
    created = missing_dirs(run_dir)  # a start that fails (bad data, model, checkpoint) leaves none of them behind
    ours = not torch.distributed.is_initialized()  # a group the caller started is the caller's to end
    device = cluster.init_distributed(env, cfg.parallel.backend, cfg.parallel.init_timeout_s)
    lock = RunDirLock(run_dir) if env.is_main else None  # one live run per run.dir, held by rank 0
    try:
        prepare_run_dir_together(run_dir, cfg.run.overwrite, resume, env.is_main, lock, cfg.train)  # rank 0 alone
        return _train_in_group(cfg, layout, env, device, run_dir, given)
    except BaseException:
        if lock is not None:
            lock.release()  # before its directory may be removed
            remove_empty_dirs(created)
        raise
    finally:
        if lock is not None:
            lock.release()
        if ours:
            cluster.teardown()


def _train_in_group(cfg: Config, layout: RunLayout, env: cluster.ClusterEnv, device: torch.device, run_dir: Path,
                    given: Config | None = None) -> dict[str, Any]:
    """``cfg`` as this world size runs it; ``given`` (default: cfg) as the user wrote it, for config.yaml."""
    # once the group exists (before, SIGTERM must still end a rank whose peer failed to start); a
    # signal `hpctrain train` kept since its start (preempt.keep_signals) counts as received here
    signals = SignalFlag(signal_names(cfg.checkpoint))
    signals.install()  # early: a preemption during set-up must not kill the job unsaved
    try:  # and gone again however the run ends: a caller in this process keeps its own handlers
        with first_cause():  # a rank that died first is named, not our collective's error after it
            return _set_up_and_run(cfg, layout, env, device, run_dir, given or cfg, signals)
    finally:
        signals.uninstall()


def _announce(cfg: Config, env: cluster.ClusterEnv, device: torch.device, data: DataBundle, layout: RunLayout,
              run_dir: Path, given: Config, step: int) -> None:
    """Rank 0, once the resume is settled: config.yaml, status.json "running" and the run's one-line description."""
    atomic_write_text(run_dir / "config.yaml", to_yaml(given))
    write_status(run_dir, "running", step=step)
    log.info("training %s on %s: %d train / %d val samples, world size %d, device %s; global batch %d = "
             "%d per rank x %d micro-steps x %d %s", cfg.model.name, data_text(cfg.data), data.train_size,
             data.val_size, env.world_size, device, layout.global_batch, layout.micro_batch, layout.grad_accum,
             layout.dp, "ranks" if layout.dp == env.world_size else "data-parallel replicas")


def _set_up_and_run(cfg: Config, layout: RunLayout, env: cluster.ClusterEnv, device: torch.device, run_dir: Path,
                    given: Config, signals: SignalFlag) -> dict[str, Any]:
    configure_runtime(cfg, env)
    data = load_data(cfg, layout.data_env(env), device)
    parts = build_components(cfg, env, device, data, layout)
    if parts.val_loader is not None:  # a misspelt train.best_metric fails now, not after the first validation
        names = {f"val_{k}": v for m in parts.metrics for k, v in m.compute().items() if isinstance(v, (int, float))}
        _improved(cfg, best_metric(cfg, parts.task), names, {})
    # dropout etc. differ per replica; the tp ranks of one replica draw the same masks on the
    # activations they all hold (data order is the same everywhere)
    seed_everything(cfg.seed + layout.dp_rank)
    # a finished run asked for more steps (rundir.check_run_dir: "extend"); every rank reads it here, before
    # the resume's collectives, after which rank 0 alone removes summary.json (_reopen_finished)
    extending = (run_dir / SUMMARY).exists()
    ckpt = tel = None
    try:
        if cfg.checkpoint.enabled:
            ckpt = Checkpointer(run_dir, env, device, cfg.checkpoint, parts.checkpoint_state(),
                                run_config=to_dict(cfg), signals=signals)
            resumed = ckpt.resume(cfg.resume)  # before metrics.jsonl opens: resume trims rows past the checkpoint
            if extending:
                _reopen_finished(cfg, env, parts, run_dir, resumed)
            if resumed:
                _continue_schedule(cfg, parts, env)
        # a logger whose package is missing fails every rank here, before config.yaml or status.json
        tel = Telemetry.build(cfg.telemetry, env, device, parts.counters.step, batch=layout, precision=cfg.precision,
                              log_every=cfg.train.log_every, run_dir=run_dir, run_config=to_dict(cfg))
    except BaseException as err:
        if ckpt is not None:
            ckpt.abandon()
        if isinstance(err, Preempted) and env.is_main:  # a signal ended the resume: exit 3, nothing new saved
            write_status(run_dir, "preempted", step=parts.counters.step, during=err.phase)
        raise
    if env.is_main:
        _announce(cfg, env, device, data, layout, run_dir, given, parts.counters.step)
    # up to summary.json, an error leaves status.json "failed" with the error (model.pt too)
    with failure_recorded(env.is_main, lambda error: write_status(run_dir, "failed", step=parts.counters.step,
                                                                   error=error)), first_cause():
        try:
            result = _run_loop(Loop(cfg, env, device, parts, tel, ckpt))
        finally:
            tel.close()
        if result.preempted:
            return _preempted(env, run_dir, parts, ckpt)
        digest = save_model_streamed(parts.strategy, run_dir / "model.pt")  # every rank: gathers tensor by tensor
        summary = _summary(cfg, env, parts, result, digest)
        if env.is_main:
            write_json(run_dir / "summary.json", summary)
    if env.is_main:
        write_status(run_dir, "finished", step=parts.counters.step)
        shown = ("steps", "val_loss", "val_perplexity" if summary["val_perplexity"] is not None else "val_accuracy",
                 "val_count", "samples_per_s", "tokens_per_s", "skipped_samples")
        log.info("done: %s", ", ".join(f"{k}={_shown(summary[k])}" for k in shown if summary.get(k) is not None))
    return summary


def _reopen_finished(cfg: Config, env: cluster.ClusterEnv, parts: Components, run_dir: Path,
                     resumed: bool) -> None:
    """A finished run resumed from its last checkpoint goes on only if this config trains at
    least one step more (the loop's own condition, with this data's steps per epoch); else it
    is refused as before, its files as they were. Every rank decides alike."""
    if not resumed:  # checkpoints/ held no committed checkpoint: never start the finished run over
        raise RunDirError(f"run.dir {run_dir} holds a finished run without a checkpoint to continue from; hint: "
                          "choose another run.dir, or pass run.overwrite=true to replace its outputs")
    counters = parts.counters
    if counters.epoch >= cfg.train.epochs or counters.step >= total_steps(cfg, len(parts.train_loader)):
        raise finished_run_error(run_dir, cfg.resume)
    if env.is_main:
        reopen_finished_run(run_dir, cfg.train)


def _continue_schedule(cfg: Config, parts: Components, env: cluster.ClusterEnv) -> None:
    """After a resume: a built-in LR schedule (a function of the step and the run's length) is
    recomputed for this config's length. With the same length it gives the saved learning rate
    bit for bit (nothing changes); a run extended with a larger train.max_steps / train.epochs
    gets the new curve's rate from its first step on, not the old curve's last (near 0 for cosine)."""
    scheduler = parts.scheduler
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas,
                                                                        strict=True)]  # what its step() computes
    groups = parts.optimizer.param_groups
    if all(group["lr"] == rate for group, rate in zip(groups, rates, strict=True)):
        return
    before = groups[0]["lr"]
    for group, rate in zip(groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = list(rates)  # what get_last_lr() reports (torch keeps it in this attribute)
    if env.is_main:
        log.info("LR schedule recomputed for a run of %d steps (optim.schedule=%s): step %d continues at lr %.4g "
                 "(the saved run's schedule had %.4g)", total_steps(cfg, len(parts.train_loader)), cfg.optim.schedule,
                 parts.counters.step, rates[0], before)


def _shown(value: Any) -> str:
    """A number for the done line: whole numbers as integers (10000, not 1e+04), other floats
    with 4 significant digits (0.9812), or to the unit from 1000 on (12346, not 1.235e+04)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and value.is_integer()):
        return str(int(value))
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _run_loop(loop: Loop) -> LoopResult:
    """fit, the final validation and the final checkpoint; an in-flight save always ends."""
    ckpt, step = loop.ckpt, loop.parts.counters
    try:
        result = _fit(loop)
        if not result.preempted and result.last_eval_step != step.step:
            _validate(loop)
            loop.tel.meter.lap(EVAL)
        if ckpt is not None and not result.preempted:
            ckpt.finish(result.best)
    except BaseException:
        if ckpt is not None:
            ckpt.abandon()  # waits for a save in flight; its own error is logged, not raised over ours
        raise
    if ckpt is not None:
        ckpt.close()
        result.best = ckpt.best_record(result.best)
    loop.tel.meter.lap(CKPT)
    result.telemetry = loop.tel.summary(step.step)  # the loop's rates; the peak memory now of the final validation too
    return result


def skipped_samples(parts: Components, env: cluster.ClusterEnv) -> int:
    """Corrupt samples skipped under data.on_corrupt=skip, summed over the data-parallel replicas
    (never silent; the tp ranks and stages of a replica read, and skip, the same samples)."""
    local = torch.tensor([getattr(parts.train_loader, "skipped", 0)], dtype=torch.int64)
    if env.distributed:
        local = local.to(cluster.collective_device())
        torch.distributed.all_reduce(local, group=parts.strategy.eval_group())
    return int(local.item())


def _preempted(env: cluster.ClusterEnv, run_dir: Path, parts: Components, ckpt: Checkpointer | None) -> dict[str, Any]:
    """Stopped by a signal after a committed checkpoint: no summary.json (the run is not
    finished), status.json says preempted and the CLI exits with EXIT_PREEMPTED."""
    where = str(ckpt.writer.last_committed) if ckpt is not None else None
    if env.is_main:
        write_status(run_dir, "preempted", step=parts.counters.step, checkpoint=where)
        log.warning("preempted: checkpoint %s committed at step %d; run the same command again to resume",
                    where, parts.counters.step)
    return {"outcome": "preempted", "steps": parts.counters.step, "checkpoint": where}


def _summary(cfg: Config, env: cluster.ClusterEnv, parts: Components, result: LoopResult,
             digest: Digests) -> dict[str, Any]:
    metrics = result.last_eval.metrics if result.last_eval else {}
    samples = parts.counters.samples_seen
    return {
        # the meter's means of this process's loop after its first step: samples/s, tokens/s (a token task's),
        # data-wait share, step-time breakdown, MFU, peak memory; stragglers; top ops
        "tokens_per_s": None, **result.telemetry,
        # each rank's measured memory_breakdown with the strategy's declared bytes beside it ("predicted")
        **run_breakdown(result.telemetry.get("memory_breakdown"), cfg, parts.strategy.inner, parts.strategy.topology,
                        micro_batch=parts.strategy.micro_batch),
        "task": parts.task.name,
        "val_loss": metrics.get("loss"), "val_accuracy": metrics.get("accuracy"),
        "val_count": metrics.get("count"), "val_correct": metrics.get("correct"),
        "val_top5_accuracy": metrics.get("top5_accuracy"),
        "val_perplexity": metrics.get("perplexity"), "val_tokens": metrics.get("tokens"),
        "steps": parts.counters.step, "epochs": parts.counters.epoch, "samples_seen": samples,
        "world_size": env.world_size, "train_seconds": result.train_seconds, "eval_seconds": result.eval_seconds,
        "best": result.best,
        "params_sha256": digest.params,  # of model.pt's parameters (save_model_streamed)
        "buffers_sha256": digest.buffers,  # of model.pt's buffers (BatchNorm statistics), all ranks' alike
        "skipped_samples": skipped_samples(parts, env),
        **expert_summary(parts.strategy.inner),  # model.experts: the run's tokens per expert
        **mix_summary(parts.train_loader, result.last_eval),  # data.mix: samples and val metrics per source
        **result.numerics,  # non-finite steps: counted, skipped, the first (train.nonfinite)
        "precision": cfg.precision, "model": cfg.model.name, "data": data_text(cfg.data), "outcome": "finished",
    }
