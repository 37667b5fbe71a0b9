"""LoRA benchmark (issue 38, point 2): checkpoint bytes and save time, full fine-tuning against
LoRA (PEFT) on the same Llama-shaped base, and the one-process LoRA step of ``hpctrain train``
against the same PEFT model in a plain PyTorch loop (same batch, same threads), each
configuration in a fresh process (OpenMP reads its settings when torch loads).

    python benchmarks/lora.py [--hidden 256] [--layers 4] [--vocab 2048] [--steps 30] [--json out.json]

Step-time configurations: ``threads=1``; ``threads=cores`` (hpctrain's default at one process:
cores / local ranks); and ``threads=cores`` with ``OMP_WAIT_POLICY=PASSIVE``. On a machine whose
cores other processes also use, torch's OpenMP threads spin at the end of every op waiting for
a descheduled sibling: that, not LoRA or hpctrain, is what makes a one-process step slow there
(issue 38's 1.0-1.9 s against 0.07-0.12 s per rank at 2 ranks, each rank one thread).
Needs the test extras (transformers, peft).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASE_ENV = "HPCTRAIN_BENCH_LORA_BASE"
SEQ, BATCH = 64, 4


def full_model() -> Any:
    """The base, every parameter trained (full fine-tuning)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.environ[BASE_ENV])


def lora_model() -> Any:
    """The base frozen, LoRA rank 8 on the attention projections (PEFT)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        task_type="CAUSAL_LM")
    return get_peft_model(full_model(), config)


def _base(path: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4,
                                 num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                 max_position_embeddings=SEQ * 2)).save_pretrained(path)


def _corpus(path: Path) -> None:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(400)]
    path.mkdir()
    for split, count in (("train", 400), ("val", 16)):
        (path / f"{split}.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=80))}) + "\n"
                                                     for _ in range(count)))


def _keys(name: str, corpus: Path, run: Path, steps: int, threads: int) -> list[str]:
    return [f"model.name=benchmarks.lora:{name}", "train.task=causal_lm", f"data.name=jsonl:{corpus}",
            f"model.seq_len={SEQ}", f"data.batch_size={BATCH}", "data.max_val_samples=16", "optim.name=adamw",
            "optim.lr=1e-4", f"train.max_steps={steps}", f"checkpoint.every_steps={max(1, steps // 3)}",
            "checkpoint.every_seconds=None", "train.progress=false", f"train.threads={threads}", f"run.dir={run}",
            "checkpoint.keep_last=10"]


def one_hpctrain(name: str, corpus: Path, run: Path, steps: int, threads: int) -> dict[str, Any]:
    """``hpctrain train`` in this process: per-step time, and its checkpoints' bytes and save times."""
    from hpctrain.checkpoint import layout
    from hpctrain.config import load_config
    from hpctrain.train import train

    summary = train(load_config(None, _keys(name, corpus, run, steps, threads)))
    manifests = [layout.read_manifest(p) for _, p in layout.committed(run / "checkpoints")]
    step_s = sum(summary[k] for k in ("time_data_s", "time_fwd_bwd_s", "time_optim_s", "time_other_s"))
    return {"step_s": step_s, "checkpoint_bytes": statistics.median(sum(f["size"] for f in m["files"].values())
                                                                    for m in manifests),
            "save_s": statistics.median(m["save_s"] for m in manifests), "checkpoints": len(manifests),
            "model_pt_bytes": (run / "model.pt").stat().st_size}


def one_plain(steps: int, threads: int, vocab: int) -> dict[str, Any]:
    """The same PEFT model in a plain loop: forward with labels, backward, AdamW on the trained parameters."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = lora_model().train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(0, vocab, (BATCH, SEQ))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[3:])}


def _child(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--one", nargs=4, metavar=("WHAT", "THREADS", "CORPUS", "RUN"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        what, threads, corpus, run = args.one
        result = one_plain(args.steps, int(threads), args.vocab) if what == "plain" else \
            one_hpctrain(what, Path(corpus), Path(run), args.steps, int(threads))
        print(json.dumps(result))
        return
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-lora-") as tmp:
        root = Path(tmp)
        _base(root / "base", args.hidden, args.layers, args.vocab)
        _corpus(root / "corpus")
        env = {**os.environ, BASE_ENV: str(root / "base"), "PYTHONPATH": f"{ROOT}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}"}
        env.pop("OMP_NUM_THREADS", None)
        results: dict[str, Any] = {"shape": vars(args) | {"cores": cores, "seq": SEQ, "batch": BATCH},
                                   "loadavg_start": os.getloadavg()[0]}
        for name in ("full_model", "lora_model"):  # checkpoints: one thread, so the save times compare
            results[name] = _child(["--one", name, "1", str(root / "corpus"), str(root / name),
                                    "--steps", str(args.steps), "--vocab", str(args.vocab)], env)
        for label, threads, extra in (("threads=1", 1, {}), (f"threads={cores}", cores, {}),
                                      (f"threads={cores} OMP_WAIT_POLICY=PASSIVE", cores,
                                       {"OMP_WAIT_POLICY": "PASSIVE"})):
            row = {}
            for what in ("lora_model", "plain"):
                run = root / f"step-{what}-{threads}-{len(extra)}"
                row[what] = _child(["--one", what, str(threads), str(root / "corpus"), str(run),
                                    "--steps", str(args.steps), "--vocab", str(args.vocab)], {**env, **extra})["step_s"]
            results[f"step_s {label}"] = {"hpctrain": row["lora_model"], "plain_loop": row["plain"]}
        results["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # model.name=benchmarks.lora:... from the checkout
    main()
