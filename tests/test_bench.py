"""``hpctrain bench NAME --quick``: every case runs at its reduced size and writes its JSON and
PNG with the expected fields, and states the hardware. No timing is asserted: the figures
of a 2-core shared machine say nothing; the structure, the exact bookkeeping and the
behaviour do.

Where the time goes, and what keeps it short (nothing here is a product option):

- A fresh Python process that imports torch and hpctrain costs 3-5 s of CPU before it trains
  a step, and the runs themselves take well under a second at ``--quick``. So the
  single-process runs of amp, workers and batch run in this process (:func:`in_process`:
  the same :func:`bench.child.main` on the same command line). The fresh-process path
  they skip (``command``, ``launch``, the child's ``__main__``, the rank reports read back) is
  the one scaling's 1-rank runs take, and test_a_failed_run_names_its_cause fails a real child
  through it.
- scaling and strategies launch their ranks themselves, as always (torchrun, fresh
  processes), at 2 ranks on a CPU whatever the core count (``--procs 2``); the default counts
  they would pick are checked without runs.
- (In the product, for every user:) a bench child reads its overrides before it imports torch,
  so a bad one fails in a fraction of a second, and a run that worked skips the interpreter's
  ~1 s teardown of torch (:func:`bench.child.finish`).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.cli import bench as bench_command
from hpctrain.cli import main
from hpctrain.cli.bench import BENCH_DIR_ENV, find_bench_dir
from hpctrain.core.errors import RunError
from hpctrain.launch.doctor import cpus
from tests.dist_utils import ROOT

# the cases live in the checkout's benchmarks/bench/, outside the package: found as `hpctrain bench` finds them
sys.path.insert(0, str(find_bench_dir()))
from bench import child, runner  # noqa: E402
from bench.context import Context  # noqa: E402
from bench.runner import RunStats, Steps, launch, steady  # noqa: E402
from bench.scaling import max_procs, plan, table_rows  # noqa: E402
from bench.strategies import cases, refusal, world  # noqa: E402

pytestmark = pytest.mark.slow  # launches or several ranks: scheduled first (tests/conftest.py)

pytest.importorskip("matplotlib", reason="hpctrain bench draws with matplotlib (the bench extra)")
Image = pytest.importorskip("PIL.Image", reason="pillow checks the PNGs")

HARDWARE = {"cpu", "cores", "gpus", "torch", "hpctrain", "load_avg_1m", "load_avg_1m_end"}
ROW_KEYS = {
    "baseline": {"loop", "samples_per_s", "step_ms", "seconds"},
    "amp": {"precision", "samples_per_s", "speedup", "peak_mem_gb", "loss"},
    "workers": {"workers", "samples_per_s", "data_wait_share", "peak_mem_gb"},
    "batch": {"batch", "samples_per_s", "step_ms", "peak_mem_gb"},
    "checkpoint": {"operation", "method", "GBps", "vs_dd"},
    "scaling": {"ranks", "plain_samples_per_s", "hpctrain_samples_per_s", "plain_speedup", "hpctrain_speedup",
                "plain_efficiency", "hpctrain_efficiency"},
    "strategies": {"strategy", "status", "tokens_per_s", "tokens_vs_ddp", "mem_max_gb", "mem_per_rank_gb", "params_mb",
                   "grads_mb", "optimizer_mb", "activations_mb", "breakdown"},
}


def _bench(name: str, out, capsys, *options: str) -> tuple[dict, str]:
    assert main(["bench", name, "--quick", "--out", str(out), *options]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / f"{name}.json").read_text())
    with Image.open(out / f"{name}.png") as img:
        img.verify()
        assert img.format == "PNG" and img.size[0] > 300 and img.size[1] > 200
    assert doc["case"] == name and doc["command"] == " ".join(["hpctrain", "bench", name, "--quick", "--out", str(out),
                                                              *options])
    assert HARDWARE <= set(doc["hardware"]) and doc["hardware"]["cores"] >= 1
    assert doc["hardware"]["cpu"] in printed and doc["hardware"]["torch"] in printed  # the hardware is stated
    assert doc["rows"] and all(ROW_KEYS[name] <= set(row) for row in doc["rows"])
    assert doc["columns"] and set(doc["columns"]) <= set(doc["rows"][0])
    assert not (out / f"{name}-work").exists()  # scratch removed after a run that worked
    return doc, printed


def _finite_positive(*values: float) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)


@pytest.fixture
def in_process(monkeypatch) -> Iterator[list[list[str]]]:
    """The bench's single-process runs (``python -m bench.child PREFIX k=v ...``) as
    :func:`bench.child.main` in this process, its output in the run's log as before;
    runs under torchrun still start their processes. What the run changes in this process
    (threads, the random generators) is put back. Yields the command lines it ran."""
    real, ran = runner.launch, []

    def launch_here(cmd: list[str], log: Path) -> None:
        if cmd[:3] != [sys.executable, "-m", "bench.child"]:
            return real(cmd, log)
        ran.append(cmd)
        with open(log, "w") as fh, contextlib.redirect_stdout(fh):
            assert child.main(cmd[3:]) == 0
        return None

    threads, rngs = torch.get_num_threads(), (random.getstate(), np.random.get_state(), torch.get_rng_state())
    monkeypatch.setattr(runner, "launch", launch_here)
    yield ran
    torch.set_num_threads(threads)
    random.setstate(rngs[0])
    np.random.set_state(rngs[1])
    torch.set_rng_state(rngs[2])


def test_baseline_same_weights_both_loops(tmp_path, capsys):
    doc, printed = _bench("baseline", tmp_path, capsys)
    assert [r["loop"] for r in doc["rows"]] == ["plain PyTorch loop", "hpctrain"]
    assert doc["summary"]["weights_equal"] is True  # same start, same batches: bitwise the same weights
    assert _finite_positive(doc["summary"]["time_ratio_hpctrain_vs_plain"], *(r["samples_per_s"] for r in doc["rows"]))
    assert "plain PyTorch loop" in printed and "samples/s" in printed


def test_amp_precisions(tmp_path, capsys, in_process):
    doc, _ = _bench("amp", tmp_path, capsys)
    assert len(in_process) == len(doc["rows"])  # one run per precision, each in this process
    expected = ["fp32", "bf16", "fp16"] if doc["hardware"]["gpus"] else ["fp32", "bf16"]
    assert [r["precision"] for r in doc["rows"]] == expected
    assert doc["rows"][0]["speedup"] == 1.0
    assert all(_finite_positive(r["samples_per_s"], r["peak_mem_gb"], r["loss"]) for r in doc["rows"])


def test_workers_counts(tmp_path, capsys, in_process):
    doc, _ = _bench("workers", tmp_path, capsys)
    assert len(in_process) == 2
    assert [r["workers"] for r in doc["rows"]] == [0, 1]
    assert all(0.0 <= r["data_wait_share"] < 1.0 for r in doc["rows"])


def test_batch_sizes(tmp_path, capsys, in_process):
    doc, _ = _bench("batch", tmp_path, capsys)
    assert len(in_process) == 2
    assert [r["batch"] for r in doc["rows"]] == doc["settings"]["batch_sizes"] == [4, 16]
    assert all(r["step_ms"] == pytest.approx(r["batch"] / r["samples_per_s"] * 1e3) for r in doc["rows"])


def test_checkpoint_against_dd(tmp_path, capsys):
    doc, _ = _bench("checkpoint", tmp_path, capsys)
    ops = [(r["operation"], r["method"]) for r in doc["rows"]]
    assert ("write", "dd oflag=direct") in ops and ("read", "dd iflag=direct") in ops
    assert ("write", "hpctrain") in ops and ("read", "hpctrain verify + load, one pass") in ops
    assert all(r["vs_dd"] == 1.0 for r in doc["rows"] if r["method"].startswith("dd"))
    assert _finite_positive(doc["summary"]["hpctrain_save_vs_dd"], doc["summary"]["hpctrain_load_vs_dd"])
    assert doc["details"]["state_bytes"] > 0


def test_scaling_one_and_two_ranks_hpctrain_and_plain_ddp(tmp_path, capsys):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    # one rank per GPU (the default); on a CPU 1 and 2 ranks, however many cores (the default
    # there, 2..8 by the cores, is test_default_rank_counts')
    doc, _ = _bench("scaling", tmp_path, capsys, *([] if gpus else ["--procs", "2"]))
    ranks = [r["ranks"] for r in doc["rows"]]
    assert ranks == list(range(1, (gpus or 2) + 1))
    first, last = doc["rows"][0], doc["rows"][-1]
    assert first["plain_efficiency"] == first["hpctrain_efficiency"] == 1.0  # each loop against itself
    assert last["hpctrain_efficiency"] == pytest.approx(last["hpctrain_samples_per_s"]
                                                        / first["hpctrain_samples_per_s"] / last["ranks"])
    assert doc["summary"]["goal_hpctrain_efficiency_ge_plain"] == (last["hpctrain_efficiency"]
                                                                  >= last["plain_efficiency"])


def test_strategies_break_memory_down_per_rank_as_each_strategy_divides_it(tmp_path, capsys):
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        assert main(["bench", "strategies", "--quick", "--out", str(tmp_path)]) == 2
        assert "needs 2 or more GPUs" in capsys.readouterr().err
        assert not (tmp_path / "strategies.json").exists() and not (tmp_path / "strategies-work").exists()
        return
    doc, printed = _bench("strategies", tmp_path, capsys, "--procs", "2")  # on any number of cores or GPUs
    # --quick: the bench's own path on two strategies; the bytes of every strategy (deepspeed, pp, tp,
    # hsdp, offload ...) against their declaration: tests/estimate/test_strategy_memory_declared.py
    rows = {r["strategy"]: r for r in doc["rows"]}
    assert list(rows) == ["ddp", "fsdp-zero3"] and "fsdp-zero3" in printed
    assert all(r["status"] == "ok" for r in rows.values()), {name: r["status"] for name, r in rows.items()}
    ok = list(rows.values())
    assert all(len(r["mem_per_rank_gb"]) == len(r["breakdown"]) == doc["settings"]["ranks"] == 2 for r in ok)
    assert all(_finite_positive(r["tokens_per_s"], *r["mem_per_rank_gb"]) for r in ok)
    assert rows["ddp"]["tokens_vs_ddp"] == 1.0
    ddp, fsdp = (rows[name]["breakdown"] for name in ("ddp", "fsdp-zero3"))
    params = ddp[0]["params_bytes"]
    assert ddp[0] == {**ddp[1], "rank": 0} and ddp[0]["grads_bytes"] == params
    assert 0 < ddp[0]["optimizer_bytes"] - 2 * params < 4 * 100  # m, v, and a 4-byte step counter per tensor
    for rank in fsdp:  # ZeRO-3: every dim is even here, so no padding: exactly half, the same activations
        assert 2 * rank["params_bytes"] == 2 * rank["grads_bytes"] == params
        assert rank["activations_bytes"] == ddp[0]["activations_bytes"] > 0


def test_strategies_lists_what_hpctrain_refuses_instead_of_crashing(monkeypatch):
    assert [c.name for c in cases(2, quick=False)] == ["ddp", "zero1", "fsdp-zero2", "fsdp-zero3", "fsdp-offload",
                                                      "deepspeed-1", "deepspeed-2", "deepspeed-3", "tp2", "pp2"]
    assert ("parallel.tp=2", "parallel.strategy=fsdp") == next(c for c in cases(4, False) if c.name == "tp2").overrides
    assert refusal(["model.name=gpt", "parallel.strategy=fsdp"], 2) is None
    refused = refusal(["model.name=gpt", "parallel.tp=3"], 2)
    assert refused is not None and refused.startswith("refused: parallel.dp") and "world size 2" in refused
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    skipped = refusal(["parallel.strategy=deepspeed"], 2)
    assert skipped is not None and skipped.startswith("skipped: ") and "pip install" in skipped


# ---------------------------------------------------------------- the bookkeeping, without runs


def test_steady_rate_leaves_out_the_warmup_interval_and_weights_by_time():
    rows = [{"step": 2, "samples_per_s": 1.0},  # warm-up: not counted
            {"step": 4, "samples_per_s": 100.0}, {"step": 8, "samples_per_s": 50.0}]
    # 2 steps at 100/s and 4 steps at 50/s (batch b): 6b samples in (2b/100 + 4b/50) s
    assert steady(rows, "samples_per_s") == pytest.approx(6 / (2 / 100 + 4 / 50))
    shares = [{"step": 2, "data_wait_share": 0.9}, {"step": 4, "data_wait_share": 0.1},
              {"step": 8, "data_wait_share": 0.4}]
    assert steady(shares, "data_wait_share") == pytest.approx((2 * 0.1 + 4 * 0.4) / 6)
    with pytest.raises(RunError, match="needs 2 or more"):
        steady(rows[:1], "samples_per_s")


def test_steps_must_be_whole_log_intervals():
    assert Steps(2, 6).total == 8
    for warmup, measured in ((0, 4), (3, 4), (4, 2)):
        with pytest.raises(ValueError, match="multiple of warmup"):
            Steps(warmup, measured)


def test_scaling_alternates_which_loop_goes_first():
    order = plan([1, 2], repeats=2)
    assert order == [(1, "plain"), (1, "hpctrain"), (2, "hpctrain"), (2, "plain"),
                     (1, "hpctrain"), (1, "plain"), (2, "plain"), (2, "hpctrain")]
    stats = {(n, loop): [RunStats(rate * n, 1.0, "peak_rss")] for n in (1, 2)
             for loop, rate in (("plain", 10.0), ("hpctrain", 12.0))}
    rows = table_rows([1, 2], stats)
    assert rows[1]["plain_speedup"] == rows[1]["hpctrain_speedup"] == 2.0
    assert rows[1]["plain_efficiency"] == 1.0


def test_a_failed_run_names_its_cause(tmp_path):
    with pytest.raises(RunError, match="unknown key 'data.batchsize'") as err:
        launch([sys.executable, "-m", "bench.child", str(tmp_path / "r"), "data.batchsize=3"],
               tmp_path / "r.log")
    assert str(tmp_path / "r.log") in str(err.value)


def test_bad_options_exit_2_before_anything_runs(tmp_path, capsys):
    assert main(["bench", "batch", "--procs", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--procs 0" in capsys.readouterr().err and not (tmp_path / "o").exists()
    with pytest.raises(SystemExit) as exit_:  # argparse's exit: status 2 (`python -m hpctrain`: test_bad_inputs.py)
        main(["bench", "nosuch"])
    assert exit_.value.code == 2 and "invalid choice: 'nosuch'" in capsys.readouterr().err


def test_default_rank_counts(tmp_path):
    """What scaling and strategies pick without --procs: one rank per GPU; on a CPU scaling
    goes up to the cores (2..8), strategies runs on 2..4 ranks."""
    ctx = Context(quick=True, work=tmp_path)
    cores = cpus()  # the CPUs this process may run on
    if torch.cuda.is_available():
        assert max_procs(ctx) == torch.cuda.device_count()
    else:
        assert max_procs(ctx) == max(2, min(cores, 8)) and world(ctx) == max(2, min(cores, 4))
    assert max_procs(Context(quick=True, work=tmp_path, procs=1)) == 1


# ---------------------------------------------------------------- the cases live outside the package


def test_the_cases_are_found_in_a_source_checkout_and_are_no_part_of_the_wheel(monkeypatch):
    """The checkout's benchmarks/bench/ (beside an editable install, by default), or the checkout
    or its benchmarks/ named by --from or HPCTRAIN_BENCH_DIR; the wheel packs hpctrain* only."""
    tomllib = pytest.importorskip("tomllib")
    from setuptools import find_packages

    monkeypatch.delenv(BENCH_DIR_ENV, raising=False)
    assert find_bench_dir() == find_bench_dir(str(ROOT)) == find_bench_dir(str(ROOT / "benchmarks")) \
        == ROOT / "benchmarks"
    monkeypatch.setenv(BENCH_DIR_ENV, str(ROOT))
    assert find_bench_dir() == ROOT / "benchmarks"
    assert child.__file__ == str(ROOT / "benchmarks" / "bench" / "child.py")
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = find_packages(str(ROOT), include=include)
    assert "hpctrain.cli" in shipped and not [p for p in shipped if p.split(".")[0] != "hpctrain" or "bench" in p]


def test_without_a_source_checkout_bench_exits_2_with_a_one_line_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(BENCH_DIR_ENV, raising=False)
    monkeypatch.setattr(bench_command, "_BESIDE_PACKAGE", tmp_path / "site-packages" / "benchmarks")  # a wheel
    assert main(["bench", "batch", "--quick", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        "hpctrain bench: error: hpctrain bench needs a source checkout (this hpctrain is installed without its "
        "source checkout); hint: git clone the repository and pip install -e . there, or pass --from CHECKOUT "
        f"(or set {BENCH_DIR_ENV}=CHECKOUT)\n")
    assert not (tmp_path / "o").exists()
    for args, env in (((["--from", str(tmp_path)]), None), ([], str(tmp_path))):
        if env:
            monkeypatch.setenv(BENCH_DIR_ENV, env)
        assert main(["bench", "batch", "--quick", "--out", str(tmp_path / "o"), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"({tmp_path} holds no bench/ package)" in err
