"""Reading the same shards from the same S3 endpoint through hpctrain, litdata and Mosaic streaming,
in one run, interleaved round by round.

    python benchmarks/bench/s3_read.py [--samples 4000] [--per-shard 500] [--rounds 4] [--json out.json]
    AWS_ENDPOINT_URL=http://minio:9000 AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
        python benchmarks/bench/s3_read.py --bucket BUCKET        # a real store instead of the local one

Without ``--bucket`` it starts the test suite's S3 server (moto's server mode on a local port,
tests/s3_server.py). The same PNG images (32x32 RGB, ~3 KB, benchmarks/data.py's) are written once in
each library's own container, uploaded under its own prefix: hpctrain tar shards (``hpctrain data
shard``'s writer), ``litdata.optimize`` chunks, Mosaic ``MDSWriter`` shards, all about the same bytes
per shard. Each round every reader reads the whole set once, from the store, cold (a fresh local cache
directory for litdata and streaming, which download chunks before reading them; hpctrain with
``data.stage_dir=off``: ranged reads with whole-shard readahead), shuffled, in batches of 64, decoded
with PIL into float tensors, in the process itself (``num_workers=0``, so the CPU figure is every thread
the reader runs; one torch thread for all). Figures: samples/s (wall) and CPU microseconds per sample
(the process's CPU, all threads; the server's own CPU is not counted), medians of the rounds.
Install the peers as docs/benchmarks.md's data-pipeline section says.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

import hpctrain.data.decode as shard_decode  # noqa: E402
from hpctrain.core.env import ClusterEnv  # noqa: E402
from hpctrain.data.loader import ShardedLoader  # noqa: E402
from hpctrain.data.remote import mirror  # noqa: E402
from hpctrain.data.writer import write_shards  # noqa: E402


def _data_bench() -> Any:
    """benchmarks/data.py (its images, PNG encoder, litdata and MDS writers and readers), imported by
    its own name so that litdata's spawned workers can import it too."""
    import data

    return data


def upload_dir(client: Any, bucket: str, local: Path, prefix: str) -> None:
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")


def build(db: Any, client: Any, bucket: str, work: Path, n: int, per_shard: int) -> None:
    x, y = db.images(n)
    encoded = [db.png(img) for img in x]
    meta = {"source": "bench", "classes": [str(c) for c in range(10)],
            "decode": {"input": "png", "target": "cls", "scale": 255.0, "mean": None, "std": None}}
    write_shards(((f"s{i:06d}", {"cls": str(y[i]).encode(), "png": encoded[i]}) for i in range(n)),
                 work / "hpctrain", "train", samples_per_shard=per_shard, meta=meta)
    chunk = per_shard * int(np.mean([len(e) for e in encoded[:1000]]))
    db.build_litdata(work / "litdata", encoded, y, chunk)
    db.build_mds(work / "mds", encoded, y, chunk)
    for name in ("hpctrain", "litdata", "mds"):
        upload_dir(client, bucket, work / name, name)


def hpctrain_batches(url: str, cache: Path) -> Iterable:
    shard_decode._SPNG = False  # PIL, as the peers decode
    root = mirror(url, {}, ["train"])  # the indexes (what a run's local rank 0 mirrors once per node)
    return ShardedLoader(root, ClusterEnv(), 64, drop_last=False)


def litdata_batches(db: Any, url: str, cache: Path) -> Iterable:
    import litdata.streaming.downloader as lit_download
    from litdata import StreamingDataLoader
    from litdata import StreamingDataset as LitDataset

    if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
        # litdata fetches chunks through obstore, whose client refuses plain http unless told (the local
        # server; a real store's https needs nothing)
        lit_download._OBSTORE_CLIENT_OPTIONS = {**lit_download._OBSTORE_CLIENT_OPTIONS, "allow_http": True}

    class Decoded(LitDataset):
        def __getitem__(self, index: Any) -> Any:
            sample = super().__getitem__(index)
            import torch
            return (torch.from_numpy(db._pil_rgb(sample["png"])).permute(2, 0, 1).float().div_(255.0),
                    int(sample["cls"]))

    return StreamingDataLoader(Decoded(url, cache_dir=str(cache), shuffle=True), batch_size=64, num_workers=0)


def mds_batches(db: Any, url: str, cache: Path) -> Iterable:
    mds = db._streaming()
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()

    class Decoded(mds.StreamingDataset):
        def __getitem__(self, index: Any) -> Any:
            sample = super().__getitem__(index)
            import torch
            return (torch.from_numpy(db._pil_rgb(sample["png"])).permute(2, 0, 1).float().div_(255.0),
                    int(sample["cls"]))

    return DataLoader(Decoded(remote=url, local=str(cache), shuffle=True, batch_size=64), batch_size=64,
                      num_workers=0)


def timed(make: Callable[[Path], Iterable], cache: Path) -> dict[str, float]:
    """One cold read of the whole set: the reader is built (and its indexes fetched) inside the timing."""
    wall, cpu = time.perf_counter(), time.process_time()
    count = 0
    for batch in make(cache):
        if hasattr(batch, "inputs"):  # hpctrain's Batch: the last one is padded, its padding masked
            count += len(batch.inputs) if batch.mask is None else int(batch.mask.sum())
        else:
            count += len(batch[0])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"samples": count, "samples_per_s": count / wall, "cpu_us_per_sample": cpu / count * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--bucket", help="a bucket of a real store (credentials and endpoint from the environment)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, the same for every reader")
    parser.add_argument("--json")
    args = parser.parse_args()
    db = _data_bench()
    import torch

    torch.set_num_threads(args.threads)  # the same for every reader (1: no batch op races the I/O threads)
    server = None
    if args.bucket is None:
        from tests.s3_server import S3Server

        server = S3Server().start()
        os.environ.update(server.env)
        bucket = "bench-read"
        server.bucket(bucket)
        client = server.client()
    else:
        import boto3

        bucket, client = args.bucket, boto3.client("s3")
    os.environ.setdefault("S3_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL", ""))  # Mosaic streaming's variable
    try:
        with tempfile.TemporaryDirectory(prefix="hpctrain-s3-read-") as tmp:
            work = Path(tmp)
            os.environ.setdefault("HPCTRAIN_CACHE", str(work / "hpctrain-cache"))
            build(db, client, bucket, work, args.samples, args.per_shard)
            multiprocessing.set_start_method("fork", force=True)  # litdata's optimize switched it to spawn
            readers: dict[str, Callable[[Path], Iterable]] = {
                "hpctrain": lambda c: hpctrain_batches(f"s3://{bucket}/hpctrain", c),
                "litdata": lambda c: litdata_batches(db, f"s3://{bucket}/litdata", c),
                "streaming": lambda c: mds_batches(db, f"s3://{bucket}/mds", c),
            }
            results: dict[str, list[dict[str, float]]] = {k: [] for k in readers}
            names = list(readers)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:  # rotated: no reader always first
                    cache = work / f"cache-{name}-{r}"
                    results[name].append(timed(readers[name], cache))
                    print(f"round {r} {name}: {results[name][-1]}", flush=True)
    finally:
        if server is not None:
            server.kill()
    table = {name: {"samples_per_s": statistics.median(x["samples_per_s"] for x in rows),
                    "cpu_us_per_sample": statistics.median(x["cpu_us_per_sample"] for x in rows),
                    "samples": rows[0]["samples"]} for name, rows in results.items()}
    print(f"{'reader':<10} {'samples/s':>10} {'CPU us/sample':>14}")
    for name, row in table.items():
        print(f"{name:<10} {row['samples_per_s']:>10.0f} {row['cpu_us_per_sample']:>14.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "medians": table, "rounds": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
