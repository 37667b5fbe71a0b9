"""Issue 26, point 4: a model family owns its parallel plan. Hugging Face Llama, Mistral and Qwen2
(tiny, from their configs: 2 layers, width 32, 4 heads / 2 key-value heads, untied, fp32) get the
``hf-llama`` family's tensor-parallel plan and pipeline split with no line of them in
``hpctrain/parallel/``; through the trainer on gloo ranks, Shakespeare bytes, 4 steps of 8 samples:

* tp2 (each of the three), pp2 (Llama, 1F1B over 2 micro-batches), dp2 x tp2 (Llama, FSDP over
  dp) and cp2 (Llama, context parallel through the family's plan) give one process's per-step
  losses and val_loss within 1e-5;
* a tp2 checkpoint resumes in one process, and a pp2 checkpoint at tp2, with the
  uninterrupted run's next losses within 1e-5 (DCP reshards under the whole model's names);
* ``hpctrain ckpt export`` of the tp2 and pp2 checkpoints gives a safetensors file that
  ``transformers``' ``from_pretrained`` loads (beside the model's config.json), with the logits of
  the run's own model.pt loaded strictly into the model: the same names, the same weights.

One launch per world size (2, then 1, then 4) runs all of that size's cases, in order."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.core.section import ConfigError
from hpctrain.models import build_model
from hpctrain.models.family import HF_LLAMA_FAMILY, ModelFamily, family_for, family_of, register_family
from hpctrain.models.user import ModelError
from hpctrain.planning.layout import make_layout
from tests.data.test_text import needs_sdist
from tests.dist_utils import ROOT, train_cases
from tests.gpt_runs import assert_close, read_summary, step_losses

# a mark, not a module-level importorskip: transformers is imported only where these tests run
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers"),
              pytest.mark.slow]

HF = "tests.models.hf_family_models"
MODELS = ("llama", "mistral", "qwen2")
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
STEPS, TOL = 4, 1e-5
STEP2 = Path("checkpoints") / "step-000000002"
PP2 = ["parallel.pp=2", "parallel.microbatches=2", "parallel.pp_schedule=1f1b"]
DP2_TP2 = ["parallel.tp=2", "parallel.strategy=fsdp"]
KEEP = ("steps", "val_loss", "val_count", "params_sha256")
# a family registered from users' code by import path (model.family=...): the hf-llama plans, matched by nothing
MINE = replace(HF_LLAMA_FAMILY, name="mine", matches=None)


def _keys(model: str, shards: Path, *extra: str) -> list[str]:
    return [f"model.name={HF}:{model}", "data.name=shards", f"data.path={shards}", "model.seq_len=32",
            "data.batch_size=8", "data.global_batch_size=8", "data.max_val_samples=16", "data.eval_batch_size=8",
            "data.drop_last=true", f"train.max_steps={STEPS}", "train.log_every=1", "train.progress=false",
            "train.threads=1", "optim.name=adamw", "optim.lr=0.01", "optim.schedule=constant",
            "checkpoint.every_seconds=None", "checkpoint.every_steps=2", "telemetry.straggler_every_steps=0", *extra]


def _ok(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    failed = {name: got for name, got in ranks[0].items() if not isinstance(got, dict)}
    assert not failed, failed
    return ranks[0]


@pytest.fixture(scope="module")
def runs(shakespeare_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root, shards = tmp_path_factory.mktemp("hf_family"), shakespeare_shards
    _ok(train_cases(2, [*((f"{m}-tp2", _keys(m, shards, "parallel.tp=2")) for m in MODELS),
                        ("llama-pp2", _keys("llama", shards, *PP2)),
                        ("llama-cp2", _keys("llama", shards, "parallel.cp=2")),  # context parallel (issue 28)
                        ("llama-pp2-at-tp2", _keys("llama", shards, "parallel.tp=2",
                                                   f"resume={root / 'llama-pp2' / STEP2}"))], root, keep=KEEP))
    _ok(train_cases(1, [*((m, _keys(m, shards)) for m in MODELS),
                        ("llama-tp2-at1", _keys("llama", shards, f"resume={root / 'llama-tp2' / STEP2}"))],
                    root, keep=KEEP))
    _ok(train_cases(4, [("llama-dp2xtp2", _keys("llama", shards, *DP2_TP2))], root, keep=KEEP))
    return root


@needs_sdist
@pytest.mark.parametrize("case", ["llama-tp2", "mistral-tp2", "qwen2-tp2", "llama-pp2", "llama-dp2xtp2", "llama-cp2"])
def test_tensor_and_pipeline_parallel_match_one_process(runs: Path, case: str) -> None:
    one = runs / case.split("-")[0]
    want = step_losses(one)
    assert len(want) == STEPS and want[STEPS] < want[1]  # it learns
    assert_close(step_losses(runs / case), want, TOL)
    mine, ref = read_summary(runs / case), read_summary(one)
    assert mine["val_count"] == ref["val_count"] == 16
    assert abs(mine["val_loss"] - ref["val_loss"]) < TOL


@needs_sdist
@pytest.mark.parametrize(("saved", "resumed"), [("llama-tp2", "llama-tp2-at1"),
                                                ("llama-pp2", "llama-pp2-at-tp2")])
def test_a_checkpoint_resumes_at_another_layout(runs: Path, saved: str, resumed: str) -> None:
    want = {step: loss for step, loss in step_losses(runs / saved).items() if step > 2}
    assert_close(step_losses(runs / resumed), want, TOL)
    assert read_summary(runs / resumed)["steps"] == STEPS


def _hf_model(model: str) -> torch.nn.Module:
    from tests.models import hf_family_models

    return getattr(hf_family_models, model)(256, 32)


@needs_sdist
@pytest.mark.parametrize("case", ["llama-tp2", "qwen2-tp2", "llama-pp2"])
def test_exported_weights_load_with_from_pretrained(runs: Path, case: str, tmp_path: Path) -> None:
    from hpctrain.cli import main

    out = tmp_path / "hf"
    out.mkdir()
    assert main(["ckpt", "export", str(runs / case / "checkpoints" / "step-000000004"),
                 str(out / "model.safetensors")]) == 0
    model = case.split("-")[0]
    reference = _hf_model(model)
    reference.config.save_pretrained(out)
    # the run's own consolidated model.pt: the whole model's names (strict), the trained weights
    reference.load_state_dict(torch.load(runs / case / "model.pt", weights_only=True), strict=True)
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(loaded).__name__ == CLASSES[model]
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, reference.eval()(tokens).logits, rtol=0, atol=0)


# ---------------------------------------------------------------- the family itself (no ranks)


@pytest.mark.parametrize("model", MODELS)
def test_hugging_face_llama_family_models_get_its_plans(model: str) -> None:
    hf = _hf_model(model)
    family = family_of(hf)
    assert family.name == "hf-llama"
    plan, split = family.tensor_plan_of(hf), family.pipeline_split_of(hf)
    assert plan is not None and split is not None
    layer = hf.get_submodule(plan.blocks)[0]
    styles = {name: plan.style(name, module) for name, module in layer.named_modules() if name}
    assert {name: style for name, style in styles.items() if style} == {
        "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise"}
    assert (split.blocks, split.first, split.last) == ("model.layers", ("model.embed_tokens",),
                                                       ("model.norm", "lm_head"))


def test_a_model_family_registers_from_users_code_by_import_path() -> None:
    name = f"{HF}:llama"
    cfg = load_config(None, [f"model.name={name}", f"model.family={__name__}:MINE", "model.vocab=256"])
    assert family_for(cfg.model) is not None and family_for(cfg.model).name == "mine"  # type: ignore[union-attr]
    built = build_model(name, 256, config=cfg.model, task="causal_lm")
    assert family_of(built).name == "mine"  # marked: its own family, not the one it would match
    with pytest.raises(ModelError, match="is a int, not a hpctrain.models.family.ModelFamily"):
        register_family("broken", f"{__name__}:STEPS")
    again = register_family("again", MINE)
    assert family_of("again") is again and again.tensor_plan is MINE.tensor_plan


def test_gpt2_has_no_plan_and_sequence_parallel_needs_norms_in_the_plan() -> None:
    """GPT-2 (Conv1D projections) falls to the default family and stays refused; the hf-llama
    plan names no norm, so sequence parallel is refused before start."""
    two = ClusterEnv(rank=0, local_rank=0, world_size=2, local_world_size=2)
    gpt2 = load_config(None, ["model.name=examples.hf_models:gpt2", "data.name=shakespeare", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="needs a plan"):
        make_layout(gpt2, two)
    sp = load_config(None, [f"model.name={HF}:llama", "data.name=shakespeare", "parallel.tp=2",
                            "parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError, match="names no norm to run on a sequence shard; hint: "
                                          "parallel.sequence_parallel=false"):
        make_layout(sp, two)


def test_a_pipeline_that_cannot_cut_the_model_fails_before_start() -> None:
    """Tied embeddings, or more stages than layers: exit 2 naming the model, before the process group."""
    cases = [("tied_llama", 2, "the embedding and the head share weights"),
             ("llama", 4, "2 blocks cannot fill 4 stages")]
    for model, pp, why in cases:
        env = ClusterEnv(rank=0, local_rank=0, world_size=pp, local_world_size=pp)
        cfg = load_config(None, [f"model.name={HF}:{model}", "data.name=shakespeare", f"parallel.pp={pp}",
                                 "data.drop_last=true"])
        with pytest.raises(ConfigError, match=rf"parallel.pp={pp} cannot cut model.name={HF}:{model} into {pp} "
                                              rf"stages: .*{why}") as info:
            make_layout(cfg, env)
        assert info.value.exit_code == 2


def test_parallel_names_no_model() -> None:
    """parallel/ applies the families' plans: no model name in it."""
    for path in sorted((ROOT / "hpctrain" / "parallel").glob("*.py")):
        text = path.read_text()
        assert not re.search(r"""["'](gpt|llama)["']""", text), path.name


def test_families_of_gpt_and_llama_keep_their_shapes() -> None:
    cfg = load_config(None, ["model.name=llama", "model.n_layers=3", "model.vocab=512", "model.tie_weights=false"])
    family = family_for(cfg.model)
    assert isinstance(family, ModelFamily) and family.shape is not None
    shape = family.shape(cfg.model)
    model = build_model("llama", 512, config=cfg.model)
    assert (shape.layers, shape.tied, shape.params) == (3, False, sum(p.numel() for p in model.parameters()))
    assert family_of(model) is family and family.blocks(model) == list(model.blocks)
