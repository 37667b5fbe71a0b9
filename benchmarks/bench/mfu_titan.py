# torchtitan (an optional extra) ships no type hints:
"""``python -m bench.mfu_titan PREFIX SETTINGS.json``: one torchtitan run of ``hpctrain bench mfu``.

torchtitan's own pieces, as its Llama 3 recipes put them together: its ``Trainer`` (built from a
``Trainer.Config``: distributed init, meta-device build, ``parallelize_llama`` = activation
checkpointing off -> per-block ``torch.compile`` -> FSDP2 with bf16 parameters and fp32
reduction, also on one GPU, its ``init_weights``, ``default_adamw``, the chunked cross-entropy of
its recipes, gradient clipping, the LR schedule), its ``Llama3Model`` built from a config of the
bench's shape (fused QKV as its presets have it; attention through SDPA's causal kernel, the one
hpctrain's llama uses, instead of its default FlexAttention with document masks, which these
one-document windows do not need). Two pieces are the bench's, through torchtitan's documented
extension points: the dataloader (a ``BaseDataLoader`` over :mod:`bench.mfu_data`'s
windows, the same ones hpctrain reads) and a tokenizer that is never used (there is no text).

The bench drives ``Trainer.train_step`` itself, so that the measured steps are timed from a
device sync after the warm-up to one after the last step, as hpctrain's are. The losses are
the ones torchtitan's metrics processor logs (every ``warmup`` steps, as hpctrain logs). Run
under torchrun (one process per GPU): ``Trainer`` initialises the process group from its
environment. torchtitan's device helpers assume an accelerator (``torch.cuda`` when none is
present), so a CPU-only machine cannot run it: :func:`cpu_reason` says so, and the bench
records the row as skipped with that reason.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.mfu_data import TokenWindows, WindowSpec, read_spec


def cpu_reason() -> str | None:
    """Why torchtitan cannot run here, or None where it can."""
    if not torch.cuda.is_available():
        return ("torchtitan's Trainer needs an accelerator: torchtitan.tools.utils falls back to torch.cuda when "
                "none is present, and Trainer.__init__ calls torch.cuda.set_device")
    return None


@dataclass(frozen=True)
class TitanSettings:
    """What the bench hands the child: the model's shape, the batch and the steps."""

    spec: str           # the windows' JSON spec (mfu_data.write_spec)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    tie_weights: bool
    batch: int
    warmup: int
    measured: int
    lr: float
    compile: bool


def model_config(s: TitanSettings, vocab: int, seq_len: int) -> Any:
    """A ``Llama3Model.Config`` of the bench's shape, from torchtitan's own config builders."""
    from functools import partial

    from torch import nn
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.param_init import depth_scaled_std, skip_param_init
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02)}
    norm = {"weight": nn.init.ones_}
    head_dim = s.hidden // s.heads
    rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=10_000.0)  # llama's base, no scaling

    def block(layer_id: int) -> Any:
        deep = {"weight": partial(nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer_id))}
        return Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=s.hidden, param_init=norm),
            ffn_norm=RMSNorm.Config(normalized_shape=s.hidden, param_init=norm),
            attention=make_gqa_config(dim=s.hidden, n_heads=s.heads, n_kv_heads=s.kv_heads, wqkv_param_init=linear,
                                      wo_param_init=deep, inner_attention=ScaledDotProductAttention.Config(),
                                      fuse_qkv=True, rope=rope),
            feed_forward=make_ffn_config(dim=s.hidden, hidden_dim=s.ffn_hidden, w1_param_init=linear,
                                         w2w3_param_init=deep))

    # tied: the output layer's init draws the shared weight (torchtitan's 1B preset does the same)
    emb_init = {"weight": skip_param_init} if s.tie_weights else {"weight": partial(nn.init.normal_, std=1.0)}
    return Llama3Model.Config(
        dim=s.hidden, vocab_size=vocab, enable_weight_tying=s.tie_weights,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=s.hidden, param_init=emb_init),
        norm=RMSNorm.Config(normalized_shape=s.hidden, param_init=norm),
        lm_head=Linear.Config(in_features=s.hidden, out_features=vocab, param_init=linear),
        layers=[block(i) for i in range(s.layers)])


def trainer_config(s: TitanSettings, dump: Path) -> Any:
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    spec = read_spec(s.spec)
    model = model_config(s, spec.vocab, spec.seq_len)
    model_spec = ModelSpec(name="llama3", flavor="hpctrain-bench", model=model, parallelize_fn=parallelize_llama,
                           pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None)
    return Trainer.Config(
        model_spec=model_spec, dump_folder=str(dump),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=spec.vocab)),
        optimizer=default_adamw(lr=s.lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0),  # hpctrain's runs use a constant lr too
        training=TrainingConfig(local_batch_size=s.batch, seq_len=spec.seq_len, steps=s.warmup + s.measured,
                                max_norm=1.0, disable_cuda_graphs=True),
        dataloader=_loader_classes()[0].Config(dataset=s.spec),
        tokenizer=_loader_classes()[1].Config(),
        metrics=MetricsProcessor.Config(log_freq=s.warmup),
        compile=CompileConfig(enable=s.compile, components=["model", "loss"]),
        activation_checkpoint=None,  # hpctrain's runs checkpoint nothing either
    )


_CLASSES: tuple[Any, Any] | None = None


def _loader_classes() -> tuple[Any, Any]:
    """The dataloader and tokenizer classes, defined once torchtitan is imported (an optional extra)."""
    global _CLASSES  # noqa: PLW0603 - built once per process: torchtitan's Configurable wires each class at definition
    if _CLASSES is None:
        _CLASSES = _define_classes()
    return _CLASSES


def _define_classes() -> tuple[Any, Any]:
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class WindowLoader(BaseDataLoader):  # type: ignore[misc]
        """This rank's windows ``[step*B*W + r*B, ...)`` in order: hpctrain's loader reads them so too."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):  # type: ignore[misc]
            pass

        def __init__(self, config: Any, *, dp_world_size: int, dp_rank: int, local_batch_size: int,
                     **_: Any) -> None:
            self.windows = TokenWindows(read_spec(config.dataset))
            self.rank, self.world, self.size = dp_rank, dp_world_size, local_batch_size
            self.step = 0

        def __iter__(self) -> Any:
            while True:
                first = (self.step * self.world + self.rank) * self.size
                self.step += 1
                window = self.windows.batch(first, self.size)
                yield {"input": window[:, :-1]}, window[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.step = int(state["step"])

    class NoTokenizer(BaseTokenizer):  # type: ignore[misc]
        """The windows are token ids already; torchtitan's Trainer builds a tokenizer regardless."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):  # type: ignore[misc]
            pass

        def __init__(self, config: Any, **_: Any) -> None:
            super().__init__()

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("hpctrain bench mfu feeds token ids")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("hpctrain bench mfu feeds token ids")

        def get_vocab_size(self) -> int:
            return 0

    return WindowLoader, NoTokenizer


def measure(trainer: Any, s: TitanSettings) -> dict[str, Any]:
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
    spec = read_spec(s.spec)
    tokens = s.measured * s.batch * spec.seq_len * trainer.parallel_dims.world_size
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "losses": losses}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str]) -> int:
    from bench.child import report

    prefix, settings = Path(argv[0]), TitanSettings(**json.loads(Path(argv[1]).read_text()))
    reason = cpu_reason()
    if reason is not None:
        raise SystemExit(f"hpctrain bench mfu: torchtitan cannot run here: {reason}")
    trainer = trainer_config(settings, prefix.parent / f"{prefix.name}.dump").build()
    try:
        result = measure(trainer, settings)
    finally:
        trainer.close()
    report(prefix, int(os.environ.get("RANK", "0")), result)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    from bench.child import finish

    finish(main(sys.argv[1:]))


__all__ = ["TitanSettings", "WindowSpec", "cpu_reason", "main", "measure", "model_config", "trainer_config"]
