"""The reference trainer's config sections: ``train`` (the loop) and ``run`` (its directory).

They live beside :mod:`hpctrain.train` rather than in it, because the trainer imports the
composed :class:`hpctrain.config.Config` and the composition imports these sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.optim_config import is_import_path
from hpctrain.section import ConfigError, opt, positive
from hpctrain.tasks.registry import task_names


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    epochs: int = opt(1, "Passes over the training data.")
    max_steps: int | None = opt(None, "Stop after this many optimizer steps (overrides epochs when reached first).")
    grad_accum: int = opt(1, "Micro-steps per optimizer step; inner micro-steps skip the gradient all-reduce. Every optimizer step takes exactly grad_accum micro-batches; after a resume the count starts where the loader resumes, and an epoch's last < grad_accum micro-batches are dropped. Derived when data.global_batch_size is set.")
    clip_grad_norm: float | None = opt(None, "Clip the global gradient norm to this value (None = off).")
    log_every: int = opt(20, "Write a metrics.jsonl row every N optimizer steps.")
    eval_every_steps: int | None = opt(None, "Validate every N optimizer steps (besides each epoch end).")
    eval_each_epoch: bool = opt(True, "Validate at the end of every epoch.")
    task: str = opt("auto", "What the loop trains for (loss, metrics, inputs/targets): auto = the data's (causal_lm for text shards, else classification); a named task must fit the data.")
    loss: str | None = opt(None, "The training loss by import path, package.module:NAME: a callable (output, target) -> scalar tensor (torch.nn.functional:nll_loss, or your own) used instead of the task's; validation keeps the task's metrics (val_loss stays the task's cross-entropy). None (or task): the task's loss.", none_text=("none", "task"))
    best_metric: str = opt("auto", "Validation metric whose best value is tracked (its checkpoint marked): val_accuracy, val_loss, val_perplexity, val_top5_accuracy, ...; auto = val_loss for causal_lm, val_accuracy for classification.")
    best_mode: Literal["auto", "max", "min"] = opt("auto", "Is higher better? auto: min for *loss / *perplexity, else max.")
    compile: bool = opt(False, "Wrap the model in torch.compile (opt-in: compilation takes time).")
    deterministic: bool = opt(False, "Deterministic kernels (torch.use_deterministic_algorithms); slower.")
    progress: bool = opt(True, "Show a progress bar over steps on rank 0 (only when stderr is a terminal; false: never).")
    threads: int | None = opt(None, "torch intra-op threads per rank; default: cores / local ranks.")

    def __post_init__(self) -> None:
        tasks = ("auto", *task_names())  # the registry's (hpctrain/tasks/registry.py)
        if self.task not in tasks:
            raise ConfigError(f"train.task={self.task!r} is not allowed; choose one of: {', '.join(tasks)}")
        if self.loss is not None and not is_import_path(self.loss):
            raise ConfigError(f"train.loss={self.loss!r} is not an import path package.module:NAME; hint: "
                              "train.loss=torch.nn.functional:nll_loss")
        positive("train", self, "epochs", "max_steps", "grad_accum", "clip_grad_norm", "log_every",
                 "eval_every_steps", "threads")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    dir: str = opt("runs/{data.name}-{model.name}", "Run directory (may name config keys in braces): config.yaml, metrics.jsonl, model.pt, summary.json.")
    overwrite: bool = opt(False, "Allow writing into a run directory that already holds a finished run.")
