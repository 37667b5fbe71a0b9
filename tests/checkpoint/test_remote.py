"""checkpoint.remote: the object-storage tier of checkpoints, against a real S3 server (moto's
server mode over HTTP, tests/s3_server.py). Upload, retention per tier, a new allocation that
resumes bit-identical from the tier, uploads cut short never committed, a server killed
mid-upload, wrong credentials, and ``hpctrain ckpt list/verify/export`` on the URL."""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import layout, remote, tier_owner
from hpctrain.checkpoint.checkpointer import Checkpointer
from hpctrain.checkpoint.state import rank_file
from hpctrain.cli import main as cli_main
from hpctrain.config import ConfigError, load_config
from hpctrain.core import storage
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import UserError
from hpctrain.train import train
from tests.ckpt_models import make_parts
from tests.dist_utils import train_cases
from tests.s3_server import SECRET_KEY, S3Server, s3_env, s3_private_server, s3_server  # noqa: F401

BASE = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=128",
        "data.batch_size=16", "data.max_val_samples=32", "train.epochs=2", "train.log_every=1",
        "train.progress=false", "checkpoint.every_seconds=None", "train.threads=1", "optim.schedule=constant"]


def _train(run_dir: Path, *extra: str) -> dict:
    return train(load_config(None, [*BASE, f"run.dir={run_dir}", *extra]))


def _local_steps(run_dir: Path) -> list[int]:
    return [s for s, _ in layout.committed(run_dir / "checkpoints")]


def _remote_steps(server: S3Server, bucket: str, prefix: str) -> dict[int, set[str]]:
    """step -> the files uploaded under PREFIX/step-N/ (committed or not)."""
    found: dict[int, set[str]] = {}
    for key in server.keys(bucket, f"{prefix}/"):
        if key == f"{prefix}/{tier_owner.OWNER_KEY}":
            continue  # the prefix's owner record, beside the checkpoints
        name, file = key[len(prefix) + 1:].split("/", 1)
        found.setdefault(layout.step_of(Path(name)) or -1, set()).add(file)
    return found


def test_upload_retention_per_tier_and_resume_on_a_new_allocation(tmp_path: Path, s3_env: S3Server,  # noqa: F811
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    url = s3_env.bucket("tier-resume") + "/runs/a"
    ref = _train(tmp_path / "ref")
    tier = [f"checkpoint.remote={url}", "checkpoint.mode=async"]
    _train(tmp_path / "a", "train.max_steps=12", "checkpoint.every_steps=4", "checkpoint.keep_last=1",
           "checkpoint.remote_keep_last=2", *tier)
    # each tier keeps its own newest: 1 local, 2 remote; every remote one complete, the manifest among its files
    assert _local_steps(tmp_path / "a") == [12]
    uploaded = _remote_steps(s3_env, "tier-resume", "runs/a")
    local = set(layout.read_manifest(tmp_path / "a" / "checkpoints" / layout.step_name(12))["files"])
    assert sorted(uploaded) == [8, 12] and uploaded[12] == local | {layout.MANIFEST}
    # a new allocation: an empty run dir, the same tier; it downloads step 12 and ends as an uninterrupted run
    resumed = _train(tmp_path / "b", *tier)
    assert resumed["params_sha256"] == ref["params_sha256"]
    assert layout.verify(tmp_path / "b" / "checkpoints" / layout.step_name(16)) == []
    capsys.readouterr()
    assert cli_main(["ckpt", "list", url]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[:2] for r in rows[1:]] == [["step-000000008", "8"], ["step-000000012", "12"],
                                                 ["step-000000016", "16"]]  # b's final one added to a's
    assert cli_main(["ckpt", "verify", f"{url}/step-000000016"]) == 0
    assert capsys.readouterr().out == f"{url}/step-000000016: ok\n"
    out = tmp_path / "w.safetensors"
    assert cli_main(["ckpt", "export", url, str(out)]) == 0
    from safetensors.torch import load_file

    exported, final = load_file(out), torch.load(tmp_path / "b" / "model.pt", weights_only=True)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)


def _hand_loop(run_dir: Path, url: str, steps: list[int], resume: str = "auto") -> Checkpointer:
    parts = make_parts()
    cfg = load_config(None, ["checkpoint.every_seconds=None", f"checkpoint.remote={url}", "checkpoint.keep_last=5"])
    ckpt = Checkpointer(run_dir, ClusterEnv(), torch.device("cpu"), cfg.checkpoint, parts.state())
    ckpt.resume(resume)
    for step in steps:
        parts.counters.step = step
        ckpt.save({})
    ckpt.close()
    return ckpt


def test_an_upload_without_its_manifest_is_never_listed_or_loaded(tmp_path: Path, s3_env: S3Server,  # noqa: F811
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    url = s3_env.bucket("tier-partial") + "/p"
    _hand_loop(tmp_path / "a", url, [2, 4])
    client = s3_env.client()
    for step in (1, 6):  # step 4's files, without its manifest, as an upload cut short leaves them
        for file in _remote_steps(s3_env, "tier-partial", "p")[4] - {layout.MANIFEST}:
            client.copy_object(Bucket="tier-partial", Key=f"p/{layout.step_name(step)}/{file}",
                               CopySource={"Bucket": "tier-partial", "Key": f"p/step-000000004/{file}"})
    assert [s for s, _ in remote.committed(remote.open_store(url))] == [2, 4]
    capsys.readouterr()
    assert cli_main(["ckpt", "list", url]) == 0
    assert [r.split()[0] for r in capsys.readouterr().out.splitlines()[1:]] == ["step-000000002", "step-000000004"]
    assert cli_main(["ckpt", "verify", f"{url}/step-000000006"]) == 2
    assert "not a committed checkpoint" in capsys.readouterr().err
    # a new allocation resumes from step 4, not from the newer step 6 that was never committed
    ckpt = _hand_loop(tmp_path / "b", url, [8])
    assert ckpt.resumed_from == tmp_path / "b" / "checkpoints" / "step-000000004"
    # once a newer checkpoint is committed there, the remote retention removes the uploads cut short
    assert sorted(_remote_steps(s3_env, "tier-partial", "p")) == [2, 4, 8]
    # a flipped byte in the newest remote checkpoint: verify says so (exit 1), resume skips it for the older one
    key = f"p/step-000000008/{rank_file(0)}"
    data = bytearray(client.get_object(Bucket="tier-partial", Key=key)["Body"].read())
    data[len(data) // 2] ^= 1
    client.put_object(Bucket="tier-partial", Key=key, Body=bytes(data))
    capsys.readouterr()
    assert cli_main(["ckpt", "verify", url]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == f"{url}/step-000000008: CORRUPT"
    assert rank_file(0) in lines[-1] and "does not match the manifest (corrupted)" in lines[-1]
    ckpt = _hand_loop(tmp_path / "d", url, [])
    assert ckpt.resumed_from == tmp_path / "d" / "checkpoints" / "step-000000004"
    assert not (tmp_path / "d" / "checkpoints" / ".partial-step-000000008").exists()
    # a fresh start (resume=never) onto a tier that holds another run's checkpoints is refused: exit 2
    with pytest.raises(UserError, match=r"belongs to run [0-9a-f]{32} \(run.dir .*/d on host .*whose checkpoints "
                                        r"this run did not resume from"):
        _hand_loop(tmp_path / "e", url, [], resume="never")
    # resume=URL of one checkpoint (a step back): downloaded into the run's checkpoints/; the newer ones of the
    # tier are set aside (no longer committed, files kept), so a later resume=auto never takes them
    ckpt = _hand_loop(tmp_path / "c", url, [], resume=f"{url}/step-000000002")
    assert ckpt.resumed_from == tmp_path / "c" / "checkpoints" / "step-000000002" and ckpt.counters.step == 2
    assert [s for s, _ in remote.committed(remote.open_store(url))] == [2]
    assert _remote_steps(s3_env, "tier-partial", "p")[8] >= {remote.SUPERSEDED, rank_file(0)}


def test_server_killed_mid_upload(tmp_path: Path, s3_private_server: S3Server, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                  caplog: pytest.LogCaptureFixture) -> None:
    for k, v in s3_private_server.env.items():
        monkeypatch.setenv(k, v)
    url = s3_private_server.bucket("tier-kill") + "/run"
    puts: list[str] = []
    put_file = storage.Store.put_file

    def recording_put(store: storage.Store, key: str, local: str | Path) -> None:
        put_file(store, key, local)
        puts.append(key)
        if key.startswith("step-000000008/") and s3_private_server.proc is not None:
            s3_private_server.kill()  # one file of step 8 is up, then the server dies

    monkeypatch.setattr(storage.Store, "put_file", recording_put)
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        summary = _train(tmp_path / "a", "train.max_steps=10", "checkpoint.every_steps=4", f"checkpoint.remote={url}",
                         "checkpoint.storage_options.retries=0")
    assert summary["steps"] == 10  # training went on and finished
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(m.startswith(f"checkpoint.remote: step-000000004 uploaded to {url}/step-000000004 (") and
               "after its local commit" in m for m in infos)  # size, speed and lag
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("upload of step-000000008" in w and "failed, not committed there" in w for w in warnings), warnings
    assert any("step-000000008, step-000000010 not uploaded" in w for w in warnings), warnings
    # the local tier is intact
    assert _local_steps(tmp_path / "a") == [4, 8, 10]
    assert all(layout.verify(p) == [] for _, p in layout.committed(tmp_path / "a" / "checkpoints"))
    # step 4 went up whole, its manifest last; of step 8 some files went up (those in flight), never its manifest
    step4 = [k for k in puts if k.startswith("step-000000004/")]
    assert step4[-1] == "step-000000004/manifest.json" and len(step4) == len(set(step4)) >= 3
    step8 = [k for k in puts if k.startswith("step-000000008/")]
    assert step8 and "step-000000008/manifest.json" not in step8


def test_wrong_credentials_exit_2_in_one_line_without_the_secret(tmp_path: Path, s3_private_server: S3Server,  # noqa: F811
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    for k, v in s3_private_server.env.items():
        monkeypatch.setenv(k, v)
    url = s3_private_server.bucket("tier-auth") + "/run"
    # from now on the server checks signatures: the test's key is in no account of it
    urllib.request.urlopen(urllib.request.Request(f"{s3_private_server.url}/moto-api/reset-auth", data=b"0",
                                                  headers={"Content-Type": "text/plain"}, method="POST"),
                           timeout=10).close()
    capfd.readouterr()
    code = cli_main(["train", *BASE, f"run.dir={tmp_path / 'a'}", f"checkpoint.remote={url}"])
    out, err = capfd.readouterr()
    assert code == 2
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("hpctrain train: error: ") and "credentials" in errors[0], err
    assert "InvalidAccessKeyId" in errors[0]
    assert SECRET_KEY not in out + err
    assert cli_main(["ckpt", "list", url]) == 2
    out, err = capfd.readouterr()
    assert len(err.splitlines()) == 1 and "credentials" in err and SECRET_KEY not in out + err


def test_two_ranks_sharded_upload_and_resume_from_the_tier(tmp_path: Path, s3_env: S3Server) -> None:  # noqa: F811
    """format=dcp on 2 gloo ranks: rank 0 uploads every rank's files; a new allocation's 2 ranks
    resume from the tier (rank 0 downloads, all load the checkpoint it chose) to the weights of an
    uninterrupted run."""
    url = s3_env.bucket("tier-ranks") + "/run"
    keys = [*BASE, "checkpoint.format=dcp", "train.epochs=1", "data.batch_size=8"]  # 8 a rank: 8 steps
    tier = [f"checkpoint.remote={url}"]
    cases = [("ref", keys), ("a", [*keys, "train.max_steps=6", "checkpoint.every_steps=3", *tier]),
             ("b", [*keys, *tier])]
    ranks = train_cases(2, cases, tmp_path, keep=("params_sha256", "steps"))
    assert ranks[0] == ranks[1]
    assert ranks[0]["a"]["steps"] == 6 and ranks[0]["b"] == ranks[0]["ref"]
    local = layout.read_manifest(tmp_path / "a" / "checkpoints" / layout.step_name(6))
    assert local["world_size"] == 2 and any(name.startswith("sharded/") for name in local["files"])
    uploaded = _remote_steps(s3_env, "tier-ranks", "run")
    assert uploaded[6] == set(local["files"]) | {layout.MANIFEST}
    assert _local_steps(tmp_path / "b")[0] == 6  # downloaded from the tier, then trained on


@pytest.mark.parametrize(("override", "says"), [
    ("checkpoint.remote=/shared/ckpts", "checkpoint.remote='/shared/ckpts' is not an s3://BUCKET/PREFIX URL; hint"),
    ("checkpoint.remote_keep_last=0", "checkpoint.remote_keep_last=0 must be >= 1"),
    ("checkpoint.storage_options.secret_key=abc", "checkpoint.storage_options.secret_key: credentials do not belong"),
    ("checkpoint.remote_queue=0", "checkpoint.remote_queue=0 must be >= 1"),
])
def test_bad_values_name_the_key(override: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["checkpoint.remote=s3://b/p", override])
    assert str(err.value).startswith(says) and "\n" not in str(err.value) and "abc" not in str(err.value)


class _GatedStore:
    """A store whose uploads wait for ``gate``: the uploader's queue fills while training goes on."""

    url = "s3://gated/run"

    def __init__(self) -> None:
        self.gate, self.objects = threading.Event(), {}

    def list(self, prefix: str = "") -> dict[str, int]:
        return {k: v for k, v in self.objects.items() if k.startswith(prefix)}

    def put_file(self, key: str, local: Path) -> None:
        assert self.gate.wait(30)
        self.objects[key] = Path(local).stat().st_size

    def delete(self, key: str) -> None:
        self.objects.pop(key, None)


def test_a_full_queue_drops_the_oldest_waiting_upload_not_a_keep_every_one(tmp_path: Path) -> None:
    for step in range(1, 5):
        partial = layout.partial_dir(tmp_path, step)
        partial.mkdir()
        (partial / "a.bin").write_bytes(b"x" * step)
        layout.commit(partial, tmp_path / layout.step_name(step), {"a.bin": layout.hash_file(partial / "a.bin")},
                      {"step": step})
    store = _GatedStore()
    uploader = remote.Uploader(store, keep_last=10, keep_every=2, queue=2)  # type: ignore[arg-type]
    uploader.submit(tmp_path / layout.step_name(1))
    while uploader.pending() != {1} or uploader._waiting:  # step 1 is uploading (held at the gate)
        time.sleep(0.01)
    for step in (2, 3, 4):
        uploader.submit(tmp_path / layout.step_name(step))
    assert uploader.pending() == {1, 2, 4}  # 3 made way for 4; 2 stays (keep_every=2); the local tier keeps these
    store.gate.set()
    assert uploader.close(30) == []
    assert uploader.stats.uploaded == [1, 2, 4] and uploader.stats.skipped == [3]
    assert sorted(k for k in store.objects if k.endswith(layout.MANIFEST)) == [
        f"{layout.step_name(s)}/{layout.MANIFEST}" for s in (1, 2, 4)]
