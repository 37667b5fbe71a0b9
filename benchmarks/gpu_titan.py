"""torchtitan 0.2.x's row of the prepared GPU run (``benchmarks/gpu_run.py``): its own ``Trainer``
on the run's Llama shape, reading the run's token stream (``benchmarks/gpu_data.py``).

Why 0.2.x: the device's image has torch 2.11; torchtitan 0.2.2 (20 Feb 2026) was released
against the nightlies of torch 2.11's branch cut, and 0.3 (``benchmarks/bench/mfu_titan.py``)
needs torch 2.13's APIs. 0.2.x builds its job from a ``JobConfig`` (tyro command-line
arguments, :func:`job_args`) and a registered ``TrainSpec``; the bench registers one
(``hpctrain_bench``) that is torchtitan's own Llama 3 spec (model, ``parallelize_llama`` =
compile per block -> FSDP2 with bf16 parameters and fp32 reduction, also on one GPU, its
optimizer, LR schedule and cross-entropy) with two pieces swapped through its documented
extension points: the model flavour (the run's shape) and the dataloader (the stream's windows
in hpctrain's order). No tokenizer: the stream is ids already.

The child drives ``Trainer.train_step`` itself so the measured steps are timed from a device sync
after the warm-up to one after the last step, as hpctrain's rows are; the losses are the ones
torchtitan's metrics processor logs (every ``warmup`` steps). Run as
``python benchmarks/gpu_titan.py SETTINGS.json RESULT.json`` with RANK/WORLD_SIZE/MASTER_* set.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

SPEC_NAME, FLAVOR = "hpctrain_bench", "bench"


@dataclass(frozen=True)
class TitanSettings:
    """The row's shape, batch, steps and optimizer: the same numbers as the hpctrain rows'."""

    spec: str            # gpu_data's StreamSpec JSON
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    batch: int
    warmup: int
    measured: int
    lr: float
    compile: bool
    dump: str            # torchtitan's dump folder (its logs)


def ffn_args(hidden: int, ffn_hidden: int) -> tuple[float, int]:
    """(ffn_dim_multiplier, multiple_of) that make torchtitan's SwiGLU width exactly ``ffn_hidden``:
    it computes multiple_of * ceil(multiplier * int(8 * hidden / 3) / multiple_of)."""
    base = int(2 * (4 * hidden) / 3)
    multiplier = ffn_hidden / base
    for multiple_of in (1024, 256, 128, 64, 16, 1):
        width = multiple_of * -(-int(multiplier * base) // multiple_of)
        if width == ffn_hidden:
            return multiplier, multiple_of
    raise ValueError(f"no torchtitan FFN arguments give width {ffn_hidden} at dim {hidden}")


def model_args(s: TitanSettings, vocab: int) -> Any:
    from torchtitan.models.llama3 import TransformerModelArgs

    multiplier, multiple_of = ffn_args(s.hidden, s.ffn_hidden)
    # rope base 10,000 and no rope scaling, as hpctrain's llama; SDPA's causal kernel, as hpctrain's
    return TransformerModelArgs(dim=s.hidden, n_layers=s.layers, n_heads=s.heads, n_kv_heads=s.kv_heads,
                                vocab_size=vocab, ffn_dim_multiplier=multiplier, multiple_of=multiple_of,
                                rope_theta=10_000.0, attn_type="sdpa", attn_mask_type="causal")


def job_args(s: TitanSettings, seq_len: int) -> list[str]:
    """torchtitan's command line for the row: AdamW 0.9/0.95, wd 0.1, eps 1e-8, clip 1.0, constant lr,
    no activation checkpointing, no checkpoints, compile per the row."""
    return ["--model.name", SPEC_NAME, "--model.flavor", FLAVOR, "--job.dump_folder", s.dump,
            "--training.local_batch_size", str(s.batch), "--training.seq_len", str(seq_len),
            "--training.steps", str(s.warmup + s.measured), "--training.max_norm", "1.0",
            "--optimizer.name", "AdamW", "--optimizer.lr", str(s.lr), "--optimizer.eps", "1e-8",
            "--optimizer.weight_decay", "0.1", "--lr_scheduler.warmup_steps", "0",
            "--lr_scheduler.decay_ratio", "0.0", "--activation_checkpoint.mode", "none",
            "--metrics.log_freq", str(s.warmup), "--checkpoint.no-enable",
            *(["--compile.enable"] if s.compile else ["--compile.no-enable"])]


def register(s: TitanSettings) -> None:
    """torchtitan's Llama 3 TrainSpec under SPEC_NAME, with the row's flavour and the stream's loader."""
    import dataclasses

    from gpu_data import read_spec
    from torchtitan.models.llama3 import get_train_spec
    from torchtitan.protocols.train_spec import _extra_train_specs, register_train_spec

    spec = read_spec(s.spec)
    if SPEC_NAME in _extra_train_specs:
        return
    base = get_train_spec()
    register_train_spec(SPEC_NAME, dataclasses.replace(
        base, model_args={FLAVOR: model_args(s, spec.vocab)}, build_dataloader_fn=_build_loader(s.spec),
        build_tokenizer_fn=None, build_validator_fn=None, pipelining_fn=None))


def _build_loader(spec_path: str) -> Any:
    from gpu_data import StreamWindows, read_spec
    from torchtitan.components.dataloader import BaseDataLoader

    class StreamLoader(BaseDataLoader):  # type: ignore[misc]
        """This rank's windows ``[(step * world + rank) * B, ...)`` in order: hpctrain's loader reads them so too."""

        def __init__(self, dp_world_size: int, dp_rank: int, local_batch_size: int) -> None:
            spec = read_spec(spec_path)
            self.windows = StreamWindows(spec, spec.samples)
            self.world, self.rank, self.size, self.step = dp_world_size, dp_rank, local_batch_size, 0

        def __iter__(self) -> Any:
            while True:
                window = self.windows.batch((self.step * self.world + self.rank) * self.size, self.size)
                self.step += 1
                yield {"input": window[:, :-1]}, window[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.step = int(state["step"])

    def build(*, dp_world_size: int, dp_rank: int, job_config: Any, **_: Any) -> StreamLoader:
        return StreamLoader(dp_world_size, dp_rank, job_config.training.local_batch_size)

    return build


def job_config(s: TitanSettings) -> Any:
    """The JobConfig torchtitan's own parser makes of :func:`job_args` (its validation included)."""
    from gpu_data import read_spec
    from torchtitan.config import ConfigManager

    register(s)
    return ConfigManager().parse_args(job_args(s, read_spec(s.spec).seq_len))


def measure(trainer: Any, s: TitanSettings, seq_len: int) -> dict[str, Any]:
    """``warmup`` steps, a device sync, ``measured`` steps, a sync: tokens/s of the measured ones."""
    losses: list[tuple[int, float]] = []
    log = trainer.metrics_processor.log

    def keep(step: int, loss: float, *args: Any, **kwargs: Any) -> None:
        losses.append((step, float(loss)))
        log(step, loss, *args, **kwargs)

    trainer.metrics_processor.log = keep
    data = trainer.batch_generator(trainer.dataloader)
    start = 0.0
    for step in range(1, s.warmup + s.measured + 1):
        trainer.step = step
        trainer.train_step(data)
        if step == s.warmup:
            _sync()
            start = time.perf_counter()
    _sync()
    seconds = time.perf_counter() - start
    tokens = s.measured * s.batch * seq_len * trainer.parallel_dims.world_size
    params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "losses": losses, "params": params}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HiddenDistributions:
    """Stands in for the path finder on ``sys.meta_path`` (:meth:`install`) so that every top-level
    module of an installed distribution outside ``allowed`` is not found, for an import and for a
    probe (``importlib.util.find_spec`` gives None) alike, as on the GPU machine where only its image
    and the carried wheels exist. Modules of no distribution (the standard library, this checkout)
    and modules imported already are found as usual."""

    def __init__(self, allowed: set[str]) -> None:
        from importlib.metadata import packages_distributions

        def norm(name: str) -> str:
            return name.lower().replace("_", "-").replace(".", "-")

        self.norm = norm
        self.keep = keep = {norm(n) for n in allowed}
        self.hidden = {top for top, dists in packages_distributions().items()
                       if top not in sys.stdlib_module_names and not any(norm(d) in keep for d in dists)}
        self.refused: set[str] = set()
        self._finder: Any = None

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        top = name.partition(".")[0]
        if top in self.hidden and top not in sys.modules:
            self.refused.add(top)
            return None
        return self._finder.find_spec(name, path, target)

    def find_distributions(self, *args: Any, **kwargs: Any) -> Any:
        """importlib.metadata's view: the allowed distributions only (a version probe of another fails)."""
        return (d for d in self._finder.find_distributions(*args, **kwargs)
                if self.norm(d.metadata["Name"] or "") in self.keep)

    def install(self) -> None:
        from importlib.machinery import PathFinder

        index = sys.meta_path.index(PathFinder)
        self._finder, sys.meta_path[index] = PathFinder, self  # type: ignore[call-overload]

    def uninstall(self) -> None:
        sys.meta_path[sys.meta_path.index(self)] = self._finder  # type: ignore[arg-type]


def check(settings: TitanSettings, allowed: set[str] | None) -> dict[str, Any]:
    """What a machine without a GPU can show of the row: torchtitan's training entry imports (with
    only ``allowed`` distributions visible, when given), its parser accepts :func:`job_args`, and its
    Llama 3 of the row's flavour (built on the meta device) has the parameters hpctrain's has.
    ``triton``, which CPU builds of torch lack, is a stand-in for the one module (an MoE kernel file
    the Llama never runs) that imports it at import time."""
    from unittest import mock

    import torch._inductor.compile_fx  # noqa: F401 - torch's own triton checks run before the stand-in exists
    import torch.distributed.pipelining  # noqa: F401

    finder = HiddenDistributions(allowed) if allowed is not None else None
    stubbed = importlib.util.find_spec("triton") is None
    if stubbed:
        sys.modules["triton"] = stub = mock.MagicMock()
        sys.modules["triton.language"] = stub.language
    if finder is not None:
        finder.install()
    try:
        import torchtitan.train  # noqa: F401 - the entry: Trainer and everything it imports
    finally:
        if finder is not None:
            finder.uninstall()
        if stubbed:
            del sys.modules["triton"], sys.modules["triton.language"]

    from torchtitan.protocols.train_spec import get_train_spec

    config = job_config(settings)
    spec = get_train_spec(SPEC_NAME)
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args[FLAVOR])
    return {"torchtitan": _version(), "params": sum(p.numel() for p in model.parameters()),
            "steps": config.training.steps, "compile": config.compile.enable,
            "activation_checkpoint": config.activation_checkpoint.mode,
            "hidden_refused": sorted(finder.refused) if finder else None}


def main(argv: list[str]) -> int:
    if argv[0] == "--check":  # --check SETTINGS RESULT [ALLOWED.txt]
        allowed = None
        if len(argv) > 3:
            lines = Path(argv[3]).read_text().splitlines()
            allowed = {line.split("==")[0].strip() for line in lines if line.strip() and not line.startswith("#")}
        Path(argv[2]).write_text(json.dumps(check(TitanSettings(**json.loads(Path(argv[1]).read_text())), allowed)))
        return 0
    settings = TitanSettings(**json.loads(Path(argv[0]).read_text()))
    from gpu_data import read_spec
    from torchtitan.train import Trainer

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(job_config(settings))
    try:
        result = measure(trainer, settings, read_spec(settings.spec).seq_len)
    finally:
        trainer.close()
    if torch.cuda.is_available():
        result["peak_alloc_gb"] = torch.cuda.max_memory_allocated() / 1e9
        result["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    result["torchtitan"] = _version()
    Path(argv[1]).write_text(json.dumps(result) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _version() -> str:
    from importlib.metadata import version

    return version("torchtitan")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_data, beside this file
    sys.exit(main(sys.argv[1:]))


__all__ = ["HiddenDistributions", "TitanSettings", "asdict", "check", "ffn_args", "job_args", "job_config", "main",
           "measure", "model_args"]
