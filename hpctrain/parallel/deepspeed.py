"""``parallel.strategy=deepspeed``: DeepSpeed ZeRO stage 1-3 from hpctrain's config (the
``deepspeed`` extra).

DeepSpeed owns the optimizer step, the gradient reduction and (stage 3) the parameter
gathering, so the strategy's micro-step runs forward, ``engine.backward`` (which divides by
the accumulation steps itself) and ``engine.step`` (which steps the optimizer only at an
accumulation boundary); its optimizer step does nothing.

An lr schedule is handed to DeepSpeed (``deepspeed.initialize(lr_scheduler=...)``), which
steps it with the optimizer, at the end of each accumulation window. Checkpoints are
DeepSpeed's own (:func:`save_engine` / :func:`load_engine`: per-rank model and
ZeRO-partitioned optimizer files, and the scheduler), written inside hpctrain's committed
checkpoint directory; :func:`consolidated_state` turns them into one state dict.

On a machine without CUDA it runs on CPU with gloo (``DS_ACCELERATOR=cpu``). Its first use
JIT-builds C++ ops with ninja; ``TORCH_EXTENSIONS_DIR`` (default: ``torch_extensions`` in
hpctrain's cache, :func:`hpctrain.core.cache.cache_root`) keeps them for the next run.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hpctrain.checkpoint.preempt import children_shielded
from hpctrain.checkpoint.view import CheckpointView, register_format
from hpctrain.config.parallel import ParallelConfig
from hpctrain.core.cache import cache_root
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import RunError, UserError, agree
from hpctrain.core.section import ConfigError
from hpctrain.parallel.base import Factory, LossFn, Strategy, _nothing
from hpctrain.parallel.buffers import real_samples
from hpctrain.parallel.meta import build_structure, materialize, meta_copy
from hpctrain.parallel.state import ModelState
from hpctrain.precision import Precision
from hpctrain.weights.export import Source, dict_source

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.core.topology import Topology

INSTALL_HINT = ("pip install -c <(echo torch==$(python -c 'import torch; print(torch.__version__)')) "
                "'hpctrain[deepspeed]'  (the constraint keeps pip from replacing your torch)")
DEEPSPEED_DIR = "deepspeed"  # format=deepspeed: DeepSpeed's own files, inside the checkpoint directory
TAG = "state"  # DeepSpeed's checkpoint tag: one per hpctrain checkpoint directory, which names the step


class DeepSpeedMissing(UserError):
    """strategy=deepspeed without DeepSpeed installed."""


class DeepSpeedWorldChange(UserError):
    """A DeepSpeed checkpoint resumed at another world size: its ZeRO partitions do not fit."""


class DeepSpeedCheckpointError(RunError):
    """DeepSpeed could not load a checkpoint that hpctrain's manifest says is intact."""


def extensions_cache() -> Path:
    """Where DeepSpeed's JIT-built ops are kept (``TORCH_EXTENSIONS_DIR`` unless set)."""
    return cache_root() / "torch_extensions"


def import_deepspeed() -> ModuleType:
    """DeepSpeed, set up for this machine (CPU accelerator without CUDA, a shared op cache)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_cache()))
    try:
        return importlib.import_module("deepspeed")
    except ImportError as err:
        raise DeepSpeedMissing(f"parallel.strategy=deepspeed needs DeepSpeed, which is not importable ({err}); "
                               f"hint: {INSTALL_HINT}") from None


def ds_config(*, stage: int, micro_batch: int, grad_accum: int = 1, clip_grad_norm: float = 0.0,
              precision: str = "fp32") -> dict[str, Any]:
    """The DeepSpeed config dict for hpctrain's settings (one place to read what is mapped)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": {"stage": stage},
        # hpctrain hands ZeRO the configured torch optimizer (SGD or AdamW); DeepSpeed's "tested"
        # list names its own, but ZeRO only partitions the param groups and steps the optimizer
        # on them (tests/train/test_deepspeed.py: SGD with momentum under ZeRO-3 = one process)
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip_grad_norm,
        "steps_per_print": 2**31 - 1,  # hpctrain logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return config


def init_deepspeed(model: nn.Module, optimizer: torch.optim.Optimizer, *, env: ClusterEnv, stage: int,
                   micro_batch: int, grad_accum: int = 1, clip_grad_norm: float = 0.0, precision: str = "fp32",
                   scheduler: Any = None) -> Any:
    """The DeepSpeed engine around ``model`` and a (fresh) torch ``optimizer`` over its parameters.
    ``scheduler``: an lr schedule over ``optimizer`` (or a callable that builds one from it), which
    the engine steps after each optimizer step, at the end of an accumulation window. Call after
    hpctrain started the process group: DeepSpeed reuses it."""
    deepspeed = import_deepspeed()
    # DeepSpeed reads its rank from the environment, as its own launcher sets it; hpctrain's
    # ClusterEnv may come from Slurm variables or a test harness instead.
    for name, value in (("LOCAL_RANK", env.local_rank), ("RANK", env.rank), ("WORLD_SIZE", env.world_size)):
        os.environ.setdefault(name, str(value))
    if not torch.distributed.is_initialized():  # one process, no launcher: DeepSpeed starts a group of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # (without these it looks for MPI instead)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    config = ds_config(stage=stage, micro_batch=micro_batch, grad_accum=grad_accum,
                       clip_grad_norm=clip_grad_norm, precision=precision)
    with children_shielded():  # its first use builds ops with ninja: a forwarded SIGUSR1 must not kill it
        deepspeed.init_distributed(dist_backend=backend)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, lr_scheduler=scheduler)
    return engine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DeepSpeed(Strategy):
    """The DeepSpeed engine around the model (activation checkpointing and compile applied first)
    and hpctrain's torch optimizer; the lr schedule is handed to the engine, which steps it."""

    name = "deepspeed"
    steps_in_engine = True

    @classmethod
    def checkpoint_format(cls, cfg: ParallelConfig) -> str:
        return "deepspeed"

    @classmethod
    def check(cls, cfg: Config, topology: Topology) -> None:
        """DeepSpeed importable, with the install hint (a UserError), before the process group; not
        with precision=fp8 (the model's linear layers are converted before a strategy wraps it, and
        the engine sets its own precision)."""
        if cfg.precision == "fp8":
            raise ConfigError("precision=fp8 is not available with parallel.strategy=deepspeed (its engine sets its "
                              "own precision); hint: parallel.strategy=fsdp, or precision=bf16")
        super().check(cfg, topology)
        import_deepspeed()

    def setup(self, factory: Factory, *, loss_fn: LossFn,
              make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
              make_scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler | None],
              ) -> None:
        self.loss_fn = loss_fn
        model = self.build_model(factory)  # no data-parallel wrapper: the engine is one
        self.optimizer = make_optimizer(model)
        self.scheduler = make_scheduler(self.optimizer)  # the engine steps it (once per accumulation window)
        self.model = init_deepspeed(model, self.optimizer, env=self.env, stage=self.cfg.deepspeed_stage,
                                    micro_batch=self.micro_batch, grad_accum=self.grad_accum,
                                    clip_grad_norm=self.max_norm or 0.0, precision=self.precision_mode,
                                    scheduler=self.scheduler)
        self.scheduler = None  # stepped by the engine, saved in DeepSpeed's checkpoint
        self.precision = Precision(self.precision_mode, self.device, scaler=None)  # DeepSpeed scales fp16 itself
        self._holds_part = True
        self.whole = self.meta_model(factory)

    def build_model(self, factory: Factory) -> nn.Module:
        """A factory that loads weights (it refuses the meta device: ``from_pretrained``) runs on rank
        0 only; the other ranks get its structure and its weights (the engine wants whole modules)."""
        if not self.env.distributed:
            return super().build_model(factory)
        built = build_structure(factory, seed=self.seed)
        if not built.loaded:
            return super().build_model(factory)
        self.skeleton = meta_copy(built.skeleton)
        model = self.parallelize(built.skeleton)
        materialize(model, device=self.device, factory=factory, seed=self.seed, full=built.full)
        return model

    def micro_step(self, inputs: Any, targets: torch.Tensor, mask: torch.Tensor | None, *, sync: bool,
                   accum: int, forward_done: Callable[[], None] = _nothing) -> torch.Tensor:
        assert self.loss_fn is not None, "setup() first"
        engine: Any = self.model
        inputs, targets, mask = real_samples(inputs, targets, mask)  # padding never reaches BatchNorm
        loss = self.loss_fn(engine(inputs), targets, mask)
        forward_done()
        engine.backward(loss)
        engine.step()  # the optimizer steps (and clips) when this closes an accumulation window
        loss = loss.detach()
        return loss / accum if accum > 1 else loss

    def optimizer_step(self) -> None:
        """The engine clipped and stepped in the window's last micro-step."""

    def checkpoint_state(self) -> ModelState:
        assert self.optimizer is not None, "setup() first"
        view = DeepSpeedState(self.model, self.optimizer)
        view.before_save = self.sync_buffers
        return view

    def export_source(self) -> Source:
        """ZeRO-3: DeepSpeed's own gather, to rank 0; ZeRO-1/2 keep whole parameters on every rank."""
        engine: Any = self.model
        zero3 = engine.zero_optimization_stage() == 3
        return dict_source(deepspeed_full_state(self.model, self.env) if self.env.is_main or zero3 else {})


def deepspeed_full_state(engine: Any, env: ClusterEnv) -> dict[str, torch.Tensor]:
    """The whole model's state on rank 0's CPU: ZeRO-3 gathers its partitioned parameters (every
    rank calls it); ZeRO-1/2 keep whole parameters on every rank."""
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # DeepSpeed's own gather, to rank 0
        return {k: v.detach().cpu() for k, v in state.items()} if env.is_main and state else {}
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}


class DeepSpeedState(CheckpointView):
    """Model + optimizer as DeepSpeed saves them (format=deepspeed): its own files under
    ``deepspeed/``, every rank its ZeRO partitions, rank 0 also the module and the scheduler.
    A save runs collectives on the training process group, so it is never written in the
    async writer thread; a resume needs DeepSpeed at the world size that wrote it; the whole
    model's weights come from DeepSpeed's ``zero_to_fp32`` (``hpctrain ckpt export``)."""

    format = "deepspeed"
    files_dir = DEEPSPEED_DIR
    written_by = "parallel.strategy=deepspeed"
    background = False
    strategy = "deepspeed"

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer) -> None:
        self.engine, self.optimizer = engine, optimizer
        self.before_save: Callable[[], None] = lambda: None

    def gather(self) -> None:
        """Every rank's buffers made rank 0's: ZeRO-1/2 save rank 0's module, ZeRO-3 every rank's
        own, and a resume must give every rank the same."""
        self.before_save()

    def write(self, state: Any, directory: Path, rank: int, group: Any) -> list[Path]:
        """DeepSpeed's own save (a collective that ends in a barrier: every rank's files are
        complete) into ``directory/deepspeed``; this rank's files of it."""
        target = directory / DEEPSPEED_DIR
        save_engine(self.engine, target)
        return engine_files(target, rank)

    def check_resume(self, path: Path, manifest: dict[str, Any], world_size: int) -> None:
        super().check_resume(path, manifest, world_size)
        check_world(int(manifest.get("world_size", 0)), world_size, path)

    def load(self, path: Path, manifest: dict[str, Any], replicated: dict[str, Any], group: Any) -> dict[str, Any]:
        """DeepSpeed's ``engine.load_checkpoint`` (module, optimizer partitions, scheduler; a
        collective), every rank's failure every rank's."""
        agree(f"loading DeepSpeed's state of {path}", lambda: load_engine(self.engine, path / DEEPSPEED_DIR))
        return replicated

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.engine.module.parameters())

    def checked_module(self) -> Any:
        return self.engine

    @classmethod
    def export(cls, path: Path) -> Source:
        """The whole model's fp32 weights, the ZeRO partitions merged by DeepSpeed's zero_to_fp32."""
        return dict_source(consolidated_state(path / DEEPSPEED_DIR))


register_format(DeepSpeedState.format, DeepSpeedState)  # by path for torch-free commands: checkpoint_formats.py


# ---------------------------------------------------------------- checkpoints


def save_engine(engine: Any, directory: Path) -> None:
    """DeepSpeed's own checkpoint of the engine (module, ZeRO-partitioned optimizer state, lr
    scheduler, engine counters) into ``directory``. A collective: every rank calls it, in the
    training thread (DeepSpeed's barriers share the training process group)."""
    engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)


def engine_files(directory: Path, rank: int) -> list[Path]:
    """The files of ``directory`` that ``rank`` wrote: its ``zero_pp_rank_<rank>_`` partitions,
    and for rank 0 also the whole-model file and DeepSpeed's recovery scripts. (Each rank lists
    its own: on a node-local tier a rank sees only its node's files.)"""
    mine = re.compile(rf"(^|_)zero_pp_rank_{rank}_")
    anyone = re.compile(r"(^|_)zero_pp_rank_\d+_")
    files = sorted(p for p in Path(directory).rglob("*") if p.is_file())
    return [p for p in files if mine.search(p.name) or (rank == 0 and not anyone.search(p.name))]


def check_world(saved_world: int, world: int, path: Path) -> None:
    """A DeepSpeed checkpoint resumes at the world size that wrote it (its ZeRO partitions are
    per rank); fail before training otherwise, naming both sizes."""
    if saved_world != world:
        raise DeepSpeedWorldChange(
            f"checkpoint {path} holds DeepSpeed ZeRO state partitioned over {saved_world} ranks and cannot "
            f"resume at world size {world}; hint: resume with `hpctrain run -n {saved_world}`, or export the "
            f"weights (`hpctrain ckpt export {path} model.pt`) and start a new run from them")


def load_engine(engine: Any, directory: Path) -> None:
    """Put a :func:`save_engine` checkpoint back into a freshly built engine (module, optimizer
    state, scheduler). A collective: every rank calls it."""
    load_path, _ = engine.load_checkpoint(str(directory), tag=TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise DeepSpeedCheckpointError(f"DeepSpeed could not load its checkpoint from {directory / TAG}; "
                                       f"hint: `hpctrain ckpt verify {directory.parent}`")


def consolidated_state(directory: Path) -> dict[str, torch.Tensor]:
    """The whole model's fp32 state dict from a :func:`save_engine` checkpoint, without a
    process group (DeepSpeed's ``zero_to_fp32`` merges the ZeRO partitions)."""
    import_deepspeed()  # sets DeepSpeed's accelerator first
    zero_to_fp32 = importlib.import_module("deepspeed.utils.zero_to_fp32")
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
    return {name: value.detach().clone() for name, value in state.items()}
