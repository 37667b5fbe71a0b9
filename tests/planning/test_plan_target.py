"""`hpctrain plan --gpu ...` plans for the machine the job will run on (issue 27 point 4): on this CPU
machine, without torch for the built-in transformers, it chooses exactly what `parallel.strategy=auto`
chooses on that machine (`parallel.target_gpu`), and the job logs it; the search covers hsdp,
DeepSpeed, cpu offload and pipeline schedules; activations are counted for the target's attention
kernel; the practitioners' layouts come out; nothing fitting exits 2 with what would help; users'
models plan from `model.input_shape`."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from hpctrain.cli import main
from hpctrain.config import ConfigError, load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.estimate.strategy_memory import strategy_memory, with_changes
from hpctrain.planning.auto import choose, memory_inputs, resolve_auto
from hpctrain.planning.layout import make_layout
from hpctrain.planning.profile import builtin_shape

AUTO = ["parallel.strategy=auto", "precision=bf16", "optim.name=adamw"]


def llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int = 128256, seq: int = 8192) -> list[str]:
    return ["model.name=llama", f"model.n_layers={layers}", f"model.hidden={hidden}", f"model.heads={heads}",
            f"model.kv_heads={kv}", f"model.ffn_hidden={ffn}", f"model.vocab={vocab}", "model.tie_weights=false",
            f"model.seq_len={seq}"]


LLAMA3_8B = llama(32, 4096, 32, 8, 14336)
LLAMA3_70B = llama(80, 8192, 64, 8, 28672)
LLAMA3_405B = llama(126, 16384, 128, 8, 53248)
LLAMA2_13B = llama(40, 5120, 40, 40, 13824, vocab=32000, seq=4096)
GPT_SMALL = ["model.name=gpt", "model.n_layers=12", "model.hidden=768", "model.heads=12", "model.seq_len=1024",
             "model.vocab=50304"]


def _env(gpus: int, per_node: int = 8) -> ClusterEnv:
    return ClusterEnv(world_size=gpus, local_world_size=min(gpus, per_node), num_nodes=max(1, gpus // per_node))


def _auto(model: list[str], gpu: str, gpus: int, *extra: str):
    return choose(load_config(None, [*model, *AUTO, f"parallel.target_gpu={gpu}", *extra]), _env(gpus))


def _plan_json(capsys, model: list[str], gpu: str, gpus: int, *extra: str) -> dict:
    assert main(["plan", "--json", "--gpu", gpu, "--gpus-per-node", "8", "-n", str(gpus), *model, *AUTO,
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


CASES = [(LLAMA3_8B, "h100-sxm", 8, "data.global_batch_size=16"),
         (LLAMA3_70B, "h100-sxm", 64, "data.global_batch_size=64"),
         (LLAMA2_13B, "a100-40gb", 8, "data.global_batch_size=32"),
         (GPT_SMALL, "a100", 16, "data.global_batch_size=256")]


@pytest.mark.parametrize("model,gpu,gpus,batch", CASES, ids=["8b@8", "70b@64", "13b@8xa100-40", "gpt@16"])
def test_plan_here_and_auto_on_the_target_agree(capsys, monkeypatch, model, gpu, gpus, batch):
    """The login node's plan (CPU, --gpu) and the job's auto (parallel.target_gpu, on a 'GPU node'
    whose device is not asked) give the same config keys; the job logs the plan."""
    planned = _plan_json(capsys, model, gpu, gpus, batch)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("a named target asks no device"))
    cfg = load_config(None, [*model, *AUTO, batch, f"parallel.target_gpu={gpu}"])
    env = ClusterEnv(world_size=gpus, local_world_size=min(gpus, 8), num_nodes=max(1, gpus // 8))
    resolved = resolve_auto(cfg, env)
    p = resolved.parallel
    chosen = dict(key.split("=", 1) for key in planned["chosen"])
    assert (chosen["parallel.strategy"], int(chosen["parallel.tp"]), int(chosen["parallel.pp"]),
            chosen["parallel.activation_checkpointing"], int(chosen["data.batch_size"])) == \
        (p.strategy, p.tp, p.pp, p.activation_checkpointing, resolved.data.batch_size)
    assert chosen.get("parallel.cpu_offload", "false") == str(p.cpu_offload).lower()
    assert chosen["parallel.target_gpu"] == gpu
    if p.pp > 1:
        assert (int(chosen["parallel.microbatches"]), chosen["parallel.pp_schedule"]) == (p.microbatches,
                                                                                           p.pp_schedule)
    assert (planned["world"], planned["ranks_per_node"], planned["global_batch"]) == \
        (gpus, min(gpus, 8), int(batch.split("=")[1]))
    assert planned["machine"]["target"] == gpu and planned["machine"]["kind"] == "cuda"
    if gpus <= 16:  # the trainer's own checks accept the plan the torch-free rules chose (70B: seconds on meta)
        make_layout(resolved, env)


def test_the_job_logs_the_chosen_plan(caplog):
    cfg = load_config(None, [*LLAMA3_8B, *AUTO, "data.global_batch_size=16", "parallel.target_gpu=h100-sxm"])
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        resolved = resolve_auto(cfg, _env(8))
    logged = [r.getMessage() for r in caplog.records]
    assert logged[0].startswith("parallel.strategy=auto: 8 ranks (8 per node), budget 80 GB per rank on "
                                "H100-SXM5-80GB (72 GB usable, flash attention), global batch 16")
    assert sum("<- chosen" in line for line in logged) == 1
    assert logged[-1] == "config: " + " ".join(
        [f"parallel.strategy={resolved.parallel.strategy}", f"parallel.tp={resolved.parallel.tp}",
         f"parallel.pp={resolved.parallel.pp}",
         f"parallel.activation_checkpointing={resolved.parallel.activation_checkpointing}",
         f"data.batch_size={resolved.data.batch_size}"]
        + (["parallel.cpu_offload=true"] if resolved.parallel.cpu_offload else [])
        + ["parallel.target_gpu=h100-sxm"])


def test_plan_on_a_login_node_imports_no_torch():
    code = ("import sys\nfrom hpctrain.cli import main\n"
            f"rc = main(['plan', '--gpu', 'h100-sxm', '--gpus-per-node', '8', '-n', '512', *{LLAMA3_405B + AUTO!r},"
            " 'data.global_batch_size=512'])\n"
            "assert rc == 0, rc\nassert 'torch' not in sys.modules, 'torch imported'\nprint('no torch')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "no torch"
    assert "config: parallel.strategy=fsdp parallel.tp=8 " in done.stdout


# ---------------------------------------------------------------- the practitioners' layouts


def test_llama3_8b_on_8_h100_is_fsdp_without_tp():
    c = _auto(LLAMA3_8B, "h100-sxm", 8, "data.global_batch_size=16").chosen
    assert (c.strategy, c.tp, c.pp, c.dp, c.cpu_offload) == ("fsdp", 1, 1, 8, False)


def test_llama3_70b_on_64_h100_is_split_by_tp_within_nodes():
    """With H100's own links (NVLink 4, 400 Gb/s per GPU: tests/planning/test_plan_links.py says why
    the cost model prefers a pipeline to torchtitan's FSDP x TP8 here) tp stays within a node."""
    c = _auto(LLAMA3_70B, "h100-sxm", 64, "data.global_batch_size=512").chosen  # 4M tokens a step
    assert c.fits and 1 < c.tp <= 8 and not c.cpu_offload


def test_llama3_405b_on_512_h100_is_tp8_pp_fsdp():
    c = _auto(LLAMA3_405B, "h100-sxm", 512, "data.global_batch_size=512").chosen
    assert (c.strategy, c.tp) == ("fsdp", 8) and c.pp > 1 and c.dp > 1 and c.fits


@pytest.mark.parametrize("every_microstep", [True, False])
def test_13b_on_8_a100_40gb_fits_as_planned_with_the_declared_gradients(every_microstep):
    """Global batch 32 on 8 ranks: accumulation; whole gradients declared when inner micro-steps skip the
    reduce-scatter, and the plan still fits the 40 GB with them."""
    choice = _auto(LLAMA2_13B, "a100-40gb", 8, "data.global_batch_size=32",
                   f"parallel.reduce_every_microstep={str(every_microstep).lower()}")
    c = choice.chosen
    assert c.fits and c.total <= 40e9 * 0.9 and c.micro_batch * c.grad_accum * c.dp == 32
    inp = memory_inputs(choice.config, _profile(choice.config), choice.machine, c)
    declared = strategy_memory(inp)
    assert c.memory["grads"] == declared.gradients and c.total == pytest.approx(declared.total)
    shape, _ = builtin_shape(choice.config.model)
    accumulating = [r for r in choice.candidates if r.strategy == "fsdp" and r.pp == 1 and r.dp > 1 and r.grad_accum > 1
                    and not r.cpu_offload]
    assert accumulating
    for r in accumulating:  # whole fp32 gradients of the rank's tp part, or their 1/dp shard
        whole = r.memory["grads"] * (1 if not every_microstep else r.dp)
        assert whole == pytest.approx(shape.params * 4 / r.tp, rel=0.03), r.label


def _profile(cfg):
    from hpctrain.planning.auto import model_profile

    return model_profile(cfg)


# ---------------------------------------------------------------- what the search covers and counts


def test_the_search_covers_hsdp_deepspeed_offload_and_pipeline_schedules():
    choice = _auto(LLAMA3_70B, "h100-sxm", 64, "data.global_batch_size=64")
    labels = {c.label.split(" ")[0] for c in choice.candidates if c.tp == c.pp == 1}
    assert {"ddp", "zero1", "fsdp", "fsdp+offload", "hsdp"} <= labels
    assert {"deepspeed-z1", "deepspeed-z2", "deepspeed-z3"} <= labels or "deepspeed" not in sys.modules
    pipelines = {(c.microbatches, c.schedule) for c in choice.candidates if c.pp > 1}
    assert len({s for _, s in pipelines}) >= 2 and len({m for m, _ in pipelines}) >= 2


def test_activations_are_counted_for_the_targets_attention_kernel():
    """The models call SDPA, whose flash / memory-efficient kernels (CUDA, and CPU's flash) keep no
    s x s scores: the plan is counted that way, not as the meta device's math path would save them."""
    gpu = _auto(LLAMA3_8B, "h100-sxm", 8, "data.global_batch_size=16")
    c = gpu.chosen
    prof = _profile(gpu.config)
    flash = memory_inputs(gpu.config, prof, gpu.machine, c)
    assert flash.attention == "flash"
    assert c.memory["activations"] == strategy_memory(flash).activations
    none = with_changes(flash, recompute="none")
    math = with_changes(none, attention="math")
    shape = prof.shape
    scores = shape.layers * shape.heads / c.tp * shape.seq_len ** 2 * flash.micro_batch * 2  # bf16 softmax outputs
    assert strategy_memory(math).activations - strategy_memory(none).activations == pytest.approx(scores, rel=0.01)
    cpu = choose(load_config(None, [*GPT_SMALL, *AUTO, "parallel.memory_budget_gb=1000"]), _env(1))
    assert memory_inputs(cpu.config, _profile(cpu.config), cpu.machine, cpu.chosen).attention == "flash"


def test_under_tp_the_llama_ends_are_split_as_the_trainer_splits_them():
    """Llama 3 8B at tp8: the embedding and head split by vocabulary, as hpctrain's llama does (about
    4 GB of fp32 weights per rank, not 7.7); the gpt keeps its ends whole."""
    choice = _auto(LLAMA3_8B, "h100-sxm", 8, "data.global_batch_size=16")
    tp8 = next(c for c in choice.candidates if c.tp == 8 and c.pp == 1)
    shape, _ = builtin_shape(choice.config.model)
    assert tp8.memory["params"] == pytest.approx(shape.params * 4 / 8, rel=0.01)
    gpt = _auto(GPT_SMALL, "a100", 4, "data.global_batch_size=64")
    g, vocab_parallel = builtin_shape(gpt.config.model)
    tp4 = next(c for c in gpt.candidates if c.tp == 4 and c.pp == 1)
    ends = g.embedding_params + g.norm_params
    assert not vocab_parallel and tp4.memory["params"] == pytest.approx((ends + g.layers * g.layer_params / 4) * 4,
                                                                        rel=0.02)  # the tied embedding whole


# ---------------------------------------------------------------- failures and output


def test_nothing_fits_exits_2_naming_the_smallest_need_and_what_would_help(capsys):
    assert main(["plan", "--gpu", "a100-40gb", "--gpus-per-node", "8", "-n", "8", *LLAMA3_405B, *AUTO,
                 "data.global_batch_size=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    line = err[0]
    assert re.search(r"no plan fits the A100-SXM4-40GB's 40 GB on 8 ranks \(36 GB per rank after "
                     r"parallel.memory_margin=0.1\); the smallest need is [0-9,.]+ GB per rank \(", line), line
    assert "hint: a GPU with at least" in line and "parallel.cpu_offload=true" in line and "more ranks than 8" in line


def test_plan_json_names_the_machine_and_writes_numbers_for_people(capsys):
    out = _plan_json(capsys, LLAMA3_405B, "h100-sxm", 512, "data.global_batch_size=512")
    assert (out["world"], out["ranks_per_node"], out["nodes"], out["global_batch"]) == (512, 8, 64, 512)
    assert out["machine"]["name"] == "H100-SXM5-80GB" and out["machine"]["budget"] == 80_000_000_000
    text = json.dumps(out)
    assert not re.search(r"\d[eE][+-]?\d", text), "an exponent in the JSON"
    assert all(isinstance(r["total_bytes"], int) for r in out["candidates"])


def test_the_machine_flags_override_the_table_and_a_part_it_lacks_needs_both(capsys):
    out = _plan_json(capsys, GPT_SMALL, "h100-sxm", 8, "data.global_batch_size=64", "--gpu-memory-gb", "94",
                     "--peak-tflops", "500")
    assert out["machine"]["budget"] == 94_000_000_000 and out["machine"]["flops"] == 200_000_000_000_000
    assert out["chosen"][-3:] == ["parallel.target_gpu=h100-sxm", "parallel.memory_budget_gb=94",
                                  "parallel.target_peak_tflops=500"]  # what the job needs to plan alike
    assert main(["plan", "--gpu", "x200", "--gpus-per-node", "8", "-n", "8", *GPT_SMALL, *AUTO]) == 2
    assert "parallel.target_gpu='x200' is not in the accelerator table" in capsys.readouterr().err
    out = _plan_json(capsys, GPT_SMALL, "x200", 8, "data.global_batch_size=64", "--gpu-memory-gb", "100",
                     "--peak-tflops", "1000")
    assert out["machine"]["name"] == "x200" and out["machine"]["budget"] == 100_000_000_000


def test_a_users_model_plans_from_model_input_shape():
    cfg = load_config(None, ["model.name=tests.user_models:tiny_mlp", "model.input_shape=[128]",
                             "parallel.strategy=auto", "parallel.memory_budget_gb=0.001", "data.global_batch_size=8"])
    choice = choose(cfg, _env(2))
    c = choice.chosen
    assert c.fits and c.memory["params"] == pytest.approx((128 * 32 + 32 + 32 * 10 + 10) * 4, rel=0.01)
    with pytest.raises(ConfigError, match=r"model.input_shape=\[3,224,224\]"):
        choose(load_config(None, ["model.name=tests.user_models:tiny_mlp", "parallel.strategy=auto",
                                  "parallel.memory_budget_gb=0.001"]), _env(2))


@pytest.mark.parametrize("model", [GPT_SMALL, LLAMA2_13B, ["model.name=llama", "model.n_layers=3",
                                                           "model.kv_heads=2", "model.tie_weights=false"]])
def test_the_torch_free_shapes_are_the_families(model):
    from hpctrain.models.family import family_for

    cfg = load_config(None, model).model
    assert builtin_shape(cfg)[0] == family_for(cfg).shape(cfg)


# ---------------------------------------------------------------- issue 28 point 4: cp and ep


def test_a_long_sequence_considers_context_parallel_and_says_so(capsys):
    assert main(["plan", "--gpu", "h100-sxm", "--gpus-per-node", "8", "-n", "8", *llama(32, 4096, 32, 8, 14336,
                                                                                          seq=32768),
                 *AUTO, "data.global_batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  \S.* cp[248]\b", out, re.MULTILINE)  # candidates with cp 2, 4 or 8
    chosen = next(line for line in out.splitlines() if line.startswith("chosen: "))
    why = [line for line in out.splitlines() if line.startswith("why: ")]
    assert len(why) == 1
    assert why[0].startswith("why: cp") if " cp" in chosen else "context parallel was considered" in why[0]
    short = _auto(LLAMA3_8B, "h100-sxm", 8, "data.global_batch_size=16")  # 8,192 tokens: not long
    assert all(c.cp == 1 for c in short.candidates)


def test_a_mixture_of_experts_considers_expert_parallel_and_says_so(capsys):
    moe = ["model.name=llama", "model.n_layers=4", "model.hidden=1024", "model.heads=8", "model.kv_heads=8",
           "model.ffn_hidden=704", "model.experts=8", "model.top_k=2", "model.vocab=32000", "model.seq_len=2048"]
    assert main(["plan", "--gpu", "h100-sxm", "--gpus-per-node", "8", "-n", "8", *moe, *AUTO,
                 "data.global_batch_size=64"]) == 0
    out = capsys.readouterr().out
    eps = {int(m) for m in re.findall(r"^  \S.* ep(\d)\b", out, re.MULTILINE)}
    assert eps == {2, 4, 8}
    assert re.search(r"^  fsdp dp4 tp2 +rejected: model.experts with parallel.tp=2 ", out, re.MULTILINE)  # D's rule
    why = [line for line in out.splitlines() if line.startswith("why: ")]
    chosen = next(line for line in out.splitlines() if line.startswith("chosen: "))
    assert len(why) == 1 and (why[0].startswith("why: ep") if " ep" in chosen else
                              "expert parallel was considered" in why[0])


def test_at_128k_tokens_only_context_parallel_fits_and_the_declaration_divides_by_cp():
    """Llama 3 8B at 131,072 tokens on 8 x H100: no data- or tensor-parallel layout fits; the
    chosen one splits the sequence, and its declared activations fall as 1/cp."""
    choice = _auto(llama(32, 4096, 32, 8, 14336, seq=131072), "h100-sxm", 8, "data.global_batch_size=8")
    c = choice.chosen
    assert c.cp > 1 and c.fits
    assert not any(r.fits for r in choice.candidates if r.cp == 1)
    inp = memory_inputs(choice.config, _profile(choice.config), choice.machine, c)
    one = strategy_memory(with_changes(inp, topology=replace(inp.topology, cp=1, dp_shard=inp.topology.dp_shard)))
    split = strategy_memory(inp)
    # every activation term but the K/V each rank gathers whole scales as 1/cp; FSDP shards over dp x cp
    assert split.activations < one.activations / c.cp * 1.25
    assert split.weights == pytest.approx(one.weights / c.cp)
