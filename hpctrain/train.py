"""The reference training loop behind ``hpctrain train``, built only from the parts:
env -> data -> model -> parallel -> precision -> optim -> evaluate -> run dir."""

from __future__ import annotations

import contextlib
import itertools
import logging
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
from torch.distributed.device_mesh import DeviceMesh
from tqdm import tqdm

from hpctrain import env as cluster
from hpctrain.checkpoint import Checkpointer
from hpctrain.checkpoint.preempt import SignalFlag, write_status
from hpctrain.config import Config, ConfigError, check_world, for_world, to_yaml
from hpctrain.data import Batch, DataBundle, EvalBatches, TrainLoader, build_data, eval_batch_size
from hpctrain.evaluate import EvalResult, evaluate
from hpctrain.metrics import Metric
from hpctrain.models import build_model
from hpctrain.optim import build_optimizer, build_scheduler, peak_lr
from hpctrain.parallel import build_parallel, build_pipeline_step, is_sharded, unwrap
from hpctrain.parallel.clip import clip_grad_norm_
from hpctrain.parallel.ddp import no_sync
from hpctrain.parallel.deepspeed import DeepSpeedStep, init_deepspeed
from hpctrain.parallel.fsdp import sharded_grad_scaler
from hpctrain.parallel.mesh import dp_group
from hpctrain.parallel.meta import on_meta
from hpctrain.parallel.pipeline import PipelineStep
from hpctrain.parallel.pipeline_eval import evaluate_pipeline
from hpctrain.parallel.zero import zero1_from
from hpctrain.precision import Precision
from hpctrain.rundir import (
    atomic_write_text,
    check_run_dir,
    missing_dirs,
    prepare_run_dir_together,
    remove_empty_dirs,
    resolve_run_dir,
    write_json,
)
from hpctrain.strategy import check_strategy, data_env, model_mesh, sharded_checkpoints
from hpctrain.tasks import Classification, Task, resolve_task
from hpctrain.telemetry.loop import Telemetry
from hpctrain.telemetry.meter import BACKWARD, CKPT, DATA, EVAL, FORWARD, OPTIM, OTHER
from hpctrain.weights import save_model_streamed

log = logging.getLogger("hpctrain")
_NO_CONTEXT = contextlib.nullcontext()  # reusable; one fewer object per micro-step on the hot path


@dataclass
class Counters:
    """Progress that a resumed run must restore."""

    step: int = 0          # optimizer steps done
    epoch: int = 0         # epochs completed
    samples_seen: int = 0  # global training samples consumed

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch, self.samples_seen = state["step"], state["epoch"], state["samples_seen"]


@dataclass
class Components:
    """Everything the loop needs; built by :func:`build_components` or by hand."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    precision: Precision
    train_loader: TrainLoader
    val_loader: EvalBatches | None
    metrics: list[Metric]
    counters: Counters = field(default_factory=Counters)
    task: Task = field(default_factory=Classification)  # split, loss and metrics (hpctrain.tasks)
    flops_model: nn.Module | None = None  # the whole model on meta, to count FLOPs when ``model`` holds shards
    # parallel.pp > 1: runs forward + backward, ``model`` is this rank's stage(s); strategy=deepspeed:
    # forward, backward and (closing an accumulation window) the optimizer step, ``model`` is the engine
    step: PipelineStep | DeepSpeedStep | None = None
    # the (pp, dp, tp) mesh the model was parallelized over, built once (mesh_for); evaluation merges
    # over its dp group (hpctrain.parallel.mesh.dp_group). None: one process, or data parallel over the world
    mesh: DeviceMesh | None = None


@dataclass
class LoopResult:
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    last_eval: EvalResult | None = None
    last_eval_step: int = -1
    data_wait_seconds: float = 0.0
    best: dict[str, Any] = field(default_factory=dict)
    preempted: bool = False  # stopped by a signal after a committed checkpoint
    telemetry: dict[str, Any] = field(default_factory=dict)  # the meter's run means, stragglers, top ops


# ---------------------------------------------------------------- set-up


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def configure_runtime(cfg: Config, env: cluster.ClusterEnv) -> None:
    threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def total_steps(cfg: Config, batches_per_epoch: int) -> int:
    per_epoch = batches_per_epoch // cfg.train.grad_accum
    steps = per_epoch * cfg.train.epochs
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps else steps


def build_components(cfg: Config, env: cluster.ClusterEnv, device: torch.device, data: DataBundle) -> Components:
    """``cfg`` as this world size runs it: pass ``for_world(cfg, env.world_size)`` (and build the data from it)."""
    if for_world(cfg, data_env(cfg, env).world_size) is not cfg:
        raise ConfigError(f"data.global_batch_size={cfg.data.global_batch_size} needs the per-rank split first; "
                          "hint: cfg = hpctrain.config.for_world(cfg, env.world_size) before build_data")
    task = resolve_task(cfg.train.task, data.task, cfg.data.name)
    check_strategy(cfg, env)  # train() checks before the process group already; a hand-built loop, here
    num_classes = cfg.model.num_classes or data.num_classes

    def factory() -> nn.Module:
        return build_model(cfg.model.name, num_classes, input_shape=data.input_shape, input_dtype=data.input_dtype,
                           config=cfg.model)

    step: PipelineStep | DeepSpeedStep | None = None
    mesh = model_mesh(cfg, env, device)
    if cfg.parallel.pp > 1:
        model, step = _pipeline(cfg, env, device, factory, task, mesh)
    else:  # seeded: identical initial weights on every rank (under parallel.meta_init, rank 0's, scattered)
        model = build_parallel(factory, env, cfg.parallel, device=device, seed=cfg.seed, compile=cfg.train.compile,
                               precision=cfg.precision, mesh=mesh)
    global_batch = cfg.data.batch_size * data_env(cfg, env).world_size * cfg.train.grad_accum
    optimizer = build_optimizer(model, cfg.optim, peak_lr(cfg.optim, global_batch))
    if cfg.parallel.strategy == "zero1" and env.distributed:
        optimizer = zero1_from(optimizer)  # the optimizer state split over the ranks; DDP all-reduces
    steps = total_steps(cfg, len(data.train_loader))
    needs_schedule = cfg.optim.schedule != "constant" or cfg.optim.warmup_steps > 0
    scheduler = build_scheduler(optimizer, cfg.optim, steps) if needs_schedule else None
    if cfg.parallel.strategy == "deepspeed":  # the engine steps the schedule (handed over by _deepspeed)
        model, step = _deepspeed(cfg, env, model, optimizer, task, scheduler)
    precision = Precision(cfg.precision, device)
    if (is_sharded(model) or isinstance(step, PipelineStep)) and precision.scaler is not None:
        precision.scaler = sharded_grad_scaler(device)  # its inf check sees every rank's shard (and stage)
    if isinstance(step, PipelineStep):
        step.grad_scaler = precision.scaler  # fp16: the schedule's loss function scales the loss
    whole = is_sharded(model) or step is not None  # FLOPs from the whole model on meta
    return Components(model, optimizer, scheduler, precision, data.train_loader, data.val_loader,
                      task.metrics(num_classes), task=task, flops_model=on_meta(factory) if whole else None, step=step,
                      mesh=mesh)


def _pipeline(cfg: Config, env: cluster.ClusterEnv, device: torch.device, factory: Any,
              task: Task, mesh: DeviceMesh | None = None) -> tuple[nn.Module, PipelineStep]:
    """parallel.pp > 1: the whole model built seeded (as one process builds it), cut into this
    rank's stage(s) on the run's ``mesh`` (FSDP over its dp dim) behind the schedule's step
    function; the loss is the task's."""
    torch.manual_seed(cfg.seed)
    step = build_pipeline_step(factory().to(device), env, cfg.parallel, device=device,
                               loss_fn=lambda out, tgt: task.loss(out, tgt, None), grad_accum=cfg.train.grad_accum,
                               precision=cfg.precision, mesh=mesh)
    return step.model, step


def _deepspeed(cfg: Config, env: cluster.ClusterEnv, model: nn.Module, optimizer: torch.optim.Optimizer,
               task: Task, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
               ) -> tuple[nn.Module, DeepSpeedStep]:
    """strategy=deepspeed: the engine (ZeRO parallel.deepspeed_stage) around the model and its
    optimizer; DeepSpeed reduces, clips (train.clip_grad_norm), steps the optimizer and then the
    lr ``scheduler`` (built over ``optimizer``, whose param groups ZeRO keeps using), once per
    accumulation window, as ``_optimizer_step`` does for the other strategies; the loss is the task's."""
    engine = init_deepspeed(model, optimizer, env=env, stage=cfg.parallel.deepspeed_stage,
                            micro_batch=cfg.data.batch_size, grad_accum=cfg.train.grad_accum,
                            clip_grad_norm=cfg.train.clip_grad_norm or 0.0, precision=cfg.precision,
                            scheduler=scheduler)
    return engine, DeepSpeedStep(engine, lambda out, tgt: task.loss(out, tgt, None))


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


def fit(cfg: Config, env: cluster.ClusterEnv, device: torch.device, parts: Components,
        telemetry: Telemetry | None = None, ckpt: Checkpointer | None = None) -> LoopResult:
    """Train until ``train.epochs`` or ``train.max_steps``; validate as configured.
    Without ``telemetry`` the loop is measured but logs nowhere."""
    tel = telemetry or Telemetry.build(cfg, env, device, parts.counters.step)
    return _fit(Loop(cfg, env, device, parts, tel, ckpt))


def _fit(loop: Loop) -> LoopResult:
    cfg, counters, result, tel = loop.cfg, loop.parts.counters, loop.result, loop.tel
    result.best = dict(loop.ckpt.best) if loop.ckpt is not None else {}
    loop.steps_goal = total_steps(cfg, len(loop.parts.train_loader))
    bar = tqdm(total=loop.steps_goal, initial=counters.step, unit="step", dynamic_ncols=True,
               disable=not (cfg.train.progress and loop.env.is_main), mininterval=0.5, file=sys.stderr)
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
                _validate(loop)
                tel.meter.lap(EVAL)
    finally:
        bar.close()
        tel.stop()
    result.data_wait_seconds = tel.meter.data_wait_seconds
    result.telemetry = tel.summary(counters.step)
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
        losses.append(_micro_step(loop, batch, sync=last_micro))
        if not last_micro:
            continue
        _optimizer_step(loop)
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
    """Forward and backward of one micro-batch; the gradient all-reduce only when ``sync``.
    The task turns the batch into the model's inputs and targets and owns the loss."""
    parts, meter, accum = loop.parts, loop.tel.meter, loop.cfg.train.grad_accum
    inputs, targets = parts.task.split(batch)
    if not meter.counted:
        _count_first_batch(loop, batch, inputs)
    if parts.step is not None:  # the pipeline schedule or DeepSpeed runs forward and backward
        with parts.precision.autocast() if isinstance(parts.step, PipelineStep) else contextlib.nullcontext():
            loss = parts.step(inputs, targets)  # DeepSpeed: its own bf16/fp16 (ds_config), and step
        meter.lap(BACKWARD)
        return loss / accum if accum > 1 else loss
    with _NO_CONTEXT if sync else no_sync(parts.model, skip=True):  # inner micro-steps of accumulation only
        with parts.precision.autocast():
            loss = parts.task.loss(parts.model(inputs), targets, batch.mask)
            if accum > 1:
                loss = loss / accum
        meter.lap(FORWARD)
        parts.precision.backward(loss)
    meter.lap(BACKWARD)
    return loss.detach()


def _count_first_batch(loop: Loop, batch: Batch, inputs: torch.Tensor) -> None:
    """Once: FLOPs of a step (on meta, from the inputs the model reads) and, for a token
    task, the tokens in this rank's micro-batch (for tokens/s)."""
    per_sample = loop.parts.task.tokens_per_sample(tuple(inputs.shape[1:]))
    tokens = per_sample * int(inputs.shape[0]) if per_sample is not None else None
    model_view = Batch(inputs, batch.targets, batch.keys, batch.mask)
    meter = loop.tel.meter
    meter.first_batch(loop.parts.flops_model or unwrap(loop.parts.model), model_view, tokens=tokens)
    split = loop.cfg.parallel.pp * loop.cfg.parallel.tp
    if split > 1 and meter.step_flops is not None:  # one rank runs one stage, 1/tp of each block's matmuls:
        meter.step_flops //= split  # about 1/(pp x tp) of the replica's FLOPs


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


def _optimizer_step(loop: Loop) -> None:
    parts = loop.parts
    if isinstance(parts.step, DeepSpeedStep):
        return  # the engine clipped and stepped in the window's last micro-step
    if loop.cfg.train.clip_grad_norm is not None:
        parts.precision.unscale(parts.optimizer)
        if isinstance(parts.step, PipelineStep):  # the squared norms of every stage, summed over the pipeline
            clip_grad_norm_(parts.step.parameters(), loop.cfg.train.clip_grad_norm, pp_group=parts.step.group)
        else:  # sharded gradients (DTensors) need the norm over every shard; whole ones, torch's own
            clip = clip_grad_norm_ if is_sharded(parts.model) else torch.nn.utils.clip_grad_norm_
            clip(parts.model.parameters(), loop.cfg.train.clip_grad_norm)
    parts.precision.step(parts.optimizer)
    parts.optimizer.zero_grad(set_to_none=True)
    if parts.scheduler is not None:
        parts.scheduler.step()


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
    if isinstance(parts.step, PipelineStep):  # pp: forward through the stages, metrics on the last
        res = evaluate_pipeline(parts.step, parts.val_loader, parts.metrics, loop.env, loop.device,
                                parts.precision, task=parts.task, batch_size=eval_batch_size(loop.cfg),
                                leader=loop.env.rank % loop.cfg.parallel.tp == 0)  # tp ranks: count once
    else:
        res = evaluate(parts.model, parts.val_loader, parts.metrics, loop.env, loop.device, parts.precision,
                       task=parts.task, group=dp_group(parts.mesh))  # tp ranks share a shard: merge over dp
    result.eval_seconds += res.seconds
    result.last_eval, result.last_eval_step = res, parts.counters.step
    scalars = {f"val_{k}": v for k, v in res.metrics.items() if isinstance(v, (int, float))}
    row = {"step": parts.counters.step, "epoch": parts.counters.epoch, **scalars,
           "eval_samples_per_s": res.samples_per_s}
    loop.tel.loggers.log(row)
    if loop.env.is_main:
        shown = ("val_loss", "val_perplexity", "val_accuracy", "val_count")
        log.info("step %d  %s", row["step"], "  ".join(f"{k} {row[k]:.4g}" for k in shown if k in row))
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
    if best.get("metric") != name:  # none yet, or one tracked by another metric before a resume
        return True
    lower_is_better = cfg.train.best_mode == "min" or (
        cfg.train.best_mode == "auto" and name.endswith(("loss", "perplexity")))
    return row[name] < best["value"] if lower_is_better else row[name] > best["value"]


# ---------------------------------------------------------------- the job


def train(cfg: Config) -> dict[str, Any]:
    """``hpctrain train``: returns the summary (written to RUN_DIR/summary.json by rank 0)."""
    env = cluster.detect()
    check_strategy(cfg, env)  # every rank, before the group: all fail alike with exit 2
    check_world(cfg, data_env(cfg, env).world_size)  # the global batch is split over the dp replicas only
    given, cfg = cfg, for_world(cfg, data_env(cfg, env).world_size)  # global_batch_size -> micro-batch, accum
    cfg = sharded_checkpoints(cfg)
    run_dir = resolve_run_dir(cfg.run.dir, cfg)
    resume = cfg.resume if cfg.checkpoint.enabled else "never"
    check_run_dir(run_dir, cfg.run.overwrite, resume)  # read-only, every rank: all fail alike before the group
    created = missing_dirs(run_dir)  # a start that fails (bad data, model, checkpoint) leaves none of them behind
    device = cluster.init_distributed(env, cfg.parallel.backend, cfg.parallel.init_timeout_s)
    try:
        prepare_run_dir_together(run_dir, cfg.run.overwrite, resume, env.is_main)  # rank 0 changes it, all wait
        return _train_in_group(cfg, env, device, run_dir, given)
    except BaseException:
        if env.is_main:
            remove_empty_dirs(created)
        raise
    finally:
        cluster.teardown()


def _train_in_group(cfg: Config, env: cluster.ClusterEnv, device: torch.device, run_dir: Path,
                    given: Config | None = None) -> dict[str, Any]:
    """``cfg`` as this world size runs it; ``given`` (default: cfg) as the user wrote it, for config.yaml."""
    signals = SignalFlag(cfg.checkpoint.signals if cfg.checkpoint.enabled else [])
    signals.install()  # early: a preemption during set-up must not kill the job unsaved
    configure_runtime(cfg, env)
    data = build_data(cfg, data_env(cfg, env), device)
    parts = build_components(cfg, env, device, data)
    if parts.val_loader is not None:  # a misspelt train.best_metric fails now, not after the first validation
        names = {f"val_{k}": v for m in parts.metrics for k, v in m.compute().items() if isinstance(v, (int, float))}
        _improved(cfg, best_metric(cfg, parts.task), names, {})
    # dropout etc. differ per replica; the tp ranks of one replica draw the same masks on the
    # activations they all hold (data order is the same everywhere)
    seed_everything(cfg.seed + data_env(cfg, env).rank)
    ckpt = Checkpointer(cfg, env, device, run_dir, parts, signals) if cfg.checkpoint.enabled else None
    if ckpt is not None:
        ckpt.resume(cfg.resume)  # before metrics.jsonl opens: resume trims rows past the checkpoint
    tel = _build_telemetry(cfg, env, device, run_dir, parts, signals, ckpt)
    if env.is_main:
        atomic_write_text(run_dir / "config.yaml", to_yaml(given or cfg))
        write_status(run_dir, "running", step=parts.counters.step)
        replicas = data_env(cfg, env).world_size  # tp ranks and pipeline stages of a replica share its batch
        log.info("training %s on %s: %d train / %d val samples, world size %d, device %s; global batch %d = "
                 "%d per rank x %d micro-steps x %d %s", cfg.model.name, cfg.data.name, data.train_size,
                 data.val_size, env.world_size, device, cfg.data.batch_size * cfg.train.grad_accum * replicas,
                 cfg.data.batch_size, cfg.train.grad_accum, replicas,
                 "ranks" if replicas == env.world_size else "data-parallel replicas")
    try:
        result = _run_loop(Loop(cfg, env, device, parts, tel, ckpt))
    except BaseException:
        if env.is_main:
            write_status(run_dir, "failed", step=parts.counters.step)
        raise
    finally:
        signals.uninstall()
        tel.close()
    if result.preempted:
        return _preempted(env, run_dir, parts, ckpt)
    digest = save_model_streamed(cfg, env, parts, run_dir / "model.pt")  # every rank: gathers tensor by tensor
    summary = _summary(cfg, env, parts, result, digest)
    if env.is_main:
        write_json(run_dir / "summary.json", summary)
        write_status(run_dir, "finished", step=parts.counters.step)
        shown = ("steps", "val_loss", "val_perplexity" if summary["val_perplexity"] is not None else "val_accuracy",
                 "val_count", "samples_per_s", "tokens_per_s", "skipped_samples")
        log.info("done: %s", ", ".join(f"{k}={summary[k]}" for k in shown if summary.get(k) is not None))
    return summary


def _build_telemetry(cfg: Config, env: cluster.ClusterEnv, device: torch.device, run_dir: Path, parts: Components,
                     signals: SignalFlag, ckpt: Checkpointer | None) -> Telemetry:
    """Meter, loggers (metrics.jsonl opens here), stragglers, profiler. A logger whose package
    is missing fails every rank here, before config.yaml or status.json is written."""
    try:
        tel = Telemetry.build(cfg, env, device, parts.counters.step, run_dir)
        replicas = data_env(cfg, env).world_size
        if replicas != env.world_size:  # tp / pp: the ranks of one replica share their samples (and tokens)
            tel.meter.global_batch = cfg.data.batch_size * replicas * cfg.train.grad_accum
            tel.meter.world_size = replicas
        return tel
    except BaseException:
        signals.uninstall()
        if ckpt is not None:
            ckpt.abandon()
        raise


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
    result.telemetry = loop.tel.summary(step.step)  # now with the final validation and save
    return result


def skipped_samples(parts: Components, env: cluster.ClusterEnv) -> int:
    """Corrupt samples skipped under data.on_corrupt=skip, summed over the data-parallel replicas
    (never silent; the tp ranks and stages of a replica read, and skip, the same samples)."""
    local = torch.tensor([getattr(parts.train_loader, "skipped", 0)], dtype=torch.int64)
    if env.distributed:
        local = local.to(cluster.collective_device())
        torch.distributed.all_reduce(local, group=dp_group(parts.mesh))
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
             params_digest: str) -> dict[str, Any]:
    metrics = result.last_eval.metrics if result.last_eval else {}
    samples = parts.counters.samples_seen
    samples_per_s = samples / result.train_seconds if result.train_seconds else 0.0
    window = result.telemetry  # the meter's tokens per sample (None unless the task counts tokens)
    tokens_per_sample = window["tokens_per_s"] / window["samples_per_s"] if window.get("tokens_per_s") else None
    return {
        **result.telemetry,  # the meter's run means: step-time breakdown, MFU, peak memory; stragglers; top ops
        "task": parts.task.name,
        "val_loss": metrics.get("loss"), "val_accuracy": metrics.get("accuracy"),
        "val_count": metrics.get("count"), "val_correct": metrics.get("correct"),
        "val_top5_accuracy": metrics.get("top5_accuracy"),
        "val_perplexity": metrics.get("perplexity"), "val_tokens": metrics.get("tokens"),
        "tokens_per_s": samples_per_s * tokens_per_sample if tokens_per_sample else None,
        "samples_per_s": samples_per_s,
        "steps": parts.counters.step, "epochs": parts.counters.epoch, "samples_seen": samples,
        "world_size": env.world_size, "train_seconds": result.train_seconds, "eval_seconds": result.eval_seconds,
        "data_wait_share": result.data_wait_seconds / result.train_seconds if result.train_seconds else 0.0,
        "best": result.best,
        "params_sha256": params_digest,  # of model.pt's parameters (save_model_streamed)
        "skipped_samples": skipped_samples(parts, env),
        "precision": cfg.precision, "model": cfg.model.name, "data": cfg.data.name, "outcome": "finished",
    }
