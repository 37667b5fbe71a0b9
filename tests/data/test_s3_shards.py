"""Tar shards on object storage, against a real S3 server (moto's server mode over HTTP, tests/s3_server.py):
`hpctrain data shard` writes to s3:// and `data verify` checks it there; 2 ranks train from s3 to the
same weights as from the local copy and from the node-local cache (data.stage_dir); SIGKILL mid-epoch,
then the same job resumes bit-identical; the server killed under a reader is a one-line RunError (exit 1)
after the retries; wrong credentials end `hpctrain train` with exit 2 and one line; no secret ever
reaches a run directory or the output."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hpctrain.checkpoint import layout
from hpctrain.cli import main
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import EXIT_RUN_FAILED, EXIT_USER_ERROR, RunError
from hpctrain.core.storage import Store
from hpctrain.data.errors import ShardError
from hpctrain.data.loader import ShardedLoader
from hpctrain.data.pack import sample_key
from hpctrain.data.remote import mirror
from hpctrain.data.sources import open_source
from hpctrain.data.writer import write_shards
from tests import dist_utils
from tests.checkpoint import test_preempt as preempt
from tests.dist_utils import train_cases
from tests.s3_server import SECRET_KEY, S3Server, s3_env, s3_private_server, s3_server  # noqa: F401

pytestmark = pytest.mark.slow  # a server and several ranks: scheduled first (tests/conftest.py)

N = {"train": 96, "val": 16}
# 96 samples, 8 a step over 2 ranks: 12 steps an epoch, 24 in all; ~20 ms a step (slow_mlp: tiny_mlp's weights)
BASE = ["data.name=shards", "model.name=tests.user_models:slow_mlp", "data.batch_size=4", "train.epochs=2",
        "train.log_every=1", "train.progress=false", "train.threads=1", "checkpoint.every_seconds=None",
        "data.stage_dir=off"]


@dataclass
class Shards:
    url: str  # s3://bucket/tiny, written by `hpctrain data shard`
    local: Path  # the same samples written to a directory
    tmp: Path


def _npz(tmp: Path, split: str) -> str:
    gen = np.random.default_rng(1 if split == "train" else 2)
    path = tmp / f"{split}.npz"
    np.savez(path, x=gen.standard_normal((N[split], 128)).astype(np.float32), y=np.arange(N[split]) % 10)
    return f"npz:{path}"


@pytest.fixture(scope="module")
def shards(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shards]:  # noqa: F811
    """One sharded dataset on the shared server (and its local twin) for every test of the module;
    the server's credentials and endpoint in the environment, as a job's would be."""
    tmp = tmp_path_factory.mktemp("s3shards")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env.items():
            mp.setenv(k, v)
        mp.setenv("HPCTRAIN_CACHE", str(tmp / "cache"))
        url = s3_server.bucket("shards-f27") + "/tiny"
        for split in N:
            source = _npz(tmp, split)
            assert main(["data", "shard", source, url, "--split", split, "--samples-per-shard", "32", "--quiet"]) == 0
            opened = open_source(source, split)
            write_shards(opened.samples, tmp / "tiny-local", split, samples_per_shard=32, meta=opened.meta)
        yield Shards(url, tmp / "tiny-local", tmp)


def test_shard_writes_to_s3_and_verify_checks_it_there(shards: Shards, s3_server: S3Server,  # noqa: F811
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    keys = s3_server.keys("shards-f27", "tiny/")
    tars = [f"tiny/{s}-{i:06d}.tar" for s, n in N.items() for i in range(-(-n // 32))]
    assert set(tars) <= set(keys) and {"tiny/train.manifest.json", "tiny/val.manifest.json"} <= set(keys)
    assert not any(".tmp" in k for k in keys)  # nothing half-written is left
    local = {p.name: p.read_bytes() for p in shards.local.glob("*.tar")}
    client = s3_server.client()
    for key in tars:  # the bytes hpctrain wrote to s3 are the shards it writes locally
        assert client.get_object(Bucket="shards-f27", Key=key)["Body"].read() == local[key.split("/")[1]]
    capsys.readouterr()
    assert main(["data", "verify", shards.url]) == 0
    assert capsys.readouterr().out.splitlines() == ["ok   train: every shard matches the manifest and its index",
                                                   "ok   val: every shard matches the manifest and its index"]
    assert main(["data", "inspect", shards.url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["split"], r["samples"], r["shards"]) for r in rows] == [("train", 96, 3), ("val", 16, 1)]
    # a flipped byte inside a sample of a copy is found on the store, named by shard
    broken = s3_server.bucket("broken-f27")
    for key in keys:
        body = client.get_object(Bucket="shards-f27", Key=key)["Body"].read()
        if key == "tiny/train-000001.tar":
            body = body[:1500] + bytes([body[1500] ^ 1]) + body[1501:]
        client.put_object(Bucket="broken-f27", Key=key, Body=body)
    assert main(["data", "verify", f"{broken}/tiny", "--split", "train"]) == 1
    err = capsys.readouterr().err
    assert "FAIL train: train-000001.tar" in err and "sha256 differs" in err
    assert main(["data", "verify", f"{broken}/tiny", "--quick"]) == 0  # sizes only, from the listing: unchanged


def test_a_manifest_outside_the_mirror_may_not_send_the_reader_to_a_store(shards: Shards, tmp_path: Path) -> None:
    for f in shards.local.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((tmp_path / "train.manifest.json").read_text())
    manifest["remote"] = {"url": shards.url, "options": {}}
    (tmp_path / "train.manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="'remote' 's3://shards-f27/tiny': only hpctrain's mirror of a store's "
                                         "indexes may name one"):
        ShardedLoader(tmp_path, ClusterEnv(), 8)


def _killed_mid_epoch(root: Path, name: str, keys: list[str]) -> None:
    """2 ranks training from s3 (forked as tests.dist_utils forks them), SIGKILLed after a checkpoint mid-epoch."""
    ctx, run = dist_utils._context(), root / name
    queue, port = ctx.Queue(), dist_utils.free_port()
    procs = [ctx.Process(target=dist_utils._worker, daemon=True,
                         args=(r, 2, port, dist_utils._train_each, ([(name, keys)], str(root), None), queue,
                               dict(os.environ))) for r in range(2)]
    for p in procs:
        p.start()
    step, deadline = random.Random().randint(4, 16), time.monotonic() + 120
    while preempt._last_step(run) < step or not layout.committed(run / "checkpoints"):
        assert all(p.is_alive() for p in procs) and time.monotonic() < deadline, "the run ended before step " \
            f"{step}: {queue.get(timeout=5) if not queue.empty() else ''}"
        time.sleep(0.01)
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)  # nothing gets to clean up, as on a node failure
        p.join(timeout=10)
    assert not (run / "summary.json").exists()


def test_two_ranks_from_s3_as_from_local_and_the_node_cache_and_sigkill_resumes_exactly_at_2_and_1_ranks(
        shards: Shards) -> None:
    """One launch killed mid-epoch, then one pair of forked ranks trains every case: from s3, from the
    local twin, through the node-local cache, and the killed job again (resume=auto)."""
    stage = shards.tmp / "stage"
    # the global batch named, so the same checkpoint also resumes at one rank (2 micro-steps of 4)
    resumed = [*BASE, f"data.path={shards.url}", "checkpoint.every_steps=3", "data.global_batch_size=8"]
    _killed_mid_epoch(shards.tmp, "killed", resumed)
    shutil.copytree(shards.tmp / "killed", shards.tmp / "elastic")  # the same checkpoint, for world size 1
    plain = [*BASE, "checkpoint.enabled=false"]
    cases = [("s3", [*plain, f"data.path={shards.url}"]),
             ("local", [*plain, f"data.path={shards.local}"]),
             ("staged", [*plain, f"data.path={shards.url}", f"data.stage_dir={stage}"]),
             ("killed", resumed)]
    got = train_cases(2, cases, shards.tmp, keep=("params_sha256", "steps", "val_count"))[0]
    assert all(isinstance(v, dict) for v in got.values()), got
    assert got["s3"] == got["local"] == got["staged"] == got["killed"]
    assert got["s3"]["steps"] == 24 and got["s3"]["val_count"] == 16
    staged = {p.name for p in stage.glob("hpctrain-shards-*/*.tar")}
    assert staged == {f"{s}-{i:06d}.tar" for s, n in N.items() for i in range(-(-n // 32))}
    # elastic: the 2-rank job's checkpoint resumed from s3 by one rank takes the samples the two would
    # have (the position is global), so it ends where they end, up to the order of the float sums
    keys = ("steps", "val_count", "val_loss")
    one = train_cases(1, [("elastic", resumed)], shards.tmp, keep=keys)[0]["elastic"]
    two = json.loads((shards.tmp / "killed" / "summary.json").read_text())
    assert isinstance(one, dict), one
    assert (one["steps"], one["val_count"]) == (24, 16)
    assert one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-4)
    for name in ("s3", "staged", "killed", "elastic"):  # credentials are never written into a run directory
        for f in (shards.tmp / name).rglob("*"):
            assert not f.is_file() or SECRET_KEY.encode() not in f.read_bytes(), f


def test_dataloader_workers_read_from_s3_what_the_main_process_reads(shards: Shards) -> None:
    """A forked worker cannot use the client its parent started (obstore's runtime does not survive a
    fork: it would hang); it reads through boto3's, the same bytes."""
    root = mirror(shards.url, {}, ["train"])

    def keys(workers: int) -> list[str]:
        loader = ShardedLoader(root, ClusterEnv(), 16, num_workers=workers, persistent_workers=False)
        return [k for batch in loader for k in batch.keys]
    main_process = keys(0)
    assert keys(1) == main_process and sorted(main_process) == [sample_key("train", i) for i in range(N["train"])]


def test_ranks_take_the_tars_sizes_from_the_mirror_and_do_not_list_the_store(
        shards: Shards, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's mirror lists the store once and records every tar's size: a rank opening the split
    lists nothing (at 1,000 ranks and 100,000 tars that was 100,000 listing requests at start); a
    mirror written before sizes were recorded still opens, with one listing."""
    root = mirror(shards.url, {}, ["train"])
    path = root / "train.manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["remote"]["sizes"] == {p.name: p.stat().st_size for p in shards.local.glob("train-*.tar")}
    listings: list[str] = []
    real = Store.list
    monkeypatch.setattr(Store, "list", lambda self, prefix="": listings.append(prefix) or real(self, prefix))
    every = [sample_key("train", i) for i in range(N["train"])]
    assert sorted(k for batch in ShardedLoader(root, ClusterEnv(), 16) for k in batch.keys) == every
    assert listings == []
    del manifest["remote"]["sizes"]
    path.write_text(json.dumps(manifest))
    assert sorted(k for batch in ShardedLoader(root, ClusterEnv(), 16) for k in batch.keys) == every
    assert listings == [""]
    manifest["remote"]["sizes"] = ["train-000000.tar"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="'remote' is .* not {url, options, sizes}"):
        ShardedLoader(root, ClusterEnv(), 16)
    mirror(shards.url, {}, ["train"])  # the mirror as the module's other tests expect it


def test_the_server_killed_under_a_reader_is_one_clear_run_error(s3_private_server: S3Server,  # noqa: F811
                                                                  shards: Shards, monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    for k, v in s3_private_server.env.items():
        monkeypatch.setenv(k, v)
    url = s3_private_server.bucket("dying") + "/tiny"
    client = s3_private_server.client()
    for f in shards.local.iterdir():
        client.put_object(Bucket="dying", Key=f"tiny/{f.name}", Body=f.read_bytes())
    root = mirror(url, {"retries": 1}, ["train"])  # one retry: the test waits 0.2 s of backoff, not 3 s
    loader = ShardedLoader(root, ClusterEnv(), 8)
    first = next(iter(loader))
    assert first.inputs.shape == (8, 128)
    s3_private_server.kill()
    with pytest.raises(RunError) as info:
        for _ in loader:
            pass
    message = str(info.value)
    assert info.value.exit_code == EXIT_RUN_FAILED and "\n" not in message
    assert message.startswith(f"reading {url}/train-0000") and "after the retries" in message
    assert "check that the store is up" in message and SECRET_KEY not in message


def test_wrong_credentials_exit_2_in_one_line_without_the_secret(shards: Shards, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # this server checks every request's signature
    server = S3Server().start()
    try:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        code = main(["train", *BASE, "data.path=s3://shards-f27/tiny", f"run.dir={tmp_path / 'run'}"])
    finally:
        server.kill()
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and "InvalidAccessKeyId" in lines[0] and "AWS_ACCESS_KEY_ID" in lines[0], err
    assert SECRET_KEY not in err


@pytest.mark.parametrize(("override", "message"), [
    ("data.storage_options.secret_access_key=abc", "data.storage_options.secret_access_key: credentials do not belong "
                                                   "in the config"),
    ("data.storage_options.addressing_style=sideways", "data.storage_options.addressing_style='sideways' is not "
                                                       "allowed; choose one of: path, virtual, auto"),
    ("data.storage_options.endpoint_url=minio:9000", "data.storage_options.endpoint_url='minio:9000' is not an "
                                                     "http(s) URL"),
    ("data.storage_options.colour=blue", "unknown key 'data.storage_options.colour'; valid keys: endpoint_url, "
                                         "addressing_style, region, profile, anon, retries"),
])
def test_bad_storage_options_exit_2_naming_the_key(override: str, message: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "data.name=shards", "data.path=s3://b/p", override, f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
