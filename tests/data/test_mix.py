"""Weighted mixtures (data.mix): the interleave as a function of (seed, position) at any world
size, realised counts, per-source epochs, exact resume, per-source validation, a short
classification run, a causal-LM mix, and bad entries (exit 2, one line)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from hpctrain.cli import main
from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.data import build_data
from hpctrain.data.batch import ArrayDataset
from hpctrain.data.loader import IndexedBatches
from hpctrain.data.mixture import STRIDE, Interleave, MixSource, MixtureLoader, mixture_codes, source_seed
from hpctrain.data.text import write_text_shards
from hpctrain.evaluation.evaluate import evaluate
from hpctrain.tasks import build_task

CPU = torch.device("cpu")
SIZES = {"big": 60, "mid": 25, "tiny": 5}
WEIGHTS = {"big": 0.5, "mid": 0.3, "tiny": 0.2}


def _sources(sizes: dict[str, int] = SIZES, weights: dict[str, float] = WEIGHTS, seed: int = 7) -> list[MixSource]:
    """In-memory sources whose input is (source number, sample id): every sample says where it is from."""
    out = []
    for s, (label, n) in enumerate(sizes.items()):
        x = torch.stack([torch.full((n,), float(s)), torch.arange(n, dtype=torch.float32)], dim=1)
        data = ArrayDataset(x, torch.zeros(n, dtype=torch.long), 10, label)
        out.append(MixSource(label, weights[label], IndexedBatches(data), [n], n, source_seed(seed, label)))
    return out


def _steps(world: int, batch: int, steps: int | None = None, state: dict | None = None,
           epoch: int = 0) -> tuple[list[list[tuple[int, int]]], dict]:
    """Each global step's samples (source, id), the ranks' batches in rank order, and the last state."""
    loaders = [MixtureLoader(_sources(), ClusterEnv(rank=r, world_size=world), batch, seed=7, drop_last=False)
               for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
        loader.set_epoch(epoch)
    out = []
    for parts in zip(*loaders):
        rows = [tuple(int(v) for v in row) for b in parts for row, m in zip(b.inputs, _mask(b)) if m]
        out.append(rows)
        if steps is not None and len(out) == steps:
            break
    return out, loaders[0].state_dict()


def _mask(batch) -> list[bool]:
    return [True] * len(batch) if batch.mask is None else batch.mask.tolist()


def test_interleave_is_a_function_of_seed_and_position_at_any_world_size() -> None:
    one, _ = _steps(1, 6)
    flat = [s for step in one for s in step]
    expected = mixture_codes(Interleave(list(WEIGHTS.values()), 7), _sources(), 0, sum(SIZES.values()))
    assert flat == [(int(c // STRIDE), int(c % STRIDE)) for c in expected]
    for world, batch in ((2, 3), (3, 2)):
        assert _steps(world, batch)[0] == one  # the same samples, step by step
    assert _steps(1, 6, epoch=1)[0] != one  # the next mixture epoch: further positions, other samples
    other = mixture_codes(Interleave(list(WEIGHTS.values()), 8), _sources(), 0, 90)
    assert not np.array_equal(other, expected)  # another seed: another interleave
    # a position's source does not depend on where a read starts (random access, no replay)
    inter = Interleave([0.5, 0.3, 0.2], 7)
    whole = inter.take(0, 5000)
    part = inter.take(1234, 2000)
    assert np.array_equal(whole[0][1234:3234], part[0]) and np.array_equal(whole[1][1234:3234], part[1])
    assert np.array_equal(inter.counts_before(3333), np.bincount(whole[0][:3333], minlength=3))


def test_realised_counts_are_the_weights_within_sampling_error() -> None:
    weights = [5.0, 3.0, 1.5, 0.5]
    inter = Interleave(weights, 3)
    shares = np.asarray(weights) / sum(weights)
    for n in (997, 12_345, 100_000):
        counts = inter.counts_before(n)
        assert counts.sum() == n
        assert np.all(np.abs(counts - shares * n) <= 4 * np.sqrt(n * shares * (1 - shares)) + 1), (n, counts)
    at_block = inter.counts_before(50 * inter.block)  # at block ends the counts are the weights to one sample
    assert np.all(np.abs(at_block - shares * 50 * inter.block) <= 1)
    zero = Interleave([1.0, 0.0, 1.0], 3).counts_before(4096)  # weight 0: validated, never trained on
    assert zero[1] == 0 and zero.sum() == 4096


def test_each_source_wraps_on_its_own_epochs_and_reshuffles() -> None:
    rows = [s for step in _steps(1, 6)[0] + _steps(1, 6, epoch=1)[0] for s in step]
    tiny = [i for s, i in rows if s == 2]  # 5 samples, a share of 0.2 of 180 positions: ~7 epochs of its own
    epochs = [tiny[k : k + 5] for k in range(0, len(tiny) - 4, 5)]
    assert len(epochs) >= 5
    assert all(sorted(e) == list(range(5)) for e in epochs)  # each epoch of the source: every sample once
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled when it wraps
    big = [i for s, i in rows if s == 0]
    assert sorted(big[:60]) == list(range(60)) and len(big) < 120  # the big one is in its second epoch
    loader = MixtureLoader(_sources(), ClusterEnv(), 6, seed=7, drop_last=False)
    for _ in loader:
        pass
    stats = loader.stats()["mix"]
    assert stats["tiny"]["epoch"] == 3 and stats["big"]["epoch"] == 0  # after one mixture epoch (90 positions)
    assert sum(r["samples"] for r in stats.values()) == 90


def test_resume_mid_epoch_is_exact_at_another_world_size() -> None:
    whole, _ = _steps(1, 6)
    whole_loader = MixtureLoader(_sources(), ClusterEnv(), 6, seed=7, drop_last=False)
    for _ in whole_loader:
        pass
    head, state = _steps(2, 3, steps=4)  # 4 steps of 6 at world size 2, saved
    assert state["position"] == 24 and sum(state["mix_samples"]) == 24
    tail, _ = _steps(3, 2, state=state)  # resumed at world size 3
    assert head + tail == whole  # the positions continue: nothing repeated, nothing skipped
    resumed = MixtureLoader(_sources(), ClusterEnv(rank=0, world_size=3), 2, seed=7, drop_last=False)
    resumed.load_state_dict(state)
    for _ in resumed:
        pass
    assert resumed.counts.tolist() == whole_loader.counts.tolist()  # the counts continue too
    changed = MixtureLoader(_sources(weights={"big": 0.4, "mid": 0.4, "tiny": 0.2}), ClusterEnv(), 6, seed=7)
    with pytest.raises(ValueError, match="another order"):
        changed.load_state_dict(state)


# ---------------------------------------------------------------- through the config and the trainer


def second_source() -> dict[str, TensorDataset]:
    """data.name=tests.data.test_mix:second_source: a map-style dataset of users, other data than synthetic_tiny."""
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(48, 128, generator=gen), torch.randint(0, 10, (48,), generator=gen)
    return {"train": TensorDataset(x[:32], y[:32]), "val": TensorDataset(x[32:], y[32:])}


TWO = ("data.mix=[{name: synthetic_tiny, weight: 3, synthetic_size: 80, label: synth}, "
       "{name: 'tests.data.test_mix:second_source', weight: 1}]")


def _train(capsys: pytest.CaptureFixture[str], tmp_path: Path, *keys: str) -> tuple[int, str]:
    code = main(["train", "train.progress=false", "checkpoint.enabled=false", f"run.dir={tmp_path / 'run'}", *keys])
    return code, capsys.readouterr().err


def test_a_short_classification_run_reports_counts_and_validation_per_source(tmp_path: Path, capsys, caplog) -> None:
    with caplog.at_level(logging.INFO, "hpctrain"):
        code, err = _train(capsys, tmp_path, "model.name=tests.user_models:tiny_mlp", TWO, "data.batch_size=8",
                           "train.epochs=2", "train.log_every=4")
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    mix = summary["mix"]
    assert set(mix) == {"synth", "second_source"} and mix["synth"]["weight"] == 0.75
    assert summary["data"] == "mix(synth=3, second_source=1)"
    assert mix["synth"]["samples"] + mix["second_source"]["samples"] == summary["samples_seen"] == 2 * 112
    assert abs(mix["synth"]["share"] - 0.75) < 0.1  # 224 draws: well within sampling error
    val = summary["val_sources"]
    assert val["synth"]["count"] == 16 and val["second_source"]["count"] == 16 and summary["val_count"] == 32
    total = (val["synth"]["loss"] * 16 + val["second_source"]["loss"] * 16) / 32
    assert summary["val_loss"] == pytest.approx(total, rel=1e-12)  # the total is one pass over both
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss/second_source" in r for r in rows) and any("mix_samples/synth" in r for r in rows)
    logged = [r.message for r in caplog.records if r.message.startswith("data.mix after epoch 0: ")]
    assert len(logged) == 1 and "synth " in logged[0] and "second_source " in logged[0], logged


def test_a_causal_lm_mix_validates_per_source_and_refuses_another_vocabulary(tmp_path: Path, capsys) -> None:
    for name, n in (("a", 5), ("b", 7)):
        corpus = tmp_path / f"c{name}"
        corpus.mkdir()
        rng = np.random.default_rng(n)
        for i in range(n):
            (corpus / f"d{i}.txt").write_text(" ".join(f"{name}{int(x)}" for x in rng.integers(0, 30, 60)) + "\n")
        write_text_shards(f"text:{corpus}", tmp_path / name, seq_len=16, val_fraction=0.3)
    mix = f"data.mix=[{{path: {tmp_path / 'a'}, weight: 1}}, {{path: {tmp_path / 'b'}, weight: 2}}]"
    cfg = load_config(None, [mix, "data.batch_size=4"])
    bundle = build_data(cfg.data, ClusterEnv(), CPU, seed=0, seq_len=16)
    assert (bundle.task, bundle.input_shape, bundle.num_classes) == ("causal_lm", (16,), 256)
    batch = next(iter(bundle.train_loader))
    assert batch.inputs.dtype == torch.int64 and batch.inputs.shape == (4, 17)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))
    task = build_task("causal_lm")
    res = evaluate(model, bundle.val_loader, task.metrics(256), ClusterEnv(), CPU, task=task)
    assert set(res.sources) == {"a", "b"} and "perplexity/a" in res.metrics
    assert res.metrics["tokens"] == res.sources["a"]["tokens"] + res.sources["b"]["tokens"]
    code, err = _train(capsys, tmp_path, "model.name=gpt", "model.n_layers=1", "model.hidden=16", "model.heads=2",
                       "model.seq_len=16", "data.batch_size=4", "train.max_steps=3", mix)
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["task"] == "causal_lm" and sum(r["samples"] for r in summary["mix"].values()) == 12
    assert summary["val_tokens"] == sum(summary["val_sources"][s]["tokens"] for s in "ab")
    assert all(summary["val_sources"][s]["perplexity"] > 1 for s in "ab")
    write_text_shards(f"text:{tmp_path / 'ca'}", tmp_path / "short", seq_len=8, val_fraction=0.3)
    bad = mix.replace("]", f", {{path: {tmp_path / 'short'}, weight: 1}}]")
    code, err = _train(capsys, tmp_path, "model.name=gpt", bad, "run.overwrite=true")
    assert code == 2 and "data.mix[2] (short) has input shape (8,), but data.mix[0] (a) has (16,)" in err, err
    code, err = _train(capsys, tmp_path, "model.name=tests.user_models:tiny_mlp", "data.batch_size=4",
                       mix.replace("]", ", {name: synthetic_tiny, weight: 1}]"))
    assert code == 2 and "data.mix[2] (synthetic_tiny) has task classification, but data.mix[0] (a) has causal_lm" \
        in err, err


@pytest.mark.parametrize(("mix", "message"), [
    ("[{name: synthetic_tiny, weight: -1}]", "data.mix[0].weight=-1 must be a number >= 0"),
    ("[{name: synthetic_tiny, weight: 0}, {name: mnist, weight: 0}]", "data.mix: the weights sum to 0"),
    ("[{name: synthetic_tiny, weight: 1}, {weight: 1}]", "data.mix[1] names no source; hint:"),
    ("[{name: synthetic_tiny, weight: 1}, {name: nosuch, weight: 1}]",
     "data.mix[1] (nosuch): data.name='nosuch' is unknown"),
    ("[{name: synthetic_tiny, weight: 1}, {path: /nonexistent/mixdir, weight: 1}]", "data.mix[1] (mixdir): "),
    ("[{name: synthetic_tiny, weight: 1, batch_size: 4}]", "unknown key 'data.mix[0].batch_size'"),
    ("[{name: synthetic_tiny, weight: 1, shuffle: sideways}]", "data.mix[0].shuffle='sideways' is not allowed"),
])
def test_bad_entries_exit_2_with_one_line(tmp_path: Path, capsys, mix: str, message: str) -> None:
    code, err = _train(capsys, tmp_path, "model.name=tests.user_models:tiny_mlp", f"data.mix={mix}")
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert code == 2 and message in err and len(lines) == 1 and "Traceback" not in err, err
