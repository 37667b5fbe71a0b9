"""The fault suite's fast part (issue 17, point 7): a fixed-seed subset of the shard fuzz.

``benchmarks/faults.py`` runs every fault probe of issue 17 for many trials (``shard_fuzz``: 200
mutations by default, the issue's run had 1,000); the probes' other fast versions live where
their code is tested (docs/benchmarks.md, "Faults (issue 17)", names them). Here the same
mutations as the benchmark's first ones, in this process: random bytes of one training shard
replaced by other random bytes, then ``hpctrain data verify`` must exit 1 naming the shard and
``hpctrain train`` must exit 1 or 2 naming it, never with a traceback. Bytes outside every
sample (the tar's two end-of-archive blocks, ~2% of a shard) are read by no one but ``verify``:
there training must end as on the intact shards, bit for bit.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from tests.test_bad_inputs import _as_a_fresh_process, _main, _write_tiny_shards

TRACEBACK = "Traceback (most recent call last)"
FUZZ_SAMPLES = 48  # per split, 16 to a shard: three training shards
FUZZ_TRAIN = ["data.name=shards", "model.name=tests.user_models:tiny_mlp", "data.stage_dir=off", "data.batch_size=16",
              "train.epochs=1", "train.progress=false", "train.threads=1", "checkpoint.enabled=false"]
# The suite's mutations, about 0.3 s each; case 94 hits only the end-of-archive blocks (found by
# benchmarks/faults.py's first full run, where training rightly ended 0).
SUBSET = [*range(12), 94]


@dataclass(frozen=True)
class FuzzResult:
    """One mutation: what changed, and how each command ended."""

    case: int
    shard: str
    mutation: str
    in_samples: bool  # a byte of some sample changed (else only the end-of-archive blocks)
    verify_code: int
    verify_err: str
    train_code: int
    train_err: str
    params: str | None  # the trained run's params_sha256, when it finished

    def problems(self, intact_params: str) -> list[str]:
        """What breaks the fuzz's promise (empty: held); ``intact_params``: training on the intact shards."""
        found = []
        if self.verify_code != 1:
            found.append(f"data verify exit {self.verify_code}, not 1")
        if self.shard not in self.verify_err:
            found.append(f"data verify does not name {self.shard}")
        if not self.in_samples:
            if self.train_code != 0 or self.params != intact_params:
                found.append(f"train exit {self.train_code} (params {self.params}) after a change outside every "
                             "sample: not as on the intact shards")
            return found
        if self.train_code not in (1, 2):
            found.append(f"train exit {self.train_code}, not 1 or 2")
        if self.shard not in self.train_err:
            found.append(f"train does not name {self.shard}")
        return found

    @property
    def traceback(self) -> bool:
        return TRACEBACK in self.verify_err or TRACEBACK in self.train_err


def make_fuzz_shards(root: Path) -> Path:
    """Train and val shards of 128-float samples (tests/test_bad_inputs.py's), 16 to a shard."""
    root.parent.mkdir(parents=True, exist_ok=True)  # the arrays are written next to ``root`` first
    for split in ("train", "val"):
        _write_tiny_shards(root, split, FUZZ_SAMPLES)
    return root


def mutate(path: Path, rng: random.Random) -> list[int]:
    """Set 1 to 8 random bytes of ``path`` to other random values; returns the offsets changed."""
    data = bytearray(path.read_bytes())
    offsets = sorted(rng.sample(range(len(data)), rng.randint(1, 8)))
    for offset in offsets:
        data[offset] = (data[offset] + rng.randint(1, 255)) % 256  # never the same value
    path.write_bytes(bytes(data))
    return offsets


def in_a_sample(shard: Path, offsets: list[int]) -> bool:
    """Does any offset fall in a sample's bytes (its tar headers included), by the shard's index?"""
    index = json.loads(shard.with_suffix(".idx.json").read_text())
    return any(start <= off < end for off in offsets for start, end in zip(index["start"], index["end"]))


def _hpctrain(argv: list[str]) -> tuple[int, str]:
    """``hpctrain ARGV`` in this process as in a fresh one: exit code, stdout + stderr."""
    out = io.StringIO()
    with _as_a_fresh_process(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = _main(argv)
    return code, out.getvalue()


def train_on(shards: Path, run_dir: Path) -> tuple[int, str, str | None]:
    """``hpctrain train`` on ``shards`` in this process: exit code, output, params_sha256 (or None)."""
    try:
        code, out = _hpctrain(["train", *FUZZ_TRAIN, f"data.path={shards}", f"run.dir={run_dir}"])
        summary = run_dir / "summary.json"
        return code, out, json.loads(summary.read_text())["params_sha256"] if summary.is_file() else None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def fuzz_case(shards: Path, case: int, seed: int, work: Path) -> FuzzResult:
    """Mutation ``case`` of the fuzz ``seed`` (the same bytes every time) on a training shard of
    ``shards``; verify and train on it; the shard is put back afterwards."""
    rng = random.Random(f"{seed}:{case}")
    shard = rng.choice(sorted(shards.glob("train-*.tar")))
    pristine = shard.read_bytes()
    try:
        offsets = mutate(shard, rng)
        verify_code, verify_err = _hpctrain(["data", "verify", str(shards)])
        train_code, train_err, params = train_on(shards, work / f"fuzz-run-{case}")
    finally:
        shard.write_bytes(pristine)
    return FuzzResult(case, shard.name, "bytes " + ",".join(map(str, offsets)), in_a_sample(shard, offsets),
                      verify_code, verify_err, train_code, train_err, params)


def test_shard_fuzz_fixed_seed_subset(tmp_path: Path) -> None:
    shards = make_fuzz_shards(tmp_path / "shards")
    assert _hpctrain(["data", "verify", str(shards)])[0] == 0  # intact before the first mutation
    code, out, intact_params = train_on(shards, tmp_path / "intact")
    assert code == 0 and intact_params, out[-2000:]
    results = [fuzz_case(shards, case, 0, tmp_path) for case in SUBSET]
    for r in results:
        assert not r.traceback, (r.mutation, r.verify_err, r.train_err)
        assert not r.problems(intact_params), (r.shard, r.mutation, r.problems(intact_params), r.train_err[-2000:])
    assert [r.in_samples for r in results] == [True] * 12 + [False]  # both kinds of change are tried
    assert _hpctrain(["data", "verify", str(shards)])[0] == 0  # every shard put back
