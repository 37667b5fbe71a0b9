"""``parallel.pp > 1``: pipeline stages (torch.distributed.pipelining) around the data-parallel
strategy each stage runs (``parallel.strategy``: FSDP over dp, tensor parallel inside). The
schedule runs forward and backward of a whole micro-step; validation runs forward through the
stages (the schedule's own ``eval``); checkpoints go through DCP under the whole model's names;
``model.pt`` is streamed by one owner per stage.

A factory that loads weights (``from_pretrained``: it refuses the meta device) runs on rank 0 only,
as under FSDP (:mod:`hpctrain.parallel.meta`): every rank cuts the structure rank 0 sends into its
stage(s), wraps them on meta, and receives rank 0's tensors into them by the whole model's names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hpctrain.config.parallel import ParallelConfig
from hpctrain.core.env import collective_device
from hpctrain.core.section import ConfigError
from hpctrain.evaluation.evaluate import EvalResult
from hpctrain.evaluation.pipeline import evaluate_pipeline
from hpctrain.models.family import family_for
from hpctrain.models.registry import build_model
from hpctrain.models.user import CAUSAL_LM
from hpctrain.parallel.base import Factory, Strategy, _nothing
from hpctrain.parallel.clip import clip_grad_norm_
from hpctrain.parallel.meta import build_structure, load_from_rank0, meta_copy, meta_structure
from hpctrain.parallel.pipeline import PipelineStep, build_pipeline, check_split
from hpctrain.parallel.pipeline_state import PipelineState
from hpctrain.parallel.state import ModelState
from hpctrain.tasks.metrics import Metric
from hpctrain.weights.export import Source, pipeline_source

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.core.topology import Topology
    from hpctrain.data import EvalBatches
    from hpctrain.tasks import Task


def _check_users_split(cfg: Config, stages: int) -> None:
    """A user's model (built on meta: no memory) cut by its family's split, before the process group;
    one that loads weights (no meta structure) when rank 0 has built it (:meth:`Pipeline.build_model`)."""
    model = meta_structure(lambda: build_model(cfg.model.name, cfg.model.num_classes, config=cfg.model,
                                               task=CAUSAL_LM))
    if model is not None:
        check_stages(model, cfg.parallel.pp, stages, cfg.model.name)


def check_stages(model: nn.Module, pp: int, stages: int, name: str) -> None:
    """Can ``model`` (on meta) be cut into ``stages``? A ConfigError (exit 2) says why not."""
    try:
        check_split(model, stages)
    except ValueError as err:
        raise ConfigError(f"parallel.pp={pp} cannot cut model.name={name} into {stages} stages: {err}") from err


class Pipeline(Strategy):
    name = "pipeline"
    wraps_a_strategy = True

    @classmethod
    def checkpoint_format(cls, cfg: ParallelConfig) -> str:
        return "dcp"

    @classmethod
    def check(cls, cfg: Config, topology: Topology) -> None:
        super().check(cfg, topology)
        p = cfg.parallel
        if cfg.train.compile or p.meta_init:
            raise ConfigError(f"parallel.pp={p.pp} builds its stages without train.compile or parallel.meta_init "
                              "yet; hint: train.compile=false parallel.meta_init=false")
        if not cfg.data.drop_last:
            # the schedule splits each rank's batch into equal micro-batches and its loss sees no
            # mask: padding samples would be trained on as real ones
            raise ConfigError(f"parallel.pp={p.pp} needs data.drop_last=true (a pipeline cannot leave the last "
                              "step's padding samples out); hint: data.drop_last=true")
        # a family sized by the model section (the built-in ones) is checked by its shape here;
        # users' models when their stages are cut
        family = family_for(cfg.model)
        shape = family.shape(cfg.model) if family is not None and family.shape is not None else None
        if shape is not None and shape.tied:
            raise ConfigError(f"parallel.pp={p.pp}: the first and last stages cannot share the tied embedding; "
                              "hint: model.tie_weights=false")
        stages = p.pp * (p.virtual_stages if p.pp_schedule == "interleaved_1f1b" else 1)
        if shape is not None and shape.layers < stages:
            # any count >= the stages splits (unevenly if need be); fewer leaves a stage empty
            raise ConfigError(f"parallel.pp={p.pp} makes {stages} pipeline stages, more than model.n_layers="
                              f"{cfg.model.n_layers} blocks; hint: model.n_layers>={stages}, or a lower parallel.pp"
                              + (" or parallel.virtual_stages" if stages > p.pp else ""))
        if shape is None and ":" in cfg.model.name:
            _check_users_split(cfg, stages)

    def __init__(self, *args: Any, stage: type[Strategy], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # what wraps each stage: the configured data-parallel strategy, on the same mesh
        self.stage_strategy = stage(self.topology, self.env, self.device, self.cfg, precision=self.precision_mode,
                                    seed=self.seed, mesh=self.mesh)
        self.step: PipelineStep | None = None

    def build_model(self, factory: Factory) -> nn.Module:
        """The whole model built seeded (as one process builds it), cut into this rank's stage(s);
        a factory that loads weights: rank 0's structure cut on meta, then rank 0's weights sent in."""
        assert self.mesh is not None and self.loss_fn is not None
        built = build_structure(factory, seed=self.seed)
        if built.loaded:
            self.skeleton = meta_copy(built.skeleton)  # setup's whole-model view (names, FLOPs)
            check_stages(built.skeleton, self.cfg.pp, self.n_stages, "(the model rank 0 loaded)")
            model = built.skeleton
        else:
            torch.manual_seed(self.seed)
            model = factory().to(self.device)
        loss_fn = self.loss_fn
        self.step = build_pipeline(model, pp_group=self.mesh["pp"].get_group(),
                                   device=self.device, schedule=self.cfg.pp_schedule,
                                   microbatches=self.cfg.microbatches, loss_fn=lambda out, tgt: loss_fn(out, tgt, None),
                                   virtual_stages=self.cfg.virtual_stages, grad_accum=self.grad_accum,
                                   wrap=self.stage_strategy.parallelize)
        if built.loaded:
            load_from_rank0(self.step.model, built.full, device=self.device, name_of=self.step.global_name)
        return self.step.model

    @property
    def n_stages(self) -> int:
        return self.cfg.pp * (self.cfg.virtual_stages if self.cfg.pp_schedule == "interleaved_1f1b" else 1)

    def find_part(self) -> bool:
        return True

    def setup(self, factory: Factory, **kwargs: Any) -> None:
        super().setup(factory, **kwargs)
        assert self.step is not None
        self.step.grad_scaler = self.precision.scaler  # fp16: the schedule's loss function scales the loss

    def micro_step(self, inputs: Any, targets: torch.Tensor, mask: torch.Tensor | None, *, sync: bool,
                   accum: int, forward_done: Callable[[], None] = _nothing) -> torch.Tensor:
        assert self.step is not None
        with self.precision.autocast():
            loss = self.step(inputs, targets)
        return loss / accum if accum > 1 else loss

    def clip_grad_norm(self, max_norm: float) -> None:
        """The squared norms of every stage, summed over the pipeline."""
        assert self.step is not None
        clip_grad_norm_(self.step.parameters(), max_norm, pp_group=self.step.group)

    def checkpoint_state(self) -> ModelState:
        assert self.step is not None and self.optimizer is not None
        view = PipelineState(self.step, self.optimizer, self.cfg.strategy)
        view.before_save = self.sync_buffers
        return view

    def export_source(self) -> Source:
        assert self.step is not None
        step, topo, rank = self.step, self.topology, self.env.rank
        # one rank of each stage owns its names: replica 0's tp rank 0
        return pipeline_source({step.global_name(k): v for k, v in step.model.state_dict().items()},
                               sender=topo.dp_rank(rank) == 0 and rank % topo.tp == 0,
                               rank=self.env.rank, device=collective_device())

    def evaluate(self, loader: EvalBatches, metrics: Sequence[Metric], task: Task, *,
                 batch_size: int) -> EvalResult:
        """Forward through the stages, metrics on the last; the tp ranks of a stage count once;
        every stage's buffers first set to its replica 0's (the ones model.pt holds)."""
        assert self.step is not None
        self.sync_buffers()
        return evaluate_pipeline(self.step, loader, metrics, self.env, self.device, self.precision, task=task,
                                 batch_size=batch_size, leader=self.env.rank % self.topology.tp == 0)
