"""``bash scripts/gpu_check.sh --rehearse``: the prepared GPU run, checked on this CPU so the device's
minutes are never spent on a missing wheel or file (docs/benchmarks.md, "One prepared GPU run").

The carried folder is filled once per cache (``$HPCTRAIN_CACHE/gpu-carry``, by scripts/gpu_carry.sh,
which downloads the pinned wheels from PyPI: about 5 MB) and refilled when the script's pins change;
without a registry to download from, the rehearsal is skipped, saying so. Then one rehearsal
(a subprocess: the script's exit code and its clean venv are what is checked) installs every carried
wheel offline beside this torch and for the device's Python 3.12, imports torchtitan's entry with only
the device image's and the carried packages visible, starts every row at a tiny shape, and writes the
JSON and the table. The other tests here are in-process and take milliseconds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.core.cache import cache_root

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_data  # noqa: E402
import gpu_run  # noqa: E402
import gpu_titan  # noqa: E402


def _pins() -> list[str]:
    text = (ROOT / "scripts" / "gpu_carry.sh").read_text()
    block = re.search(r"PINNED=\((.*?)\)", text, re.S)
    assert block, "scripts/gpu_carry.sh has no PINNED=(...) list"
    return block.group(1).split()


@pytest.fixture(scope="module")
def carry() -> Path:
    folder = cache_root() / "gpu-carry"
    pinned = folder / "wheels" / "carried.txt"
    if not (folder / "MANIFEST.json").is_file() or not pinned.is_file() or pinned.read_text().split() != _pins():
        done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_carry.sh"), str(folder)], capture_output=True,
                              text=True, timeout=600, check=False)
        if done.returncode != 0:
            pytest.skip(f"scripts/gpu_carry.sh could not fill {folder} (no package registry?): {done.stderr[-500:]}")
    return folder


@pytest.fixture(scope="module")
def rehearsal(carry: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("rehearse")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--rehearse", "--carry", str(carry),
                           "--out", str(out)], capture_output=True, text=True, timeout=600, check=False)
    return done, out


@pytest.mark.slow  # a clean venv, two offline installs, torchtitan's import and seven tiny rows: ~30 s of CPU
def test_the_rehearsal_installs_every_wheel_starts_every_row_and_writes_json_and_table(rehearsal, carry):
    done, out = rehearsal
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"installed offline here and for the device's Python 3.12 ({len(_pins())} packages)" in done.stdout
    doc = json.loads((out / "gpu_run.json").read_text())
    rows = doc["rows"]
    assert set(rows) == set(gpu_run.ROWS)
    assert {name: r["status"] for name, r in rows.items()} == {
        "hpctrain_bf16": "ran", "hpctrain_fp8": "checked", "memory": "ran", "big_ac": "ran", "checkpoint": "ran",
        "loader": "ran", "torchtitan_bf16": "checked"}
    titan = rows["torchtitan_bf16"]
    assert titan["torchtitan"] == "0.2.2" and titan["params"] == gpu_run.TINY.shape.params
    assert titan["activation_checkpoint"] == "none" and titan["steps"] == gpu_run.TINY.steps.total
    assert rows["hpctrain_fp8"]["float8_linears"] > 0
    assert len(rows["memory"]["points"]) == 2 * len(gpu_run.TINY.memory)
    assert all(p["declared"]["params_bytes"] == p["measured"]["params_bytes"] for p in rows["memory"]["points"])
    assert rows["hpctrain_bf16"]["tokens_per_s"] > 0 and 0 <= rows["hpctrain_bf16"]["data_wait_share"] < 1
    assert doc["goals"] == dict.fromkeys(doc["goals"])  # unmeasured without a GPU: None, never a guess
    assert doc["carry_manifest"]["tokens.npy"]["sha256"] == gpu_data.sha256(carry / "tokens.npy")
    table = (out / "gpu_run.md").read_text().splitlines()
    assert sum(line.startswith("| ") for line in table) == 1 + len(gpu_run.ROWS)  # header + one line per row
    printed = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert printed == [line for line in table if line.startswith("| ")]  # printed as it went


def test_a_missing_carry_file_exits_2_naming_it_and_the_fix(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "carried.txt").write_text("torchtitan==0.2.2\n")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--rehearse", "--carry", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"gpu_check.sh: error: {tmp_path}/tokens.npy is missing; "
                                   f"hint: bash scripts/gpu_carry.sh {tmp_path}")


def test_refit_recovers_the_factor_and_checks_other_points():
    def point(ac: str, declared: int, alloc: int | None, hooks: int) -> dict:
        return {"ac": ac, "declared": {"activations_bytes": declared}, "activations_alloc": alloc,
                "measured": {"activations_bytes": hooks}}

    gpu = [point("none", 100, 114, 0), point("none", 200, 228, 0), point("block", 50, 60, 0)]
    cpu = [point("none", 10, None, 12)]  # no allocator figure on a CPU: the saved-tensor count stands in
    fit = gpu_run.refit(gpu, cpu)
    assert fit["none"]["k"] == pytest.approx(1.14) and fit["none"]["worst_rel_error"] == pytest.approx(0, abs=1e-12)
    assert fit["block"]["k"] == pytest.approx(1.2) and fit["block"]["check_rel_errors"] == []
    assert fit["none"]["check_rel_errors"] == [pytest.approx(1.14 * 10 / 12 - 1)]


def test_the_stream_is_fixed_and_mostly_a_function_of_the_current_token():
    a, b = gpu_data.make_stream(50_000), gpu_data.make_stream(50_000)
    assert (a == b).all() and a.dtype.name == "uint32" and int(a.max()) < gpu_data.VOCAB
    successor = {}
    rng_cycle = __import__("numpy").random.default_rng(gpu_data.SEED).permutation(gpu_data.VOCAB)
    successor = dict(zip(rng_cycle.tolist(), rng_cycle[1:].tolist() + rng_cycle[:1].tolist(), strict=True))
    follows = sum(successor[int(x)] == int(y) for x, y in zip(a[:-1], a[1:], strict=True)) / (len(a) - 1)
    assert 0.88 < follows < 0.92  # a tenth of the positions jump


def test_torchtitan_ffn_arguments_give_the_exact_width():
    for hidden, ffn in ((2048, 8192), (3072, 8192), (64, 256), (1024, 4096)):
        multiplier, multiple_of = gpu_titan.ffn_args(hidden, ffn)
        assert multiple_of * -(-int(multiplier * int(8 * hidden / 3)) // multiple_of) == ffn


def test_hidden_distributions_are_not_found_by_import_nor_by_probe():
    import importlib.util

    finder = gpu_titan.HiddenDistributions({"torch"})
    # any hidden module this process has not imported yet (the worker's earlier tests imported some)
    name = next(n for n in ("tabulate", "tomli_w", "xxhash", "pygments", *sorted(finder.hidden))
                if n in finder.hidden and n not in sys.modules and n.isidentifier()
                and importlib.util.find_spec(n) is not None)
    finder.install()
    try:
        assert importlib.util.find_spec(name) is None
        with pytest.raises(ModuleNotFoundError):
            __import__(name)
    finally:
        finder.uninstall()
    assert importlib.util.find_spec(name) is not None and finder.refused == {name}
