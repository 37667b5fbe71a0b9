"""Data pipeline benchmark (issues 3 and 8): one file per sample vs tar shards, hpctrain vs
webdataset, litdata and Mosaic streaming.

    python benchmarks/data.py --samples 20000 --workers 0,1,2 --json bench-data.json --plot docs/data-bench.png

Reads the same 32x32 RGB images, as float batches of 64, from
  * ``folder``         one PNG file per sample (class subfolders), DataLoader over a file Dataset;
  * ``shards-png``     hpctrain shards holding the same PNG bytes, read by ShardedLoader (its
                       default decoder: libspng via ``pyspng`` when installed, else PIL);
  * ``shards-png-pil`` the same, decoding with PIL like every other PNG reader here;
  * ``shards-npy``     hpctrain shards holding raw uint8 .npy arrays, read by ShardedLoader;
  * ``wds-png``        the same PNG shards read by ``webdataset.WebDataset`` (its own tar reader);
  * ``litdata-png``    ``litdata.optimize`` chunks holding the same PNG bytes, ``litdata.StreamingDataset``
                       + ``StreamingDataLoader``, PIL decode;
  * ``mds-png``        Mosaic ``streaming.MDSWriter`` shards holding the same PNG bytes (a ``bytes``
                       column), ``streaming.StreamingDataset`` (local, shuffled), PIL decode;
  * ``shards-png-dali`` the same PNG shards through ``data.decoder=dali`` (DaliShardedLoader, DALI's CPU
                       backend here; skipped where ``nvidia.dali`` does not import);
with the page cache cold and warm, and with 0/1/2 DataLoader workers. Cold means
every file was evicted with ``posix_fadvise(DONTNEED)`` first (``/proc/sys/vm/drop_caches``
when writable); the kernel's dentry/inode caches stay warm either way, so the folder's
metadata cost is, if anything, understated. Optionally (``--train-steps N``) it also trains
the default MNIST job from shards and reports the trainer's data-wait share.

``--decode-only`` measures the decoders alone on the same bytes, batch by batch (issue 41): pyspng,
PIL and DALI's CPU pipeline (1 and 2 threads) decoding the same batches of 64 PNGs (and checking
they give the same pixels), at each ``--decode-sizes`` side:

    python benchmarks/data.py --decode-only --decode-sizes 32,224 --json bench-decode.json
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pagecache import evict  # noqa: E402 - benchmarks/ is on sys.path when run as a script

import hpctrain.data.decode as shard_decode  # noqa: E402
from hpctrain.core.env import ClusterEnv  # noqa: E402
from hpctrain.data.loader import ShardedLoader  # noqa: E402
from hpctrain.data.pack import npy_bytes  # noqa: E402
from hpctrain.data.writer import write_shards  # noqa: E402

BATCH = 64


# ---------------------------------------------------------------- data sets


def images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-like uint8 images: smooth class patterns plus noise (PNG compresses them ~like photos)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    yy, xx = np.mgrid[0:32, 0:32]
    base = np.stack([np.sin((xx * (c + 1) + yy * (3 - c % 3)) / 6.0) for c in range(10)])
    out = np.empty((n, 32, 32, 3), np.uint8)
    for i in range(n):
        pattern = base[labels[i]][..., None] * np.array([60, 40, 80]) + 128
        out[i] = np.clip(pattern + rng.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8)
    return out, labels


def png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def build(root: Path, n: int, per_shard: int, peers: Iterable[str] | None = None) -> dict[str, Path]:
    peers = OTHERS if peers is None else tuple(peers)  # the peers to build for (all by default)
    x, y = images(n)
    encoded = [png(img) for img in x]
    folder = root / "folder"
    for c in range(10):
        (folder / str(c)).mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(encoded):
        (folder / str(y[i]) / f"{i:06d}.png").write_bytes(data)
    meta = {"source": "bench", "classes": [str(c) for c in range(10)],
            "decode": {"input": "png", "target": "cls", "scale": 255.0, "mean": None, "std": None}}
    write_shards(((f"s{i:06d}", {"cls": str(y[i]).encode(), "png": encoded[i]}) for i in range(n)),
                 root / "shards-png", "train", samples_per_shard=per_shard, meta=meta)
    meta_npy = {**meta, "decode": {**meta["decode"], "input": "npy", "layout": "hwc"}}  # same tensors as PNG
    write_shards(((f"s{i:06d}", {"cls": str(y[i]).encode(), "npy": npy_bytes(x[i])}) for i in range(n)),
                 root / "shards-npy", "train", samples_per_shard=per_shard, meta=meta_npy)
    paths = {"folder": folder, "shards-png": root / "shards-png", "shards-npy": root / "shards-npy"}
    per_shard_bytes = per_shard * int(np.mean([len(e) for e in encoded[:1000]]))  # shards of the same size
    if "litdata-png" in peers:
        paths["litdata-png"] = build_litdata(root / "litdata-png", encoded, y, per_shard_bytes)
    if "mds-png" in peers:
        paths["mds-png"] = build_mds(root / "mds-png", encoded, y, per_shard_bytes)
    return paths


def _lit_item(item: tuple[bytes, int]) -> dict:
    return {"png": item[0], "cls": item[1]}


def build_litdata(out: Path, encoded: list[bytes], y: np.ndarray, chunk_bytes: int) -> Path:
    from litdata import StreamingDataset as LitDataset
    from litdata import optimize

    optimize(fn=_lit_item, inputs=[(data, int(label)) for data, label in zip(encoded, y)], output_dir=str(out),
             chunk_bytes=chunk_bytes, num_workers=1, mode="overwrite")
    # optimize() forces the "spawn" start method process-wide; every reader here (as the
    # DataLoader's Linux default) forks its workers
    multiprocessing.set_start_method("fork", force=True)
    assert bytes(LitDataset(str(out))[0]["png"]) == encoded[0], "litdata does not give back the stored bytes"
    return out


def build_mds(out: Path, encoded: list[bytes], y: np.ndarray, size_limit: int) -> Path:
    mds = _streaming()
    shutil.rmtree(out, ignore_errors=True)  # MDSWriter refuses a non-empty directory
    with mds.MDSWriter(out=str(out), columns={"png": "bytes", "cls": "int"}, size_limit=size_limit) as sink:
        for data, label in zip(encoded, y):
            sink.write({"png": data, "cls": int(label)})
    return out


def _streaming() -> Any:
    """``import streaming`` without its vision datasets: their torchvision has no build for this
    CPU-only torch here, and MDS reading needs none of it."""
    import types

    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


# ---------------------------------------------------------------- readers


class FolderDataset(Dataset):
    """The usual one-file-per-sample ImageFolder path: open, read, decode per sample."""

    def __init__(self, root: Path) -> None:
        self.files = sorted((int(p.parent.name), p) for p in root.glob("*/*.png"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        label, path = self.files[i]
        with Image.open(path) as img:
            arr = np.array(img.convert("RGB"))
        return torch.from_numpy(arr).permute(2, 0, 1).float().div_(255.0), label


def folder_batches(root: Path, workers: int) -> Iterable:
    kwargs = {"prefetch_factor": 4} if workers else {}
    return DataLoader(FolderDataset(root), batch_size=BATCH, shuffle=True, num_workers=workers, **kwargs)


def shard_batches(root: Path, workers: int) -> Iterable:
    shard_decode._SPNG = None  # the default: libspng when importable (workers fork with this setting)
    return ShardedLoader(root, ClusterEnv(), BATCH, drop_last=False, num_workers=workers,
                         prefetch_factor=4, persistent_workers=False)


def shard_batches_pil(root: Path, workers: int) -> Iterable:
    shard_decode._SPNG = False  # PIL only, like the folder, webdataset, litdata and streaming rows
    return ShardedLoader(root, ClusterEnv(), BATCH, drop_last=False, num_workers=workers,
                         prefetch_factor=4, persistent_workers=False)


def _pil_rgb(data: Any) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def dali_batches(root: Path, workers: int) -> Iterable:
    from hpctrain.data.dali import DaliShardedLoader

    return DaliShardedLoader(root, ClusterEnv(), BATCH, drop_last=False, num_workers=workers, backend="cpu",
                             prefetch_factor=4, persistent_workers=False)


def litdata_batches(root: Path, workers: int) -> Iterable:
    from litdata import StreamingDataLoader
    from litdata import StreamingDataset as LitDataset

    class Decoded(LitDataset):
        def __getitem__(self, index: Any) -> tuple[torch.Tensor, int]:
            sample = super().__getitem__(index)
            return (torch.from_numpy(_pil_rgb(sample["png"])).permute(2, 0, 1).float().div_(255.0),
                    int(sample["cls"]))

    kwargs = {"prefetch_factor": 4} if workers else {}
    return StreamingDataLoader(Decoded(str(root), shuffle=True), batch_size=BATCH, num_workers=workers, **kwargs)


def mds_batches(root: Path, workers: int) -> Iterable:
    mds = _streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()  # a new StreamingDataset per run in one process

    class Decoded(mds.StreamingDataset):
        def __getitem__(self, index: Any) -> tuple[torch.Tensor, int]:
            sample = super().__getitem__(index)
            return (torch.from_numpy(_pil_rgb(sample["png"])).permute(2, 0, 1).float().div_(255.0),
                    int(sample["cls"]))

    kwargs = {"prefetch_factor": 4} if workers else {}
    return DataLoader(Decoded(local=str(root), shuffle=True, batch_size=BATCH), batch_size=BATCH,
                      num_workers=workers, **kwargs)


def _wds_to_tensor(sample: tuple) -> tuple:
    x, y = sample  # webdataset's default collation stacks numpy arrays
    return torch.as_tensor(x).permute(0, 3, 1, 2).float().div_(255.0), torch.as_tensor(y)


def wds_batches(root: Path, workers: int) -> Iterable:
    import webdataset as wds

    urls = [str(p) for p in sorted(root.glob("train-*.tar"))]
    ds = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False).shuffle(1000).decode("rgb8")
          .to_tuple("png", "cls").batched(BATCH).map(_wds_to_tensor))
    kwargs = {"prefetch_factor": 4} if workers else {}
    return DataLoader(ds, batch_size=None, num_workers=workers, **kwargs)


READERS: dict[str, tuple[str, Callable[[Path, int], Iterable]]] = {
    "folder": ("folder", folder_batches),
    "shards-png": ("shards-png", shard_batches),
    "shards-png-pil": ("shards-png", shard_batches_pil),
    "shards-npy": ("shards-npy", shard_batches),
    "shards-png-dali": ("shards-png", dali_batches),
    "wds-png": ("shards-png", wds_batches),
    "litdata-png": ("litdata-png", litdata_batches),
    "mds-png": ("mds-png", mds_batches),
}
OTHERS = ("wds-png", "litdata-png", "mds-png")
PEER_MODULES = {"wds-png": "webdataset", "litdata-png": "litdata", "mds-png": "streaming",
                "shards-png-dali": "nvidia.dali"}


def missing_peers(readers: Iterable[str]) -> dict[str, str]:
    """Each asked-for peer whose library does not import here, with why: a fresh venv may lack it,
    or one of its own imports (litdata imports boto3, which its wheel does not require)."""
    missing = {}
    for reader in readers:
        module = PEER_MODULES.get(reader)
        if module is None:
            continue
        try:
            _streaming() if module == "streaming" else __import__(module)
        except Exception as err:  # noqa: BLE001 - any import failure of a peer: report it, run the others
            missing[reader] = f"{type(err).__name__}: {err}"
    return missing


# ---------------------------------------------------------------- cache control and timing


def drop_cache(root: Path) -> str:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            os.sync()
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    evict(root)
    return "posix_fadvise"


def warm_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            path.read_bytes()


def measure(batches: Iterable) -> tuple[float, int]:
    start, count = time.perf_counter(), 0
    for batch in batches:
        if isinstance(batch, dict):
            count += len(batch["cls"])
        elif isinstance(batch, (tuple, list)):
            count += len(batch[1])
        else:  # padding slots of the last step do not count
            count += len(batch) if batch.mask is None else int(batch.mask.sum())
    return count / (time.perf_counter() - start), count


def cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (DataLoader workers, once shut down)."""
    mine, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + kids.ru_utime + kids.ru_stime


def measure_cpu(reader: Callable[[Path, int], Iterable], root: Path, workers: int) -> tuple[float, int, float]:
    """(samples/s, samples, CPU us per sample of all processes): the CPU a reader spends per sample
    moves much less than its wall-clock rate when other jobs share the cores."""
    batches = reader(root, workers)
    start = cpu_seconds()
    rate, count = measure(batches)
    del batches  # its workers were shut down when the pass ended (no persistent workers here)
    return rate, count, 1e6 * (cpu_seconds() - start) / max(count, 1)


def run_matrix(paths: dict[str, Path], workers: list[int], repeats: int,
               readers: list[str]) -> tuple[list[dict], str]:
    rows, how = [], ""
    for name in readers:
        data, reader = READERS[name]
        root = paths[data]
        for cache in ("cold", "warm"):
            for w in workers:
                best, cpu = 0.0, float("inf")
                for _ in range(repeats):
                    if cache == "cold":
                        how = drop_cache(root)
                    else:
                        warm_cache(root)
                    rate, count, us = measure_cpu(reader, root, w)
                    best, cpu = max(best, rate), min(cpu, us)
                rows.append({"reader": name, "cache": cache, "workers": w, "samples_per_s": best, "samples": count,
                             "cpu_us_per_sample": cpu})
                print(f"{name:<14} {cache:<5} workers={w}  {best:8.0f} samples/s  {cpu:6.0f} us CPU/sample "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return rows, how


# ---------------------------------------------------------------- the decoders alone (issue 41)


def textured(n: int, side: int, seed: int = 0) -> np.ndarray:
    """``n`` side x side RGB images like :func:`images` (smooth pattern plus noise), any size."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side] * (32 / side)
    out = np.empty((n, side, side, 3), np.uint8)
    for i in range(n):
        c = i % 10
        pattern = np.sin((xx * (c + 1) + yy * (3 - c % 3)) / 6.0)[..., None] * np.array([60, 40, 80]) + 128
        out[i] = np.clip(pattern + rng.normal(0, 20, (side, side, 3)), 0, 255).astype(np.uint8)
    return out


def _decoders(threads: list[int], gpu: bool = False) -> dict[str, Callable[[list[bytes]], Any]]:
    """Each decoder that imports here: a batch of encoded PNGs -> uint8 pixels (NHWC; DALI's NCHW,
    a CUDA tensor for ``dali-gpu``, turned back for the pixel check, outside the timing)."""
    out: dict[str, Callable[[list[bytes]], Any]] = {"pil": lambda b: np.stack([_pil_rgb(x) for x in b])}
    spng = shard_decode._spng() if shard_decode._SPNG is not False else None
    if spng:
        out["pyspng"] = lambda b: np.stack([spng(x) for x in b])
    try:
        from hpctrain.data.dali import DaliDecoder, Plan
    except ImportError:
        return out
    from hpctrain.data.dali import dali_available

    if dali_available():
        for t in threads:
            dali = DaliDecoder(BATCH, gray=False, backend="cpu", num_threads=t)
            out[f"dali-cpu-{t}t"] = lambda b, d=dali: d([np.frombuffer(x, np.uint8) for x in b], Plan()).numpy()
        if gpu and torch.cuda.is_available():  # "mixed": nvImageCodec on the GPU, the pixels stay there
            dali = DaliDecoder(BATCH, gray=False, backend="gpu", num_threads=max(threads))
            out["dali-gpu"] = lambda b, d=dali: d([np.frombuffer(x, np.uint8) for x in b], Plan())
    return out


def decode_rows(sides: list[int], batches: int, threads: list[int], repeats: int, gpu: bool = False) -> list[dict]:
    """samples/s and CPU us per sample (all threads of this process) of each decoder on the same
    batches of ``BATCH`` PNG bytes; every decoder's pixels checked equal to PIL's."""
    decoders = _decoders(threads, gpu)
    sync = torch.cuda.synchronize if gpu and torch.cuda.is_available() else (lambda: None)
    rows = []
    for side in sides:
        encoded = [png(img) for img in textured(BATCH * batches, side)]
        chunks = [encoded[i : i + BATCH] for i in range(0, len(encoded), BATCH)]
        want = decoders["pil"](chunks[0])
        for name, fn in decoders.items():
            got = fn(chunks[0])  # also the warm-up (DALI builds its pipeline on first use)
            got = got.cpu().numpy() if isinstance(got, torch.Tensor) else got
            same = np.array_equal(got if got.shape == want.shape else got.transpose(0, 2, 3, 1), want)
            best, cpu = 0.0, float("inf")
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), cpu_seconds()
                for chunk in chunks:
                    fn(chunk)
                sync()  # the GPU's queued work counts
                wall, used = time.perf_counter() - t0, cpu_seconds() - c0
                best, cpu = max(best, len(encoded) / wall), min(cpu, 1e6 * used / len(encoded))
            rows.append({"decoder": name, "side": side, "samples_per_s": best, "cpu_us_per_sample": cpu,
                         "same_pixels_as_pil": bool(same), "batch": BATCH, "samples": len(encoded)})
            print(f"decode {name:<12} {side:>4}x{side:<4} {best:9.0f} samples/s  {cpu:7.0f} us CPU/sample  "
                  f"same pixels as PIL: {same}  (load {os.getloadavg()[0]:.1f})", flush=True)
    return rows


# ---------------------------------------------------------------- the training step's data wait


def train_wait(root: Path, steps: int, workers: list[int]) -> list[dict]:
    """``hpctrain train`` on MNIST shards (default job, max_steps) -> data_wait_share per worker count."""
    shards = root / "mnist"
    if not (shards / "train.manifest.json").is_file():
        for split in ("train", "val"):
            subprocess.run([sys.executable, "-m", "hpctrain", "data", "shard", "mnist", str(shards), "--split", split,
                            "--quiet"], check=True)
    out = []
    # the in-memory MNIST loader is the floor: what the step costs when data is free
    for data, w in [("mnist", 0)] + [("shards", w) for w in workers]:
        run_dir = root / f"run-{data}-w{w}"
        cmd = [sys.executable, "-m", "hpctrain", "train", f"data.name={data}", f"data.num_workers={w}",
               f"train.max_steps={steps}", "train.progress=false", "data.max_val_samples=2000",
               "checkpoint.enabled=false", f"run.dir={run_dir}", "run.overwrite=true"]
        cmd += [f"data.path={shards}"] if data == "shards" else []
        subprocess.run(cmd, check=True, capture_output=True)
        summary = json.loads((run_dir / "summary.json").read_text())
        out.append({"data": data, "workers": w, "data_wait_share": summary["data_wait_share"],
                    "samples_per_s": summary["samples_per_s"]})
        print(f"train mnist_cnn, data={data}, workers={w}: data_wait_share {summary['data_wait_share']:.3f}, "
              f"{summary['samples_per_s']:.0f} samples/s", flush=True)
    return out


# ---------------------------------------------------------------- report


def ratios(rows: list[dict]) -> dict[str, float]:
    """Each reader at its best worker count; the headline is PNG shards vs the PNG folder (same
    bytes); "best other" is the best of the peers that ran (the JSON's ``skipped`` says which did not).
    ``..._cpu``: the same like-for-like ratio by CPU per sample (the peers' least over hpctrain's)."""
    def best(reader: str, cache: str) -> float:
        return max(r["samples_per_s"] for r in rows if r["reader"] == reader and r["cache"] == cache)

    def least_cpu(reader: str, cache: str) -> float:  # CPU us per sample at its cheapest worker count
        return min(r["cpu_us_per_sample"] for r in rows if r["reader"] == reader and r["cache"] == cache)
    ran = {r["reader"] for r in rows}
    peers = [r for r in OTHERS if r in ran]
    out = {}
    for c in ("cold", "warm"):
        out |= {f"png_shards_vs_png_folder_{c}": best("shards-png", c) / best("folder", c),
                f"png_shards_pil_vs_png_folder_{c}": best("shards-png-pil", c) / best("folder", c),
                f"npy_shards_vs_png_folder_{c}": best("shards-npy", c) / best("folder", c)}
        if peers:
            others = max(best(r, c) for r in peers)
            out |= {f"vs_best_other_{c}": best("shards-png", c) / others,
                    f"pil_vs_best_other_{c}": best("shards-png-pil", c) / others,
                    f"pil_vs_best_other_{c}_cpu": min(least_cpu(r, c) for r in peers) / least_cpu("shards-png-pil", c)}
        out |= {f"vs_{r}_{c}": best("shards-png", c) / best(r, c) for r in peers}
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, cache in zip(axes, ("cold", "warm")):
        for reader in READERS:
            pts = sorted((r["workers"], r["samples_per_s"]) for r in rows
                         if r["reader"] == reader and r["cache"] == cache)
            if pts:  # a skipped peer has none
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=reader)
        ax.set_title(f"page cache {cache}")
        ax.set_xlabel("DataLoader workers")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("samples / s (32x32 RGB, batch 64)")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--per-shard", type=int, default=1000, help="samples per shard")
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--repeats", type=int, default=1, help="runs per point (the best counts)")
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed at the end)")
    parser.add_argument("--json", help="write the ratios (and all rows) here")
    parser.add_argument("--plot", default="docs/data-bench.png")
    parser.add_argument("--readers", default=",".join(READERS), help="comma-separated subset of the readers")
    parser.add_argument("--train-steps", type=int, default=0, help="also train MNIST from shards this many steps")
    parser.add_argument("--train-workers", default="0,2")
    parser.add_argument("--decode-only", action="store_true", help="only the decoders on the same bytes (issue 41)")
    parser.add_argument("--decode-sizes", default="32,224", help="image sides for --decode-only")
    parser.add_argument("--decode-batches", type=int, default=20, help="batches of 64 per side for --decode-only")
    parser.add_argument("--dali-threads", default="1,2", help="DALI CPU threads for --decode-only")
    parser.add_argument("--dali-gpu", action="store_true", help="--decode-only: also DALI's mixed (GPU) decode")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.decode_only:
        rows = decode_rows([int(s) for s in args.decode_sizes.split(",")], args.decode_batches,
                           [int(t) for t in args.dali_threads.split(",")], args.repeats, args.dali_gpu)
        if args.json:
            Path(args.json).write_text(json.dumps({"cpus": os.cpu_count(), "decode": rows}, indent=1))
        return 0
    workers = [int(w) for w in args.workers.split(",")]
    asked = args.readers.split(",")
    skipped = missing_peers(asked)
    for reader, why in skipped.items():
        print(f"skipped {reader}: {why} (install it to compare; the others run)", flush=True)
    readers = [r for r in asked if r not in skipped]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir or tmp)
        t0 = time.perf_counter()
        paths = build(root, args.samples, args.per_shard, peers=[r for r in OTHERS if r in readers])
        print(f"built {args.samples} samples in {time.perf_counter() - t0:.1f} s under {root}", flush=True)
        rows, how = run_matrix(paths, workers, args.repeats, readers)
        train_workers = [int(w) for w in args.train_workers.split(",")]
        waits = train_wait(root, args.train_steps, train_workers) if args.train_steps else []
    ours = {"folder", "shards-png", "shards-png-pil", "shards-npy"}
    complete = ours <= {r["reader"] for r in rows}
    result = {**(ratios(rows) if complete else {}), "skipped": skipped, "cold_method": how, "cpus": os.cpu_count(),
              "samples": args.samples, "rows": rows, "train": waits}
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows",)}, indent=1))
    if args.plot:
        plot(rows, Path(args.plot))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
