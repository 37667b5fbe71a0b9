"""A property test of `hpctrain estimate` (issue 39 point 5, issue 42 point 4): random and
adversarial config.json files and flag values (zeros, negatives, huge, NaN, inf, strings for
numbers, missing keys, deep nesting) fed to the CLI in-process. Every case ends in exit 0 with
finite figures only, or exit 2 with one line; never a traceback, never 'inf' or 'nan' in a result.
A seeded loop (hypothesis' pytest plugin is off in this suite): the same cases every run."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

from hpctrain.cli import main

CONFIGS = sorted((Path(__file__).parent / "hf_configs").glob("*.json"))
NON_FINITE = re.compile(r"\b(nan|inf|infinity)\b|infT|-?inf[A-Z]", re.IGNORECASE)
TRIALS = 120

# values a key or a flag may get: the right kind, and every wrong kind
INTS = [0, -1, 1, 2, 3, 8, 64, 4096, 2 ** 31, 2 ** 40, 2 ** 40 + 1, 10 ** 30]
WRONG = [None, True, False, "32", "false", "", 1.5, -0.0, float("nan"), float("inf"), [], {}, [1], {"a": 1}]
COUNTS = ["7B", "7.5e9", "125M", "1.4T", "0", "1", "0.5", "-7B", "1e400", "1e30", "nan", "inf", "abc", "7B7", "",
          "9" * 400, "1_000", "1,000"]
FLOATS = ["0", "-1", "0.4", "1", "2", "1e-300", "1e300", "nan", "inf", "-inf", "abc", "1e400"]
INT_FLAGS = ["--gpus", "--tp", "--pp", "--ep", "--cp", "--micro-batch", "--grad-accum", "--microbatches",
             "--dp-replicate", "--layers", "--hidden", "--heads", "--seq-len", "--vocab", "--kv-heads", "--ffn-hidden",
             "--experts", "--top-k", "--head-dim"]
FLOAT_FLAGS = ["--gpu-memory-gb", "--peak-tflops", "--mfu", "--hfu", "--achieved-tflops", "--mtbf-hours",
               "--ckpt-bandwidth"]
INT_TEXT = ["0", "-1", "1", "2", "4", "8", "7", "64", "1024", "16384", "1048576", "99999999999999", "1.5", "x"]


def _value(rng: random.Random) -> object:
    return rng.choice(INTS) if rng.random() < 0.5 else rng.choice(WRONG)


def _config(rng: random.Random, tmp: Path, trial: int) -> str:
    """A published config with a few keys changed, removed or nested away, or no object at all."""
    config = json.loads(rng.choice(CONFIGS).read_text())
    for _ in range(rng.randint(0, 3)):
        key = rng.choice(list(config))
        roll = rng.random()
        if roll < 0.2:
            del config[key]
        elif roll < 0.3:
            config[key] = {"a": [[[[1]]]]}
        else:
            config[key] = _value(rng)
    text = json.dumps(config)  # NaN and Infinity as Python's json writes (and reads) them
    roll = rng.random()
    if roll < 0.03:
        text = "[" * 50_000 + "]" * 50_000
    elif roll < 0.06:
        text = text[: rng.randint(0, len(text))]
    path = tmp / f"config-{trial}.json"
    path.write_text(text)
    return str(path)


def _argv(rng: random.Random, tmp: Path, trial: int) -> list[str]:
    roll = rng.random()
    argv = ["--params", rng.choice(COUNTS)] if roll < 0.3 else ["--hf-config", _config(rng, tmp, trial)] \
        if roll < 0.7 else ["--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000", "--seq-len", "128"]
    for _ in range(rng.randint(0, 4)):
        if rng.random() < 0.6:
            flag, value = rng.choice(INT_FLAGS), rng.choice(INT_TEXT)
        else:
            flag, value = rng.choice(FLOAT_FLAGS), rng.choice(FLOATS)
        argv.append(f"{flag}={value}")
    if rng.random() < 0.4:
        argv.append(f"--tokens={rng.choice(COUNTS)}")
    if rng.random() < 0.3:
        argv.append("--json")
    return argv


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(["estimate", *argv])
    except SystemExit as stop:
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_random_and_adversarial_inputs_end_in_a_finite_answer_or_one_line(tmp_path, capsys):
    rng = random.Random(42)
    outcomes = {0: 0, 2: 0}
    start = time.monotonic()
    for trial in range(TRIALS):
        argv = _argv(rng, tmp_path, trial)
        code, out, err = _run(capsys, argv)
        case = f"trial {trial}: hpctrain estimate {' '.join(argv)}\nexit {code}\n{err[-2000:]}"
        assert code in (0, 2), case
        assert "Traceback" not in err and "internal error" not in err, case
        if code == 0:
            assert not NON_FINITE.search(out), case + out
            if "--json" in argv:  # NaN and Infinity are what json writes for non-finite floats
                assert not re.search(r"\b(NaN|-?Infinity)\b", out), case + out
                json.loads(out)
        else:
            assert out == "" and err.count("\n") == 1 and err.startswith("hpctrain estimate: error: "), case
            assert len(err) < 1000, case
        outcomes[code] += 1
    assert outcomes[0] >= 10 and outcomes[2] >= 50, outcomes  # both kinds of answer were exercised
    assert time.monotonic() - start < 30
