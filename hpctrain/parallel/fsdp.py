"""``parallel.strategy=fsdp`` / ``hsdp``. FSDP2 (``fully_shard``): parameters, gradients and
optimizer state sharded over the data-parallel mesh. One unit per transformer block (found from the
model's layout: a Hugging Face model's ``_no_split_modules`` classes, else its repeated blocks, see
:mod:`hpctrain.parallel.units`; per child module for other models), then the root, so only one
unit's full parameters exist at a time.

``reshard_after_forward=True`` frees the gathered parameters after each unit's forward and
gathers them again in backward (ZeRO-3); ``False`` keeps them until backward (ZeRO-2).
A 2D mesh (replicate, shard) gives HSDP. Accumulation: gradients are reduce-scattered after
every micro-step and summed into each rank's shard, so no rank ever holds them whole (as
torchtitan); ``parallel.reduce_every_microstep=false`` trades that memory for communication:
:func:`fsdp_no_sync` skips the reduce-scatter on inner micro-steps (FSDP2 has no ``no_sync()``),
and every rank accumulates whole gradients until the last one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from hpctrain.config.parallel import ParallelConfig, resolve_param_dtype
from hpctrain.parallel.base import Factory, Strategy
from hpctrain.parallel.expert import apply_expert_parallel, shard_experts
from hpctrain.parallel.mesh import dp_mesh
from hpctrain.parallel.meta import build_structure, materialize, meta_copy
from hpctrain.parallel.units import shard_units

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision(param_dtype: str = "fp32", reduce_dtype: str = "fp32") -> MixedPrecisionPolicy:
    """Parameters gathered in ``param_dtype`` for compute; gradients reduced in ``reduce_dtype``."""
    gathered = None if param_dtype == "fp32" else _DTYPES[param_dtype]
    return MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=_DTYPES[reduce_dtype])


def offload_policy(cpu_offload: bool) -> OffloadPolicy:
    # Pinned host memory needs an accelerator: the defaults fail on a CPU-only machine.
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()


def apply_fsdp(model: nn.Module, *, mesh: DeviceMesh, reshard_after_forward: bool = True,
               param_dtype: str = "fp32", reduce_dtype: str = "fp32", cpu_offload: bool = False) -> nn.Module:
    """``fully_shard`` each unit, then the root; returns the same module (now an FSDPModule)."""
    mp, offload = mixed_precision(param_dtype, reduce_dtype), offload_policy(cpu_offload)
    # parallel.ep's experts: FSDP units of their own over edp, or (edp = 1) left to expert parallelism's hook
    ignored = shard_experts(model, lambda unit, edp: fully_shard(
        unit, mesh=edp, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)) or None
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload,
                    ignored_params=ignored)
    # The root's own parameters (embeddings, head) are used last in backward: resharding them
    # after forward would only gather them again at once.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload,
                ignored_params=ignored)
    return model


@contextlib.contextmanager
def fsdp_no_sync(model: nn.Module, skip: bool = True) -> Iterator[None]:
    """Inside: gradients accumulate unsharded, with no reduce-scatter (an inner micro-step)."""
    root = model if isinstance(model, FSDPModule) else None
    if not skip or root is None:
        yield
        return
    root.set_requires_gradient_sync(False)  # recurses into every FSDP unit
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def sharded_grad_scaler(device: torch.device) -> torch.amp.GradScaler:
    """fp16 loss scaling whose inf check sees every rank's gradient shard (one all-reduce)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device.type)


class FSDP(Strategy):
    """FSDP2 over the data-parallel mesh (HSDP on a (replicate, shard) mesh); tensor parallel
    inside when ``parallel.tp > 1``. Checkpoints: every rank its shards (DCP)."""

    name = "fsdp"
    offload = False  # parameters, gradients and optimizer state in host memory (fsdp_offload.py)
    needs_mesh = True  # shards over the mesh's dp dim (replicate x shard under HSDP)

    @classmethod
    def checkpoint_format(cls, cfg: ParallelConfig) -> str:
        return "dcp"

    def build_model(self, factory: Factory) -> nn.Module:
        """With ``parallel.meta_init``, or a factory that loads weights (it refuses the meta device:
        ``from_pretrained``): built on meta, sharded, then given rank 0's one-process init or loaded
        weights, so no rank ever holds the whole model on the device, and only rank 0 in host memory."""
        if not self.env.distributed:
            return super().build_model(factory)
        built = build_structure(factory, seed=self.seed)
        if not (self.cfg.meta_init or built.loaded):
            return super().build_model(factory)
        if built.loaded:  # the factory cannot run on meta: setup's whole-model view is this copy
            self.skeleton = meta_copy(built.skeleton)
        model = self.parallelize(built.skeleton)
        # Offloaded shards live in host memory; FSDP moves each to the device when it is gathered.
        materialize(model, device=torch.device("cpu") if self.offload else self.device, factory=factory, seed=self.seed,
                    full=built.full)
        return model

    def compiled(self, model: nn.Module) -> nn.Module:
        if self.compile:
            for unit in shard_units(model):  # per block, in place: FSDP then shards compiled blocks
                unit.compile()
        return model

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        if self.topology.dp_cp == 1:  # context parallel: FSDP shards over dp x cp (hpctrain.parallel.mesh.dp_mesh)
            return model
        assert self.mesh is not None
        if self.topology.ep > 1:  # first: the experts split over ep, which FSDP then shards over edp only
            apply_expert_parallel(model, mesh=self.mesh, topology=self.topology)
        return apply_fsdp(model, mesh=dp_mesh(self.mesh), reshard_after_forward=self.cfg.reshard_after_forward,
                          param_dtype=resolve_param_dtype(self.cfg, self.precision_mode),
                          reduce_dtype=self.cfg.reduce_dtype, cpu_offload=self.offload)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        # The default reduces on inner micro-steps too: the gradients stay sharded (see the module's docstring).
        return fsdp_no_sync(self.model, skip=not self.cfg.reduce_every_microstep)
