"""What names a place on object storage is checked as a place (issue 42), against the moto S3 server
(tests/s3_server.py) where a store is needed: storage options are typed values (a region is a region)
and a URL is parsed once into bucket and key, both refused in one line (exit 2) before any client
is made; a listing skips and names keys no client can read; shard manifests and indexes on a store
are size-bounded before they are downloaded; a tar deleted after the listing, a truncated tar and a
manifest without shards are each one clear error naming the place on the store."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpctrain.checkpoint import remote as ckpt_remote
from hpctrain.cli import main
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import EXIT_RUN_FAILED, RunError, UserError
from hpctrain.core.section import ConfigError
from hpctrain.core.storage import Store, check_storage_options, open_store, parse_url
from hpctrain.data.errors import ShardError, TruncatedShardError
from hpctrain.data.loader import ShardedLoader
from hpctrain.data.manifest import JSON_LIMIT, load_manifest
from hpctrain.data.remote import ShardGoneError, download_verified, mirror, mirror_root
from hpctrain.data.sources import open_source
from hpctrain.data.writer import write_shards
from tests.s3_server import S3Server, s3_env, s3_server  # noqa: F401

BUCKET = "inputs-42"
SAMPLES = 96  # three shards of 32


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("s3inputs")
    gen = np.random.default_rng(3)
    np.savez(tmp / "train.npz", x=gen.standard_normal((SAMPLES, 8)).astype(np.float32), y=np.arange(SAMPLES) % 10)
    opened = open_source(f"npz:{tmp / 'train.npz'}", "train")
    write_shards(opened.samples, tmp / "shards", "train", samples_per_shard=32, meta=opened.meta)
    return tmp / "shards"


@pytest.fixture
def store_env(s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3Server:  # noqa: F811
    """The shared server's credentials and endpoint, a cache of the test's own, the default limits."""
    monkeypatch.setenv("HPCTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(JSON_LIMIT.env, raising=False)
    s3_env.bucket(BUCKET)
    return s3_env


def _upload(server: S3Server, prefix: str, local: Path, change: dict[str, bytes | None] | None = None) -> str:
    """``local``'s files under ``s3://BUCKET/prefix``, with ``change``: name -> other bytes (None: left out)."""
    client, change = server.client(), change or {}
    for f in sorted(local.iterdir()):
        body = change.get(f.name, f.read_bytes())
        if body is not None:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{f.name}", Body=body)
    return f"s3://{BUCKET}/{prefix}"


def _manifest(local: Path, **edits: object) -> bytes:
    manifest = json.loads((local / "train.manifest.json").read_text())
    manifest.update(edits)
    return json.dumps(manifest).encode()


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------- storage options: typed values


@pytest.mark.parametrize(("options", "says"), [
    ({"region": "x@127.0.0.1:9/#"}, "k.region='x@127.0.0.1:9/#' is not a region name"),
    ({"region": "us-east-1?"}, "k.region='us-east-1?' is not a region name"),
    ({"region": "US East"}, "k.region='US East' is not a region name"),
    ({"region": 5}, "k.region=5 is not a region name"),
    ({"endpoint_url": "http://minio:9000/?x=1"}, "k.endpoint_url='http://minio:9000/?x=1' is not an http(s) URL"),
    ({"endpoint_url": "http://minio:9000/#"}, "k.endpoint_url='http://minio:9000/#' is not an http(s) URL"),
    ({"endpoint_url": "http://minio:99999"}, "k.endpoint_url='http://minio:99999' is not an http(s) URL of a host"),
    ({"endpoint_url": "http://a:b@minio:9000"}, "k.endpoint_url: credentials do not belong in the endpoint URL"),
    ({"endpoint_url": "http://minio:9000/../x"}, "k.endpoint_url='http://minio:9000/../x' is not an http(s) URL of"),
    ({"profile": "a b"}, "k.profile='a b' is not a profile name"),
    ({"profile": "x\n"}, "k.profile='x\\n' is not a profile name"),
    ({"retries": 10**12}, "k.retries=1000000000000 must be a whole number from 0 to 100"),
    ({"retries": True}, "k.retries=True must be a whole number from 0 to 100"),
    ({"anon": "yes"}, "k.anon='yes' must be true or false"),
    ({7: "x"}, "unknown key 'k.7'; valid keys: endpoint_url"),
])
def test_storage_options_are_typed_values(options: dict, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_storage_options("k", options)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_good_storage_options_are_kept_normalized() -> None:
    good = {"region": "eu-central-2", "endpoint_url": "https://rgw.site.example:8443/", "profile": "sso-admin",
            "anon": False, "retries": 0, "addressing_style": "path"}
    assert check_storage_options("k", good) == {**good, "endpoint_url": "https://rgw.site.example:8443"}
    assert check_storage_options("k", {"endpoint_url": "http://[::1]:9000"}) == {"endpoint_url": "http://[::1]:9000"}


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A host that must never be asked anything: a listening socket the region would point at; dummy
    credentials and no endpoint in the environment (AWS_ENDPOINT_URL unset, as in the issue)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "dummy-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "dummy-secret")
    yield sock
    with pytest.raises(BlockingIOError):  # no connection was ever made to it
        sock.accept()
    sock.close()


def test_a_region_that_names_a_host_is_refused_before_any_request(listener: socket.socket, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    evil = f"x@127.0.0.1:{listener.getsockname()[1]}/#"
    capsys.readouterr()
    assert main(["data", "verify", "s3://b/p", "--storage-option", f"region={evil}"]) == 2
    assert f"--storage-option.region={evil!r} is not a region name" in _one_line(capsys.readouterr().err)
    assert main(["train", "data.name=shards", "data.path=s3://b/p", f"data.storage_options.region={evil}",
                 f"run.dir={tmp_path / 'a'}"]) == 2
    assert f"data.storage_options.region={evil!r} is not a region name" in _one_line(capsys.readouterr().err)
    mix = f"data.mix=[{{path: s3://b/p, weight: 1, storage_options: {{region: '{evil}'}}}}]"
    assert main(["train", mix, f"run.dir={tmp_path / 'b'}"]) == 2
    assert f"data.mix[0].storage_options.region={evil!r} is not a region name" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    monkeypatch.setenv("AWS_DEFAULT_REGION", evil)  # the environment's region is held to the same form
    with pytest.raises(UserError, match=r"the region 'x@127\.0\.0\.1:\d+/#' \(from AWS_DEFAULT_REGION"):
        open_store("s3://b/p")


# ---------------------------------------------------------------- URLs: parsed once


BAD_URLS = [("s3://data/../cifar", "a '..' segment"), ("s3://data//cifar", "an empty segment"),
            ("s3://data/./cifar", "a '.' segment"), ("s3://data/ci far", "a space"),
            ("s3://data/cifar?x", "a '?'"), ("s3://data/cifar#x", "a '#'"),
            ("s3://data/ci\x01far", "the control character '\\x01'"), ("s3://data/ci\\far", "a backslash")]


@pytest.mark.parametrize(("url", "problem"), BAD_URLS)
def test_a_url_that_names_no_object_is_refused_in_one_line(url: str, problem: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run = [f"run.dir={tmp_path / 'run'}"]
    cases = [(["train", "data.name=shards", f"data.path={url}", *run], "data.path"),
             (["train", f"checkpoint.remote={url}", *run], "checkpoint.remote"),
             (["train", f"data.mix=[{{path: {json.dumps(url)}, weight: 1}}]", *run], "data.mix[0].path"),
             (["data", "verify", url], "OUT_DIR"), (["data", "inspect", url], "OUT_DIR")]
    capsys.readouterr()
    for argv, key in cases:
        assert main(argv) == 2, argv
        assert f"{key}={url!r}: its path has {problem}" in _one_line(capsys.readouterr().err), argv
    assert main(["ckpt", "list", url]) == 2  # through checkpoint.remote's open_store: the same parser
    line = _one_line(capsys.readouterr().err)
    assert "error" in line and f"its path has {problem}" in line and "Traceback" not in line
    assert not (tmp_path / "run").exists()


def test_the_parser_gives_bucket_and_prefix_once() -> None:
    place = parse_url("S3://My-Bucket.v2/runs/a/", "k")
    assert (place.scheme, place.bucket, place.prefix, place.url) == ("s3", "My-Bucket.v2", "runs/a",
                                                                     "s3://My-Bucket.v2/runs/a")
    with pytest.raises(ConfigError, match=r"^k='s3://x@127\.0\.0\.1:9/p': 'x@127\.0\.0\.1:9' is not a bucket name"):
        parse_url("s3://x@127.0.0.1:9/p", "k")


# ---------------------------------------------------------------- listings


def test_a_listing_skips_and_names_the_keys_no_client_can_read(store_env: S3Server, local_shards: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    url = _upload(store_env, "stray", local_shards)
    client = store_env.client()
    for key in ("stray/x/../y", "stray/a//b", "stray/dir/"):  # a console's folder marker is skipped without a word
        client.put_object(Bucket=BUCKET, Key=key, Body=b"stray")
    with caplog.at_level(logging.WARNING, "hpctrain"):
        root = mirror(url, {}, ["train"])
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 1 and "skipped 2 key(s)" in warned[0] and "'a//b', 'x/../y'" in warned[0], warned
    loader = ShardedLoader(root, ClusterEnv(), 16)
    assert sum(len(b.keys) for b in loader) == SAMPLES
    # a checkpoint tier's listing (resume=auto) is not stopped by a stray key either
    for key in ("tier/step-000000001/manifest.json", "tier/step-000000002/../x", "tier/step-000000003//y"):
        client.put_object(Bucket=BUCKET, Key=key, Body=b"{}")
    assert ckpt_remote.committed(open_store(f"s3://{BUCKET}/tier")) == [(1, "step-000000001")]


# ---------------------------------------------------------------- size bounds


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys any whole or ranged read or download asks the store for."""
    asked: list[str] = []

    def recording(real: Any) -> Any:
        def call(self: Store, key: str, *args: Any, **kwargs: Any) -> Any:
            asked.append(key)
            return real(self, key, *args, **kwargs)
        return call
    for name in ("read", "read_range", "read_ranges", "get_file"):
        monkeypatch.setattr(Store, name, recording(getattr(Store, name)))
    return asked


def test_a_manifest_or_index_beyond_the_limit_is_refused_before_it_is_downloaded(
        store_env: S3Server, local_shards: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    url = _upload(store_env, "big", local_shards)
    asked = _reads(monkeypatch)
    # a 1.1 GiB manifest as the listing reports it: refused by the default limit, not a byte read
    real_list = Store.list
    huge = int(1.1 * 2**30)
    monkeypatch.setattr(Store, "list", lambda self, prefix="": {
        k: (huge if k == "train.manifest.json" else v) for k, v in real_list(self, prefix).items()})
    with pytest.raises(ShardError) as err:
        mirror(url, {}, ["train"])
    assert str(err.value) == (f"manifest {url}/train.manifest.json holds {huge:,} bytes, more than the {2**30:,} that "
                              "a shard manifest or index may hold (HPCTRAIN_MAX_JSON_BYTES); hint: if the file is "
                              f"genuine, raise the limit: HPCTRAIN_MAX_JSON_BYTES={huge}")
    assert asked == []
    monkeypatch.setattr(Store, "list", real_list)
    # an index past the limit (and without index_sha256 in the manifest): refused, nothing cached
    index = local_shards / "train-000001.idx.json"
    limit = max(len((local_shards / "train.manifest.json").read_bytes()), index.stat().st_size) + 10
    manifest = json.loads((local_shards / "train.manifest.json").read_text())
    for shard in manifest["shards"]:
        shard.pop("index_sha256", None)
    padded = index.read_bytes() + b" " * 20  # valid JSON still, 10 bytes past the limit
    url = _upload(store_env, "bigindex", local_shards, {"train.manifest.json": json.dumps(manifest).encode(),
                                                        index.name: padded})
    monkeypatch.setenv("HPCTRAIN_MAX_JSON_BYTES", str(limit))
    asked.clear()
    with pytest.raises(ShardError, match=rf"^index {url}/train-000001\.idx\.json holds {len(padded):,} bytes, more "
                                         rf"than the {limit:,} .*HPCTRAIN_MAX_JSON_BYTES={len(padded)}$"):
        mirror(url, {}, ["train"])
    assert "train-000001.idx.json" not in asked
    assert not (mirror_root(url) / "train-000001.idx.json").exists()
    monkeypatch.setenv("HPCTRAIN_MAX_JSON_BYTES", str(2 * limit))  # raised: the same split mirrors
    assert (mirror(url, {}, ["train"]) / "train-000001.idx.json").read_bytes() == padded
    monkeypatch.setenv("HPCTRAIN_MAX_JSON_BYTES", "12k")
    capsys.readouterr()
    assert main(["data", "verify", url]) == 2
    assert "HPCTRAIN_MAX_JSON_BYTES='12k' must be a whole number of bytes" in _one_line(capsys.readouterr().err)


def test_a_local_manifest_beyond_the_limit_names_the_limit(local_shards: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.manifest.json").write_bytes((local_shards / "train.manifest.json").read_bytes())
    monkeypatch.setenv("HPCTRAIN_MAX_JSON_BYTES", "100")
    with pytest.raises(ShardError, match=r"^manifest .*train\.manifest\.json holds [\d,]+ bytes, more than the 100 "
                                         r"that a shard manifest or index may hold \(HPCTRAIN_MAX_JSON_BYTES\)"):
        load_manifest(tmp_path, "train")


# ---------------------------------------------------------------- tars gone, truncated; no shards


@pytest.mark.parametrize("shuffle", ["shard", "global"])  # whole-shard readahead; a batch's exact ranges
def test_a_tar_deleted_after_the_listing_stops_the_run_naming_it(store_env: S3Server, local_shards: Path,
                                                                 shuffle: str, tmp_path: Path) -> None:
    url = _upload(store_env, f"gone-{shuffle}", local_shards)
    root = mirror(url, {}, ["train"])
    loader = ShardedLoader(root, ClusterEnv(), 16, shuffle=shuffle)  # type: ignore[arg-type]
    store_env.client().delete_object(Bucket=BUCKET, Key=f"gone-{shuffle}/train-000001.tar")
    with pytest.raises(ShardGoneError) as err:
        for _ in loader:
            pass
    assert err.value.exit_code == EXIT_RUN_FAILED and isinstance(err.value, RunError)
    assert str(err.value).startswith(f"shard {url}/train-000001.tar is gone from the store: it was listed when the "
                                     "run started") and "\n" not in str(err.value)
    shard = load_manifest(root, "train")["shards"][1]  # staging it into the node-local cache: the same error
    with pytest.raises(ShardGoneError, match=rf"^shard {url}/train-000001\.tar is gone from the store"):
        download_verified(open_store(url), shard, tmp_path / shard["name"])
    assert not (tmp_path / shard["name"]).exists()


def test_a_truncated_tar_on_the_store_is_named_by_its_url(store_env: S3Server, local_shards: Path) -> None:
    tar = (local_shards / "train-000001.tar").read_bytes()
    url = _upload(store_env, "trunc", local_shards, {"train-000001.tar": tar[: len(tar) // 2]})
    root = mirror(url, {}, ["train"])
    with pytest.raises(TruncatedShardError) as err:
        ShardedLoader(root, ClusterEnv(), 16)
    assert str(err.value).startswith(f"shard {url}/train-000001.tar is truncated: sample ")
    assert f"hint: hpctrain data verify {url}" in str(err.value) and str(root) not in str(err.value)


def test_a_manifest_without_shards_is_an_error_and_fails_verify(store_env: S3Server, local_shards: Path,
                                                               tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    empty = _manifest(local_shards, shards=[], total_samples=0)
    url = _upload(store_env, "empty", local_shards, {"train.manifest.json": empty})
    with pytest.raises(ShardError) as err:
        ShardedLoader(mirror(url, {}, ["train"]), ClusterEnv(), 16)
    assert str(err.value) == (f"{url}/train.manifest.json lists no shards; hint: write the split again (hpctrain "
                              f"data shard SOURCE {url} --split train)")
    local = tmp_path / "local"
    local.mkdir()
    (local / "train.manifest.json").write_bytes(empty)
    capsys.readouterr()
    for place in (url, str(local)):
        assert main(["data", "verify", place]) == 1
        out = capsys.readouterr()
        assert "ok" not in out.out and _one_line(out.err) == (
            f"FAIL train: train.manifest.json: lists no shards (no sample to read); hint: write the split again "
            f"(hpctrain data shard SOURCE {place} --split train)")


def test_a_waiting_rank_reads_local_rank_0s_failure_marker_bounded(tmp_path: Path) -> None:
    """The marker lies in the shared temporary directory: junk or a giant there is a failure said in
    one line, not a traceback in every waiting rank nor a read of the whole file."""
    from hpctrain.data.nodeonce import MARKER_BYTES, _peer_failure

    good = tmp_path / "good.json"
    good.write_text(json.dumps({"message": "staging failed: disk full", "exit_code": 2}))
    assert (str(_peer_failure(good)), _peer_failure(good).exit_code) == ("staging failed: disk full", 2)
    for name, body in (("junk.json", b"{not json"), ("giant.json", b" " * (MARKER_BYTES + 1))):
        (tmp_path / name).write_bytes(body)
        err = _peer_failure(tmp_path / name)
        assert str(err) == (f"local rank 0 failed, and its failure marker {tmp_path / name} cannot be read; hint: "
                            "look at local rank 0's log") and err.exit_code == EXIT_RUN_FAILED
