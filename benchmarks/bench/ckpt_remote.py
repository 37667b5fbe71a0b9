"""The checkpoint remote tier (``checkpoint.remote``) against plain copies of the same bytes to
the same S3 endpoint, in one run, interleaved round by round.

    python benchmarks/bench/ckpt_remote.py [--gb 1.0] [--repeats 3] [--dir /tmp/hpctrain-bench-remote] [--json out.json]
    AWS_ENDPOINT_URL=http://minio:9000 AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
        python benchmarks/bench/ckpt_remote.py --bucket BUCKET     # a real store instead of the local one

Without ``--bucket`` it starts the test suite's S3 server (moto's server mode on a local port,
tests/s3_server.py). One committed checkpoint of ``--gb`` GB (fp32 linear layers, SGD: the model
is the whole state) is written once by hpctrain's checkpointer; then every round runs, in an
order rotated round by round:

* **upload**: hpctrain's tier (``remote.upload``, what the background uploader runs: the old
  copy's marker deleted first, the files four at a time, the manifest last); ``s3fs``
  (``fs.put`` of the checkpoint directory, recursive); ``obstore`` (``obstore.put`` of each
  file, multipart);
* **download**: hpctrain's tier (``remote.download``, what resume=auto runs for a new
  allocation: files into a partial directory, every byte checked against the manifest,
  rename); ``s3fs`` (``fs.get``, recursive); ``obstore`` (``obstore.get``, streamed to a file).

Every copy lands under its own prefix and is deleted after the round (the local server keeps
objects in memory). Figures: GB/s per method, medians of the rounds; ``upload_vs_plain`` =
the faster plain copy's seconds over hpctrain's (1.0 = as fast; the goal is >= 0.9), per
round and the median; the same for downloads (hpctrain's includes its checksum check).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: hpctrain and tests/s3_server.py from this checkout


def write_checkpoint(gb: float, where: Path) -> Path:
    """One committed checkpoint of ~``gb`` GB under ``where/checkpoints``."""
    import torch
    from torch import nn

    from hpctrain.checkpoint.checkpointer import Checkpointer
    from hpctrain.config import load_config
    from hpctrain.core.env import ClusterEnv
    from hpctrain.parallel.state import WholeState
    from hpctrain.precision import Precision
    from hpctrain.train import Counters

    width = 4096
    layers = max(1, round(gb * 1e9 / width ** 2 / 4))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counters = Counters(step=1)

    class Position:
        def state_dict(self) -> dict[str, int]:
            return {"epoch": 0, "batches_done": 0}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    state = {"model": WholeState(model, optimizer), "scheduler": None, "counters": counters, "loader": Position(),
             "scaler": Precision("fp32", torch.device("cpu"))}
    cfg = load_config(None, ["checkpoint.every_seconds=None"]).checkpoint
    ckpt = Checkpointer(where, ClusterEnv(), torch.device("cpu"), cfg, state)
    ckpt.save({}, blocking=True)
    ckpt.close()
    assert ckpt.writer.last_committed is not None
    return ckpt.writer.last_committed


def _s3fs() -> Any:
    import s3fs  # a peer of the benchmark, not a dependency of hpctrain

    return s3fs.S3FileSystem(endpoint_url=os.environ.get("AWS_ENDPOINT_URL"))


def _obstore(bucket: str) -> Any:
    from obstore.store import S3Store  # a peer of the benchmark (also hpctrain's own client)

    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    config = {"endpoint": endpoint, "region": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
              "access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
              "secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"]} if endpoint else {}
    return S3Store(bucket, config=config, client_options={"allow_http": True})  # type: ignore[arg-type]


def methods(ckpt: Path, bucket: str, scratch: Path) -> dict[str, Callable[[str], Any]]:
    """name -> fn(prefix): one copy of the checkpoint up (``up_*``) or down (``down_*``)."""
    import obstore

    from hpctrain.checkpoint import remote

    fs, obs = _s3fs(), _obstore(bucket)
    files = [p for p in sorted(ckpt.rglob("*")) if p.is_file()]
    stores: dict[str, Any] = {}

    def store(prefix: str) -> Any:  # opened once, outside the clock, as the tier keeps its store for the run
        return stores.setdefault(prefix, remote.open_store(f"s3://{bucket}/{prefix}"))

    store("bench-hpctrain")

    def obs_get(prefix: str) -> None:
        out = scratch / "obstore"
        for p in files:
            target = out / p.relative_to(ckpt)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as fh:
                for chunk in obstore.get(obs, f"{prefix}/{ckpt.name}/{p.relative_to(ckpt)}").stream(8 << 20):
                    fh.write(chunk)

    return {
        "up_hpctrain": lambda prefix: remote.upload(store(prefix), ckpt),
        "up_s3fs": lambda prefix: fs.put(str(ckpt), f"{bucket}/{prefix}/{ckpt.name}", recursive=True),
        "up_obstore": lambda prefix: [obstore.put(obs, f"{prefix}/{ckpt.name}/{p.relative_to(ckpt)}", p)
                                      for p in files],
        "down_hpctrain": lambda prefix: remote.download(store(prefix), ckpt.name, scratch / "hpctrain"),
        "down_s3fs": lambda prefix: fs.get(f"{bucket}/{prefix}/{ckpt.name}", str(scratch / "s3fs"), recursive=True),
        "down_obstore": obs_get,
    }


def one_round(fns: dict[str, Callable[[str], Any]], order: list[str], bucket: str, scratch: Path) -> dict[str, float]:
    """Seconds of every method; each download reads the copy its own tool uploaded."""
    from hpctrain.checkpoint import remote

    seconds = {}
    for tool in order:
        seconds[f"up_{tool}"] = _timed(fns[f"up_{tool}"], f"bench-{tool}")
    for tool in order:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        seconds[f"down_{tool}"] = _timed(fns[f"down_{tool}"], f"bench-{tool}")
    for tool in order:  # the local server keeps every object in memory
        store = remote.open_store(f"s3://{bucket}/bench-{tool}")
        for key in store.list(""):
            store.delete(key)
    return seconds


def _timed(fn: Callable[[str], Any], prefix: str) -> float:
    start = time.perf_counter()
    fn(prefix)
    return time.perf_counter() - start


def summarize(rounds: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"gb": round(nbytes / 1e9, 3), "rounds": len(rounds)}
    for name in rounds[0]:
        out[f"{name}_GBps"] = round(nbytes / 1e9 / statistics.median(r[name] for r in rounds), 3)
    for way in ("up", "down"):
        ratios = [min(r[f"{way}_s3fs"], r[f"{way}_obstore"]) / r[f"{way}_hpctrain"] for r in rounds]
        out[f"{way}load_vs_plain"] = round(statistics.median(ratios), 3)
        out[f"{way}load_vs_plain_rounds"] = [round(x, 3) for x in ratios]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/hpctrain-bench-remote")
    ap.add_argument("--bucket", help="a bucket of the store AWS_ENDPOINT_URL names (default: a local S3 server)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    server = None
    if args.bucket is None:
        from tests.s3_server import S3Server

        server = S3Server().start()
        os.environ.update(server.env)
        bucket = server.bucket("hpctrain-bench")[len("s3://"):]
    else:
        bucket = args.bucket
    try:
        ckpt = write_checkpoint(args.gb, work / "run")
        nbytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        fns = methods(ckpt, bucket, work / "scratch")
        tools = ["hpctrain", "s3fs", "obstore"]
        rounds = []
        for r in range(args.repeats):
            order = tools[r % 3:] + tools[: r % 3]
            rounds.append(one_round(fns, order, bucket, work / "scratch"))
            print(f"round {r + 1}: " + ", ".join(f"{k} {nbytes / 1e9 / v:.2f} GB/s" for k, v in rounds[-1].items()),
                  flush=True)
        result = summarize(rounds, nbytes)
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
