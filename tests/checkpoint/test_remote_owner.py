"""A checkpoint.remote prefix has one owner (issue 42, point 2), against the moto S3 server
(tests/s3_server.py): a second run is refused naming the owner, the same run continues from
another run directory once the owner has released the prefix, retention, uploads and resume
leave another run's checkpoints alone, and crafted or misnamed remote checkpoints are skipped
for the next intact one of either tier (and shown as such by ``hpctrain ckpt list/verify``)."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint import checksum, layout, remote, tier_owner
from hpctrain.checkpoint.checkpointer import Checkpointer
from hpctrain.checkpoint.state import rank_file
from hpctrain.checkpoint.tier_owner import TierOwnedError
from hpctrain.cli import main as cli_main
from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from tests.ckpt_models import make_parts
from tests.s3_server import S3Server, s3_env, s3_server  # noqa: F401

BASE = ["model.name=tests.ckpt_models:tiny_mlp", "data.name=synthetic_tiny", "data.synthetic_size=64",
        "data.batch_size=16", "data.max_val_samples=16", "train.epochs=1", "train.progress=false",
        "checkpoint.every_seconds=None", "train.threads=1"]


def _open(run_dir: Path, url: str, resume: str = "auto", *extra: str) -> tuple[Checkpointer, Any]:
    """A Checkpointer on ``url`` for a tiny model, resumed with ``resume`` (closed again if that raises)."""
    parts = make_parts()
    cfg = load_config(None, ["checkpoint.every_seconds=None", f"checkpoint.remote={url}", "checkpoint.keep_last=5",
                             *extra])
    ckpt = Checkpointer(run_dir, ClusterEnv(), torch.device("cpu"), cfg.checkpoint, parts.state())
    try:
        ckpt.resume(resume)
    except BaseException:
        ckpt.close()
        raise
    return ckpt, parts


def _save(ckpt: Checkpointer, parts: Any, steps: list[int]) -> None:
    """Save ``steps`` and wait until the uploader is idle again."""
    for step in steps:
        parts.counters.step = step
        ckpt.save({}, blocking=True)
    assert ckpt.remote is not None
    deadline = time.monotonic() + 60
    while ckpt.remote.uploader.pending() and time.monotonic() < deadline:
        time.sleep(0.02)


def _committed(url: str) -> list[int]:
    return [step for step, _ in remote.committed(remote.open_store(url))]


def _manifest(server: S3Server, bucket: str, key: str) -> dict[str, Any]:
    return json.loads(server.client().get_object(Bucket=bucket, Key=key)["Body"].read())


def _put_checkpoint(server: S3Server, bucket: str, prefix: str, name: str, files: dict[str, bytes],
                    manifest: dict[str, Any]) -> None:
    """Upload a (maybe crafted) checkpoint as an upload would: its files, then ``manifest`` with
    their right sizes and checksums unless it names its own."""
    client = server.client()
    algorithm = checksum.resolve(checksum.DEFAULT)
    entries = {file: checksum.hash_bytes(data, algorithm) for file, data in files.items()}
    for file, data in files.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}/{file}", Body=data)
    body = {**manifest, "files": {**entries, **manifest.get("files", {})}}
    client.put_object(Bucket=bucket, Key=f"{prefix}/{name}/{layout.MANIFEST}", Body=json.dumps(body).encode())


def _files(path: Path) -> dict[str, bytes]:
    return {f.relative_to(path).as_posix(): f.read_bytes() for f in sorted(path.rglob("*"))
            if f.is_file() and f.name != layout.MANIFEST}


def _info(path: Path, **changes: Any) -> dict[str, Any]:
    """The manifest of local checkpoint ``path`` without its files, with ``changes``."""
    manifest = layout.read_manifest(path)
    return {**{k: v for k, v in manifest.items() if k != "files"}, **changes}


def test_a_second_run_is_refused_naming_the_owner_and_the_same_run_continues(
        tmp_path: Path, s3_env: S3Server, capfd: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    url = s3_env.bucket("owner-one") + "/p"
    a, parts = _open(tmp_path / "a", url)
    _save(a, parts, [2, 4])
    owner = tier_owner.read_owner(remote.open_store(url))
    assert owner is not None and owner.run_id == a.run_id and not owner.released
    assert owner.run_dir == str((tmp_path / "a").resolve()) and owner.pid == os.getpid()
    keys = s3_env.keys("owner-one")
    # a new allocation (an empty run dir, resume=auto) while A still holds the prefix: two instances would fork it
    with pytest.raises(TierOwnedError) as err:
        _open(tmp_path / "b", url)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
    assert str(err.value).startswith(f"checkpoint.remote={url} is in use by run {a.run_id} (run.dir "
                                     f"{(tmp_path / 'a').resolve()} on host ")
    # a fresh start (resume=never) in another run dir: another run; `hpctrain train` exits 2 in one line
    with pytest.raises(TierOwnedError, match=rf"belongs to run {a.run_id} .*whose checkpoints this run did not "
                                             r"resume from: this run would delete its checkpoints"):
        _open(tmp_path / "c", url, "never")
    capfd.readouterr()
    assert cli_main(["train", *BASE, f"run.dir={tmp_path / 'c2'}", f"checkpoint.remote={url}", "resume=never"]) == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"hpctrain train: error: checkpoint.remote={url} belongs to "
                                                     f"run {a.run_id} (run.dir "), errors
    assert s3_env.keys("owner-one") == keys  # nothing written, uploaded or deleted by the refused ones
    assert not list((tmp_path / "b" / "checkpoints").iterdir())  # nor downloaded
    a.close()
    owner = tier_owner.read_owner(remote.open_store(url))
    assert owner is not None and owner.released
    # released: the new allocation continues A's run from the tier, under A's run id
    b, parts = _open(tmp_path / "b", url)
    assert b.resumed_from == tmp_path / "b" / "checkpoints" / "step-000000004" and b.run_id == a.run_id
    _save(b, parts, [6])
    b.close()
    assert layout.read_manifest(tmp_path / "b" / "checkpoints" / "step-000000006")["run_id"] == a.run_id
    assert _committed(url) == [2, 4, 6]
    # a run whose own checkpoints carry another run id is another run, released prefix or not
    parts = make_parts()
    cfg = load_config(None, ["checkpoint.every_seconds=None"])
    d = Checkpointer(tmp_path / "d", ClusterEnv(), torch.device("cpu"), cfg.checkpoint, parts.state())
    d.resume("auto")
    parts.counters.step = 3
    d.save({}, blocking=True)
    d.close()
    with pytest.raises(TierOwnedError, match=rf"belongs to run {a.run_id} .*while this run's checkpoints carry run "
                                             rf"id {d.run_id}"):
        _open(tmp_path / "d", url)
    assert _committed(url) == [2, 4, 6]


def test_retention_uploads_and_resume_leave_another_runs_checkpoints_alone(tmp_path: Path, s3_env: S3Server,  # noqa: F811
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    url = s3_env.bucket("owner-retention") + "/p"
    a, parts = _open(tmp_path / "a", url, "auto", "checkpoint.remote_keep_last=1")
    _save(a, parts, [2])
    mine = tmp_path / "a" / "checkpoints" / "step-000000002"
    other = "f" * 32
    for step in (1, 6):  # another run's checkpoints on the prefix (an older version let two runs share it)
        _put_checkpoint(s3_env, "owner-retention", "p", layout.step_name(step), _files(mine),
                        _info(mine, step=step, run_id=other))
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        _save(a, parts, [4, 6, 8])
    a.close()
    # retention removed this run's 2 and 4 (remote_keep_last=1), never the other run's 1 and 6; nor was 6 replaced
    assert _committed(url) == [1, 6, 8]
    assert _manifest(s3_env, "owner-retention", "p/step-000000006/manifest.json")["run_id"] == other
    assert any("step-000000006 is not uploaded" in m and "is another run's checkpoint" in m for m in caplog.messages)
    assert any("retention removed step-000000004" in m for m in caplog.messages)
    # a newer checkpoint of the other run is skipped at resume, with the reason: this run's step 8 is taken
    _put_checkpoint(s3_env, "owner-retention", "p", "step-000000010", _files(mine), _info(mine, step=10, run_id=other))
    caplog.clear()
    e, _ = _open(tmp_path / "e", url)
    e.close()
    assert e.resumed_from == tmp_path / "e" / "checkpoints" / "step-000000008" and e.run_id == a.run_id
    assert any(f"step-000000010 is skipped: {url}/step-000000010 is a checkpoint of run {other}, not of this run"
               in m for m in caplog.messages), caplog.messages


class _Payload:
    """Pickles as a call of ``os.system`` that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_crafted_and_misnamed_checkpoints_are_skipped_for_the_next_intact_one_of_either_tier(
        tmp_path: Path, s3_env: S3Server, caplog: pytest.LogCaptureFixture,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    url, bucket = s3_env.bucket("owner-crafted") + "/p", "owner-crafted"
    a, parts = _open(tmp_path / "a", url)
    _save(a, parts, [2, 4])
    a.close()
    four = tmp_path / "a" / "checkpoints" / "step-000000004"
    files, marker = _files(four), tmp_path / "PWNED"
    payload = io.BytesIO()
    torch.save(_Payload(marker), payload)
    crafted = {  # name -> (files, manifest), each newer than the intact step 4
        "step-000000006": ({**files, "x": b"1", "x/y": b"2"}, _info(four, step=6)),
        "step-000000007": ({**files, "a" * 300: b"1"}, _info(four, step=7)),
        "step-000000008": ({**files, rank_file(0): payload.getvalue()}, _info(four, step=8)),  # right hashes
        "step-000000099": (files, _info(four)),  # named 99, its manifest says step 4
    }
    for name, (content, manifest) in crafted.items():
        _put_checkpoint(s3_env, bucket, "p", name, content, manifest)
    # the new run dir holds a local checkpoint that is corrupt too (named 5, its manifest says 4)
    shutil.copytree(four, tmp_path / "b" / "checkpoints" / "step-000000005")
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        b, _ = _open(tmp_path / "b", url)
    b.close()
    assert b.resumed_from == tmp_path / "b" / "checkpoints" / "step-000000004" and b.counters.step == 4
    assert not marker.exists()  # refused without running it
    said = "\n".join(caplog.messages)
    for reason in [f"{url}/step-000000099 is skipped: step-000000099/manifest.json: the checkpoint is named "
                   "step-000000099 but its manifest says step 4",
                   "step-000000008 is corrupt and is skipped", "refused without running them",
                   f"{url}/step-000000007 is skipped: ", "longer than a file system holds",
                   f"{url}/step-000000006 is skipped: ", "names both 'x' and 'x/y'",
                   "step-000000005 is corrupt and is skipped: ", "named step-000000005 but its manifest says step 4"]:
        assert reason in said, reason
    capsys.readouterr()
    assert cli_main(["ckpt", "list", url]) == 1  # a row that is not intact
    rows = {r.split()[0]: r.split()[-1] for r in capsys.readouterr().out.splitlines()[1:] if r.startswith("step-")}
    assert rows == {"step-000000002": "committed", "step-000000004": "committed", "step-000000006": "CORRUPT",
                    "step-000000007": "CORRUPT", "step-000000008": "committed", "step-000000099": "CORRUPT"}
    for name, code in [("step-000000099", 1), ("step-000000007", 1), ("step-000000006", 1),
                       ("step-000000004", 0)]:
        assert cli_main(["ckpt", "verify", f"{url}/{name}"]) == code, name
        out = capsys.readouterr().out
        assert out.startswith(f"{url}/{name}: {'ok' if code == 0 else 'CORRUPT'}\n") and "Traceback" not in out, out
    assert not marker.exists()


def test_two_claims_at_the_same_moment_one_is_refused(s3_env: S3Server) -> None:  # noqa: F811
    """Two runs that both found no owner record (started in the same second) write theirs at once:
    reading it back after the settle time, exactly one finds its own and holds the prefix."""
    store = remote.open_store(s3_env.bucket("owner-race") + "/p")
    claims = [tier_owner.Claim(store, tier_owner.new_run_id(), f"/runs/{n}") for n in "ab"]
    barrier, refused = threading.Barrier(2), {}

    def take(claim: tier_owner.Claim) -> None:
        barrier.wait()
        try:
            claim.take(None)
        except TierOwnedError as err:
            refused[claim.run_id] = str(err)

    threads = [threading.Thread(target=take, args=(c,)) for c in claims]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    owner = tier_owner.read_owner(store)
    assert owner is not None and len(refused) == 1 and owner.run_id not in refused
    (loser,) = refused.values()
    assert loser.startswith(f"checkpoint.remote={store.url} was claimed at the same moment by run {owner.run_id} "
                            f"(run.dir {owner.run_dir} on host ")
    winner = next(c for c in claims if c.run_id == owner.run_id)
    assert winner.holds() and not next(c for c in claims if c is not winner).holds()
    winner.release()
    owner = tier_owner.read_owner(store)
    assert owner is not None and owner.released


def _owner(**changes: Any) -> tier_owner.Owner:
    fields = {"run_id": "r1", "run_dir": "/runs/a", "host": "n1", "pid": 7, "instance": "i1", "since": "t0",
              "renewed": 1000.0, "released": False, **changes}
    return tier_owner.Owner(**fields)


@pytest.mark.parametrize(("owner", "local_id", "run_dir", "resuming", "now", "outcome"), [
    (None, None, "/runs/b", True, 1000.0, "new"),  # no record: a fresh id
    (None, "r9", "/runs/b", False, 1000.0, "r9"),  # no record: the run directory's own id
    (_owner(), None, "/runs/a", False, 1000.0, "r1"),  # the record's run dir, before its first checkpoint (live)
    (_owner(), "r1", "/runs/a", True, 1000.0, "r1"),  # the same run dir restarted at once after a kill
    (_owner(), "r1", "/runs/b", True, 1000.0 + tier_owner.LEASE_S - 1, "in use by run r1"),  # a fork, live
    (_owner(), "r1", "/runs/b", True, 1000.0 + tier_owner.LEASE_S + 1, "r1"),  # a killed owner's hold lapsed
    (_owner(released=True), None, "/runs/b", True, 1001.0, "r1"),  # a new allocation after a clean end
    (_owner(released=True), None, "/runs/b", False, 1001.0, "belongs to run r1"),  # not resuming from the tier
    (_owner(released=True), "r2", "/runs/a", True, 1001.0, "belongs to run r1"),  # the run dir now holds run r2
])
def test_who_may_hold_the_prefix(owner: tier_owner.Owner | None, local_id: str | None, run_dir: str,
                                 resuming: bool, now: float, outcome: str) -> None:
    choose = tier_owner.choose_run
    if " " in outcome:
        with pytest.raises(TierOwnedError, match=f"^checkpoint.remote=s3://b/p (is {outcome}|{outcome}) \\(run.dir "
                                                 "/runs/a on host n1, pid 7, since t0; "):
            choose(owner, local_id=local_id, run_dir=run_dir, resuming=resuming, url="s3://b/p", now=now)
        return
    got = choose(owner, local_id=local_id, run_dir=run_dir, resuming=resuming, url="s3://b/p", now=now)
    assert len(got) == 32 if outcome == "new" else got == outcome


class _OneObject:
    """A store holding only an owner record of ``data``."""

    url = "s3://b/p"

    def __init__(self, data: bytes) -> None:
        self.data = data

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def size(self, key: str) -> int:
        return len(self.data)

    def read(self, key: str) -> bytes:
        return self.data


@pytest.mark.parametrize(("data", "says"), [
    (b"{not json", "it is not valid JSON"),
    (b"[1]", "it is not a JSON object"),
    (json.dumps({**_owner().__dict__, "pid": "7"}).encode(), "'pid' is \"7\", not a whole number"),
    (json.dumps({**_owner().__dict__, "released": 1}).encode(), "'released' is 1, not true or false"),
    (b" " * (tier_owner.MAX_OWNER_BYTES + 1), "more than the 65,536 bytes an owner record ever holds"),
])
def test_a_record_that_is_not_one_is_refused_naming_it(data: bytes, says: str) -> None:
    with pytest.raises(TierOwnedError) as err:
        tier_owner.read_owner(_OneObject(data))  # type: ignore[arg-type]
    message = str(err.value)
    assert message.startswith(f"checkpoint.remote: s3://b/p/{tier_owner.OWNER_KEY} is not an hpctrain owner record "
                              f"(") and says in message and "\n" not in message and err.value.exit_code == 2
