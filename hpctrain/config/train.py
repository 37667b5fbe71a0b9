"""The reference trainer's config sections: ``train`` (the loop) and ``run`` (its directory).

They live beside :mod:`hpctrain.train` rather than in it, because the trainer imports the
composed :class:`hpctrain.config.Config` and the composition imports these sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.config.optim import is_import_path
from hpctrain.core.section import ConfigError, opt, positive

# The names train.task accepts besides auto: the built-in tasks (hpctrain/tasks/registry.py maps
# each to its class; a test keeps the two alike) and those a user's code registers
# (hpctrain.tasks.registry.register_task adds the name here). Names only: checking a config
# imports no task, so no torch.
TASK_NAMES: list[str] = ["classification", "causal_lm", "regression", "multilabel", "custom"]


def add_task_name(name: str) -> None:
    """Let ``train.task=name`` pass the config check (the task's class is the registry's)."""
    if name not in TASK_NAMES:
        TASK_NAMES.append(name)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    epochs: int = opt(1, "Passes over the training data.")
    max_steps: int | None = opt(None, "Stop after this many optimizer steps (overrides epochs when reached first).")
    grad_accum: int = opt(1, "Micro-steps per optimizer step; inner micro-steps skip the gradient all-reduce. Every optimizer step takes exactly grad_accum micro-batches; after a resume the count starts where the loader resumes, and an epoch's last < grad_accum micro-batches are dropped. Derived when data.global_batch_size is set.")
    clip_grad_norm: float | None = opt(None, "Clip the global gradient norm to this value (None = off).")
    nonfinite: Literal["stop", "skip"] = opt("stop", "A step whose loss or gradients are not finite (nan, inf; checked every step, all ranks alike) never updates the weights. stop: the run ends there (exit 1, naming the step and the value); skip: the step is skipped (weights, buffers such as BatchNorm statistics, optimizer state unchanged) and counted, and the run ends after train.nonfinite_patience such steps in a row. summary.json: nonfinite_steps, nonfinite_skipped_steps, first_nonfinite_step, scaler_skipped_steps (fp16 overflows the grad scaler skipped itself). Cost: none of its own with train.clip_grad_norm (it judges the clip's total norm, non-finite exactly when a gradient is), else one fused L2-norm pass over the gradients; an 8-byte all-reduce with several ranks; skip also makes the CPU wait for each backward before the update; stop on a GPU reads the values one step late instead (no wait: the non-finite step's update is then applied, and a checkpoint of nan weights refused).")
    nonfinite_patience: int = opt(3, "train.nonfinite=skip: end the run (exit 1) after this many non-finite steps in a row. precision=fp16: a gradient overflow at a loss scale above 1 is the grad scaler's (it skips the step and halves the scale), at a scale of 1 or less a non-finite step (the gradients overflow unscaled).")
    log_every: int = opt(20, "Write a metrics.jsonl row every N optimizer steps.")
    eval_every_steps: int | None = opt(None, "Validate every N optimizer steps (besides each epoch end).")
    eval_each_epoch: bool = opt(True, "Validate at the end of every epoch.")
    task: str = opt("auto", "What the loop trains for (loss, metrics, inputs/targets): classification (class ids), causal_lm (token windows), regression (float targets of any shape; MSE; val mse/rmse/mae), multilabel (0/1 vectors; BCE-with-logits; val f1/accuracy per label), custom (train.loss on the targets as given; val_loss is that loss); auto = the data's (causal_lm for text shards, else classification; custom when train.loss is set and the targets are not class ids); a named task must fit the data.")
    loss: str | None = opt(None, "The training loss by import path, package.module:NAME: a callable (output, target) -> scalar tensor (torch.nn.functional:nll_loss, or your own) used instead of the task's; the targets then reach it unchecked. Validation keeps the task's metrics (val_loss stays the task's; under train.task=custom it is this loss). None (or task): the task's loss.", none_text=("none", "task"))
    metrics: str | None = opt(None, "Extra validation metrics by import path, package.module:NAME (several: comma-separated): a hpctrain.tasks.metrics.Metric subclass (also importable as hpctrain.Metric) (or a no-argument factory of one) keeping sums and counts, merged over ranks, divided once in compute(); each key it returns is logged as val_<key>.")
    best_metric: str = opt("auto", "Validation metric whose best value is tracked (its checkpoint marked): val_accuracy, val_loss, val_perplexity, val_top5_accuracy, ...; auto = val_loss for causal_lm, val_accuracy for classification.")
    best_mode: Literal["auto", "max", "min"] = opt("auto", "Is higher better? auto: min for *loss / *perplexity, else max.")
    compile: bool = opt(False, "Wrap the model in torch.compile (opt-in: compilation takes time).")
    deterministic: bool = opt(False, "Deterministic kernels (torch.use_deterministic_algorithms); slower.")
    progress: bool = opt(True, "Show a progress bar over steps on rank 0 (only when stderr is a terminal; false: never).")
    threads: int | None = opt(None, "torch intra-op threads per rank; default: cores / local ranks.")

    def __post_init__(self) -> None:
        tasks = ("auto", *TASK_NAMES)
        if self.task not in tasks:
            raise ConfigError(f"train.task={self.task!r} is not allowed; choose one of: {', '.join(tasks)}")
        if self.loss is not None and not is_import_path(self.loss):
            raise ConfigError(f"train.loss={self.loss!r} is not an import path package.module:NAME; hint: "
                              "train.loss=torch.nn.functional:nll_loss")
        for path in (self.metrics or "").split(","):
            if self.metrics is not None and not is_import_path(path.strip()):
                raise ConfigError(f"train.metrics={self.metrics!r}: {path.strip()!r} is not an import path "
                                  "package.module:NAME; hint: train.metrics=mypkg.metrics:MAPE")
        positive("train", self, "epochs", "max_steps", "grad_accum", "clip_grad_norm", "nonfinite_patience",
                 "log_every", "eval_every_steps", "threads")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    dir: str = opt("runs/{data.name}-{model.name}", "Run directory (may name config keys in braces, ~ and $VARS): config.yaml, metrics.jsonl, model.pt, summary.json. A new or empty folder, or one of hpctrain's own runs (marker .hpctrain-run.json); a folder with other files, /, the home folder and system folders are refused (exit 2).")
    overwrite: bool = opt(False, "Replace the run in run.dir (a finished one, or checkpoints with resume=never): removes only the outputs hpctrain wrote there (listed in .hpctrain-run.json) and its own checkpoints, never other files.")
