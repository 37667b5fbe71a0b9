"""The strategy interface: one object owns everything that differs between ways of running a
model over ranks. The loop, the checkpointer, evaluation and the final weights call it and
never ask which strategy runs.

A strategy builds and wraps the model (tensor parallel -> activation checkpointing -> compile
-> data parallel, in that order), wraps the optimizer, picks the fp16 loss scaler, runs a
micro-step (forward and backward, skipping the gradient sync on inner micro-steps of
accumulation) and the optimizer step (with clipping), supplies the view of model and
optimizer a checkpoint saves and loads (:mod:`hpctrain.parallel.state`), streams the whole
model's tensors for ``model.pt``, and evaluates.

This base class runs a whole model on every rank; subclasses (one file each, registered in
:mod:`hpctrain.parallel.registry`) override what their strategy changes.

A strategy is given the run's :class:`~hpctrain.core.topology.Topology` (and the batch split)
by whoever planned the run (the trainer asks ``hpctrain.planning.layout.make_layout``); it
never imports the planner, which asks the strategy class (:meth:`Strategy.checkpoint_format`,
:meth:`Strategy.check`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpctrain.config.parallel import ParallelConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.core.modules import is_sharded, sync_buffers, unwrap
from hpctrain.core.topology import Topology
from hpctrain.evaluation.evaluate import EvalResult, evaluate
from hpctrain.parallel.buffers import check_sync_batchnorm, convert_sync_batchnorm, real_samples
from hpctrain.parallel.checkpointing import apply_activation_checkpointing
from hpctrain.parallel.clip import clip_grad_norm_
from hpctrain.parallel.context import ContextParallel, check_context_parallel, context_parallel_of
from hpctrain.parallel.mesh import build_mesh, dp_group
from hpctrain.parallel.meta import build_structure, meta_copy, on_meta, whole_from_rank0
from hpctrain.parallel.state import ModelState, ShardedState, WholeState
from hpctrain.precision import Precision
from hpctrain.tasks.metrics import Metric
from hpctrain.weights.digest import clean_name, param_names
from hpctrain.weights.export import Source, model_source

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.data import EvalBatches
    from hpctrain.tasks import Task

LossFn = Callable[[Any, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
Factory = Callable[[], nn.Module]
_NO_CONTEXT = contextlib.nullcontext()  # reusable: one object fewer per micro-step on the hot path


def _nothing() -> None:
    return None


class Strategy:
    """A whole model per rank; one process, or replicas kept in step by a subclass."""

    name: ClassVar[str] = "whole"
    wraps_a_strategy: ClassVar[bool] = False  # built around another one (registry.make_strategy hands it over)
    # a mesh also for data parallelism alone (FSDP shards over its dp dim), not only when the model is split
    needs_mesh: ClassVar[bool] = False
    # the optimizer step happens inside the strategy's own engine during the micro-step (DeepSpeed), so
    # the loop cannot hold a step back (train.nonfinite=skip) or undo it
    steps_in_engine: ClassVar[bool] = False

    def __init__(self, topology: Topology, env: ClusterEnv, device: torch.device, cfg: ParallelConfig, *,
                 micro_batch: int = 1, grad_accum: int = 1, precision: str = "fp32", compile: bool = False,
                 seed: int = 0, clip_grad_norm: float | None = None, mesh: DeviceMesh | None = None) -> None:
        self.topology, self.env, self.device, self.cfg = topology, env, device, cfg
        self.micro_batch = micro_batch  # samples per rank per micro-step
        self.grad_accum = grad_accum  # micro-steps per optimizer step
        self.precision_mode, self.compile, self.seed, self.max_norm = precision, compile, seed, clip_grad_norm
        self.mesh: DeviceMesh | None = mesh if mesh is not None else self._build_mesh()
        # parallel.cp > 1: the split, its loss and (CUDA) ring attention (hpctrain.parallel.context)
        self.context: ContextParallel | None = context_parallel_of(self.mesh, topology, device)
        self._holds_part = False
        self.model: nn.Module = nn.Identity()
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.precision = Precision(precision, device)
        self.whole: nn.Module | None = None  # the whole model on meta, when this rank holds a part of it
        self.skeleton: nn.Module | None = None  # its meta structure from build_model, for a factory that refuses meta
        self.loss_fn: LossFn | None = None

    # ---------------------------------------------------------------- before the process group

    @classmethod
    def checkpoint_format(cls, cfg: ParallelConfig) -> str:
        """torch: rank 0 writes the whole state; dcp: every rank its shards (tensor parallel
        holds DTensors); deepspeed: DeepSpeed's own files."""
        return "dcp" if cfg.tp > 1 else "torch"

    @classmethod
    def check(cls, cfg: Config, topology: Topology) -> None:
        """What this strategy cannot run on ``topology``, as a ConfigError (exit 2) before the
        process group. Subclasses add their own checks to these (super().check)."""
        if topology.tp > 1:  # torch.distributed.tensor (0.7 s) only for tensor parallel runs
            from hpctrain.parallel.tensor import check_tensor_parallel

            check_tensor_parallel(cfg, topology)
        if topology.cp > 1:
            check_context_parallel(cfg, topology)
        check_sync_batchnorm(cfg)

    # ---------------------------------------------------------------- building

    def setup(self, factory: Factory, *, loss_fn: LossFn,
              make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
              make_scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler | None],
              ) -> None:
        """Build the model with ``torch.manual_seed(seed); factory()``'s weights, its optimizer
        and schedule, and the loss scaler this strategy needs."""
        self.loss_fn = loss_fn if self.context is None else self.context.loss(loss_fn)
        self.model = self.build_model(factory)
        self._holds_part = self.find_part()
        self.optimizer = self.wrap_optimizer(make_optimizer(self.model))
        self.scheduler = make_scheduler(self.optimizer)
        self.precision = Precision(self.precision_mode, self.device, scaler=self.grad_scaler())
        self.whole = self.meta_model(factory) if self.holds_part else None

    def meta_model(self, factory: Factory) -> nn.Module:
        """The whole model on meta: the structure ``build_model`` kept (a factory that loads
        weights refuses the meta device), else ``factory()`` built there."""
        return self.skeleton if self.skeleton is not None else on_meta(factory)

    def build_model(self, factory: Factory) -> nn.Module:
        if self.env.distributed and self.topology.model_split:
            built = build_structure(factory, seed=self.seed)
            if built.loaded:  # a factory that loads weights (from_pretrained): rank 0's, sent to every rank
                self.skeleton = meta_copy(built.skeleton)
                return self.parallelize(whole_from_rank0(built, device=self.device))
        torch.manual_seed(self.seed)
        return self.parallelize(factory().to(self.device))

    def parallelize(self, model: nn.Module) -> nn.Module:
        """The documented order: (fp8 linears) -> tensor parallel -> activation checkpointing -> compile ->
        data parallel."""
        model = self.precision.convert(model)  # precision=fp8: torchao's float8 linears, before any wrapper
        if self.env.distributed and self.topology.tp > 1:  # torch.distributed.tensor (0.7 s) only for tp runs
            from hpctrain.parallel.tensor import apply_tp

            assert self.mesh is not None
            apply_tp(model, mesh=self.mesh["tp"], sequence_parallel=self.cfg.sequence_parallel)
        if self.context is not None:  # after tp: the split is the model's, whatever holds its weights
            self.context.apply(model)
        model = apply_activation_checkpointing(model, mode=self.cfg.activation_checkpointing)
        if self.cfg.sync_batchnorm and self.env.distributed:  # before the wrappers, which see its modules
            model = convert_sync_batchnorm(model, self.eval_group())
        if not self.env.distributed:
            return self.compiled(model)
        return self.wrap_data_parallel(self.compiled(model))

    def compiled(self, model: nn.Module) -> nn.Module:
        return torch.compile(model) if self.compile else model  # type: ignore[return-value]

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 loss scaling; where ranks hold shards, one whose inf check sees every rank's."""
        if self.precision_mode != "fp16":
            return None
        if self.holds_part:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device=self.device.type)
        return torch.amp.GradScaler(self.device.type)

    def _build_mesh(self) -> DeviceMesh | None:
        """The topology's mesh, once per run, when the model is cut over ranks or the strategy
        shards over it (:attr:`needs_mesh`); data parallel over the whole world needs none (None
        also in one process)."""
        if not (self.env.distributed and (self.needs_mesh or self.topology.model_split)):
            return None
        return build_mesh(self.topology, self.device)

    @property
    def holds_part(self) -> bool:
        """Does this rank hold only a part of the model (shards, a stage), not the whole?"""
        return self._holds_part

    def find_part(self) -> bool:
        return is_sharded(self.model)

    @property
    def inner(self) -> nn.Module:
        """The user's module inside the wrappers (DDP, torch.compile)."""
        return unwrap(self.model)

    # ---------------------------------------------------------------- the step

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Inner micro-steps of accumulation: no gradient all-reduce / reduce-scatter."""
        return _NO_CONTEXT

    def micro_step(self, inputs: Any, targets: torch.Tensor, mask: torch.Tensor | None, *, sync: bool,
                   accum: int, forward_done: Callable[[], None] = _nothing) -> torch.Tensor:
        """Forward and backward of one micro-batch; the loss divided by ``accum`` for the
        gradients, returned detached. ``forward_done`` is called between the two (for timing)."""
        assert self.loss_fn is not None, "setup() first"
        inputs, targets, mask = real_samples(inputs, targets, mask)  # padding never reaches BatchNorm
        step = _NO_CONTEXT if self.context is None else self.context.step(inputs)  # cp on CUDA: ring attention
        with _NO_CONTEXT if sync else self.no_sync(), step:
            with self.precision.autocast():
                loss = self.loss_fn(self.model(inputs), targets, mask)
                if accum > 1:
                    loss = loss / accum
            forward_done()
            self.precision.backward(loss)
        return loss.detach()

    def optimizer_step(self) -> None:
        """Clip (train.clip_grad_norm), step (skipped on fp16 overflow), zero the grads, step the schedule."""
        assert self.optimizer is not None, "setup() first"
        if self.max_norm is not None:
            self.precision.unscale(self.optimizer)
            self.clip_grad_norm(self.max_norm)
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def clip_grad_norm(self, max_norm: float) -> None:
        """Sharded gradients (DTensors) need the norm over every shard; whole ones, torch's own."""
        if self.holds_part:
            clip_grad_norm_(self.model.parameters(), max_norm)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    # ---------------------------------------------------------------- state, weights, evaluation

    def checkpoint_state(self) -> ModelState:
        """Model and optimizer as a checkpoint saves and loads them (whole, or this rank's shards)."""
        assert self.optimizer is not None, "setup() first"
        view = ShardedState(self.model, self.optimizer) if self.holds_part else WholeState(self.model, self.optimizer)
        view.strategy = self.cfg.strategy
        view.before_save = self.sync_buffers
        return view

    def buffer_groups(self) -> list[Any]:
        """The groups whose ranks hold the same buffers, broadcast over in turn: the world (None),
        or on a mesh the data-parallel replicas, then the tensor-parallel ranks (a pipeline
        stage's buffers live on that stage's ranks only)."""
        if not self.env.distributed:
            return []
        if self.mesh is None:
            return [None]
        groups = [self.mesh["dp"].get_group()]
        if self.topology.cp > 1:
            groups.append(self.mesh["cp"].get_group())
        return groups + [self.mesh["tp"].get_group()] if self.topology.tp > 1 else groups

    def sync_buffers(self) -> None:
        """Every rank's buffers (BatchNorm statistics) set to rank 0's of its replica group:
        before validation, checkpoints and model.pt (see :mod:`hpctrain.parallel.buffers`)."""
        sync_buffers(self.inner, self.buffer_groups())

    def buffer_names(self) -> list[str]:
        """The whole model's buffer names (model.pt's, buffers_sha256's)."""
        return [clean_name(name) for name, _ in (self.whole if self.whole is not None else self.inner).named_buffers()]

    def param_names(self) -> list[str]:
        """The whole model's parameter names, in order (model.pt's, params_sha256's)."""
        return param_names(self.whole if self.whole is not None else self.inner)

    def export_source(self) -> Source:
        """The whole model's tensors, streamed one at a time to rank 0 (every rank consumes them)."""
        return model_source(self.model, is_main=self.env.is_main)

    def flops_module(self) -> nn.Module:
        """A module whose forward counts the whole model's FLOPs (on meta when this rank holds a part)."""
        return self.whole if self.whole is not None else self.inner

    def eval_group(self) -> Any:
        """The process group evaluation merges over: one rank per data-parallel replica (None:
        every rank is its own replica, the default group)."""
        if not self.topology.model_split:
            return None
        return dp_group(self.mesh)

    def evaluate(self, loader: EvalBatches, metrics: Sequence[Metric], task: Task, *,
                 batch_size: int) -> EvalResult:
        """Every validation sample of the data-parallel replicas once; the global metrics on every
        rank, with every rank's buffers first set to rank 0's (the model that model.pt holds)."""
        self.sync_buffers()
        return evaluate(self.model, loader, metrics, self.env, self.device, self.precision, task=task,
                        group=self.eval_group())
