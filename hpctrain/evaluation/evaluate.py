"""Exact distributed evaluation.

Every validation sample is evaluated exactly once across ranks (contiguous slices, no
padding repeats). Ranks agree up front on the number of batches; a rank that runs out
forwards a masked zero-weight batch, so a model whose forward holds collectives (FSDP)
never hangs. Metric states are all-gathered and merged in rank order, so every rank gets
the same, single-process-exact numbers.

Under tensor (or pipeline) parallelism the ranks of one model replica read the same shard
(``hpctrain.planning.layout.RunLayout.data_env``) and compute the same outputs: pass ``group``, the replicas'
data-parallel process group (:func:`hpctrain.parallel.mesh.dp_group`), so each sample is
merged once, within each dp group, instead of once per tp rank.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.core.atomic import atomic_open
from hpctrain.core.env import ClusterEnv, collective_device, detect
from hpctrain.core.modules import eval_view
from hpctrain.data import EvalBatches
from hpctrain.data.batch import Batch, map_inputs
from hpctrain.data.in_memory import EvalLoader
from hpctrain.precision import Precision
from hpctrain.tasks import Classification, Task, build_task
from hpctrain.tasks.metrics import Accuracy, EvalOutput, MeanLoss, Metric


@dataclass
class EvalResult:
    metrics: dict[str, Any]
    seconds: float
    predictions: list[dict[str, Any]] = field(default_factory=list)
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)  # a mixture's (data.mix): label -> metrics

    @property
    def samples_per_s(self) -> float:
        count = self.metrics.get("count", 0)
        return count / self.seconds if self.seconds > 0 else 0.0


@torch.no_grad()
def evaluate(model: nn.Module, loader: EvalBatches, metrics: Sequence[Metric], env: ClusterEnv,
             device: torch.device, precision: Precision | None = None,
             collect_predictions: bool = False, task: Task | None = None,
             group: dist.ProcessGroup | None = None) -> EvalResult:
    """Run ``metrics`` over ``loader`` on every rank and return the global values on every rank.
    ``task`` (default: classification) runs the forward and turns it into per-target losses.
    ``group``: the data-parallel replicas this rank merges with (None: every rank holds its own
    shard); every rank of the world calls this, each with its own dp group. A mixture's loader
    (``loader.sources``): each source's metrics too (:func:`evaluate_sources`)."""
    if getattr(loader, "sources", None):
        return evaluate_sources(lambda part, mine: evaluate(model, part, mine, env, device, precision,
                                                            collect_predictions, task, group),
                                loader.sources, metrics)  # type: ignore[attr-defined]
    task = task or Classification()
    start = time.perf_counter()
    # the wrapper's own view (registered by the strategy that made it): DDP's syncs its buffers to
    # rank 0's first, so every rank validates the model rank 0 saves, and runs no forward syncs
    net = eval_view(model)
    was_training = net.training
    net.eval()
    for metric in metrics:
        metric.reset()
    predictions: list[dict[str, Any]] = []
    try:
        for batch in lockstep(loader, env, device):
            out = task.eval_step(net, batch.to(device), precision)
            if out is None:
                continue
            for metric in metrics:
                metric.update(out)
            if collect_predictions:
                predictions += _prediction_rows(out, task.name)
    finally:
        net.train(was_training)
    merged = _merge(metrics, env, group)
    gathered = gather_predictions(predictions, env, group) if collect_predictions else []
    return EvalResult(merged, time.perf_counter() - start, gathered)


def evaluate_sources(run: Callable[[EvalBatches, list[Metric]], EvalResult], sources: Sequence[tuple[str, EvalBatches]],
                     metrics: Sequence[Metric]) -> EvalResult:
    """``run`` (an evaluation loop) over each source's loader with copies of ``metrics``; the
    total is their merged states (sums and counts: the numbers of one pass over all sources).
    Metrics: the total's keys, plus ``KEY/LABEL`` per source (``loss/web``); ``sources``: label -> metrics."""
    per_source: dict[str, dict[str, Any]] = {}
    states: list[list[dict[str, torch.Tensor]]] = []
    seconds, predictions = 0.0, []
    for label, loader in sources:
        mine = copy.deepcopy(list(metrics))
        res = run(loader, mine)
        per_source[label] = res.metrics
        states.append([m.states for m in mine])
        seconds += res.seconds
        predictions += [{**row, "source": label} for row in res.predictions]
    total: dict[str, Any] = {}
    for index, metric in enumerate(metrics):
        metric.reset()
        metric.merge([source_states[index] for source_states in states])
        total.update(metric.compute())
    flat = {f"{key}/{label}": value for label, values in per_source.items() for key, value in values.items()
            if isinstance(value, (int, float))}
    return EvalResult({**total, **flat}, seconds, predictions, per_source)


def sum_over_ranks(*values: float) -> tuple[Any, ...]:
    """Each value summed over every rank (every rank calls it and gets the sums): per-rank test
    totals made global, in float64 (counts stay exact to 2**53); integers come back as ints."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    totals = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(totals)
    return tuple(int(t) if isinstance(v, int) else float(t) for v, t in zip(values, totals.tolist(), strict=True))


def evaluate_dataset(model: nn.Module, dataset: Any, batch_size: int = 256, *,
                     metrics: Sequence[Metric] | None = None, task: Task | str | None = None) -> EvalResult:
    """The exact loss and accuracy of ``model`` over a map-style ``dataset`` of ``(input, target)``,
    every sample once across the ranks (contiguous slices: no DistributedSampler padding), the
    same result on every rank: what a loop of your own calls in place of a rank's own test loop.
    Every rank calls it. The loss is cross-entropy, which on log-probabilities (a final
    ``log_softmax``) equals ``nll_loss``. ``task`` (a name or a Task: ``regression``,
    ``multilabel``, ...) reads the targets and gives the metrics its own way."""
    env = detect()
    device = next(model.parameters()).device
    chosen = build_task(task) if isinstance(task, str) else task
    if chosen is None or chosen.name == "classification":
        return evaluate(model, EvalLoader(dataset, env, batch_size), metrics or [MeanLoss(), Accuracy()], env, device,
                        task=chosen)
    loader = EvalLoader(dataset, env, batch_size, targets=chosen.targets)
    return evaluate(model, loader, metrics or chosen.metrics(_label_count(loader)), env, device, task=chosen)


def _label_count(loader: Any) -> int:
    """Labels per sample of a loader's first batch (a multilabel task's metrics need it)."""
    targets = loader.template().targets
    return int(targets[0].numel()) if targets.dim() > 1 else 1


def lockstep(loader: EvalBatches, env: ClusterEnv, device: torch.device) -> Iterator[Batch]:
    """The loader's batches, then masked padding batches up to the largest count of any rank
    (of the whole world: the tp ranks and stages of a replica step together with the others)."""
    local = len(loader)
    steps = _all_reduce_max(local, env, device)
    template: Batch | None = None
    for batch in loader:
        template = batch
        yield batch
    for _ in range(steps - local):
        yield _padding(template if template is not None else loader.template())


def _padding(like: Batch) -> Batch:
    """One all-zero sample with mask 0: it runs through forward but counts nowhere."""
    return Batch(map_inputs(like.inputs, lambda t: torch.zeros_like(t[:1])), torch.zeros_like(like.targets[:1]), [],
                 torch.zeros(1, dtype=torch.bool))


def _all_reduce_max(value: int, env: ClusterEnv, device: torch.device) -> int:
    if not env.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def _prediction_rows(out: EvalOutput, task: str = "classification") -> list[dict[str, Any]]:
    """One row per sample; for a token task the prediction and target are token lists and
    the loss is the sample's mean over its tokens; regression predicts its values, multilabel
    its 0/1 vector (a logit > 0)."""
    keys = out.keys.tolist() if isinstance(out.keys, torch.Tensor) else list(out.keys)
    by_task = {"regression": lambda: out.logits, "custom": lambda: out.logits,
               "multilabel": lambda: (out.logits > 0).long()}
    preds = by_task.get(task, lambda: out.logits.argmax(-1))().tolist()
    losses = out.losses.flatten(1).mean(1) if out.losses.dim() > 1 else out.losses
    return [{"key": k, "prediction": p, "target": t, "loss": loss}
            for k, p, t, loss in zip(keys, preds, out.targets.tolist(), losses.tolist())]


def _group_size(env: ClusterEnv, group: dist.ProcessGroup | None) -> int:
    """How many shards are merged: the replicas in ``group``, or every rank."""
    if not env.distributed:
        return 1
    return env.world_size if group is None else dist.get_world_size(group)


def _merge(metrics: Sequence[Metric], env: ClusterEnv, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """All-gather each metric state within ``group`` and fold it in group-rank order (deterministic sums)."""
    size = _group_size(env, group)
    result: dict[str, Any] = {}
    for metric in metrics:
        if size > 1:
            metric.merge(_all_gather_states(metric.states, size, group))
        result.update(metric.compute())
    return result


def _all_gather_states(states: dict[str, torch.Tensor], size: int,
                       group: dist.ProcessGroup | None) -> list[dict[str, torch.Tensor]]:
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    backend_device = collective_device()
    for name, tensor in states.items():
        local = tensor.to(backend_device)
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        for rank, part in enumerate(parts):
            per_rank[rank][name] = part.cpu()
    return per_rank


def gather_predictions(rows: list[dict[str, Any]], env: ClusterEnv,
                       group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Per-sample rows of every replica, on rank 0 (empty elsewhere), in rank order. With a dp
    ``group``, only rank 0's group gathers (the other groups hold the same rows again)."""
    if _group_size(env, group) == 1:
        return rows if env.is_main else []
    if group is not None and 0 not in dist.get_process_group_ranks(group):
        return []
    size = _group_size(env, group)
    gathered: list[Any] = [None] * size if env.is_main else []
    dist.gather_object(rows, gathered if env.is_main else None, dst=0, group=group)
    return [row for part in gathered for row in part] if env.is_main else []


def write_predictions(rows: list[dict[str, Any]], path: Path) -> None:
    """One JSON row per sample; the file appears whole or not at all."""
    with atomic_open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
