"""A real S3-compatible endpoint for the tests: moto's server mode as a subprocess on a free port.

Every object-storage path (shards, indexes, manifests, checkpoint tiers) is tested against this
server over HTTP, as a site's MinIO or Ceph RGW would serve it; nothing is mocked in-process.

* ``s3_server`` (session fixture): one shared server; tests use their own bucket
  (``server.bucket("name")``) so they never see each other's objects.
* ``s3_private_server`` (function fixture): a server of the test's own, for tests that kill it
  mid-read or mid-upload (``server.kill()``) and start it again (``server.start()``; moto keeps
  no state across restarts, so a restarted server is empty).
* ``server.env``: the environment a rank needs (dummy credentials, ``AWS_ENDPOINT_URL``), as a
  user's job would get them from the standard sources boto3 reads.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

ACCESS_KEY = "hpctrain-test-key"
SECRET_KEY = "hpctrain-test-secret-do-not-print"
_RUNNING = re.compile(rb"Running on http://127\.0\.0\.1:(\d+)")


def _die_with_parent() -> None:
    """In the server's child, before exec: SIGKILL it when the test process dies (a crashed or
    killed pytest worker would otherwise leave the server running; Linux's PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG


class S3Server:
    """One moto server process; ``url`` is its endpoint once ``start()`` returned."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.url, "AWS_DEFAULT_REGION": "us-east-1",
                # no ~/.aws of the machine's user may leak into a test
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def start(self, timeout: float = 30.0) -> S3Server:
        # port 0: the kernel picks a free one, the server prints it (no race with other workers)
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        seen = b""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            seen += line
            m = _RUNNING.search(line)
            if m:
                self.url = f"http://127.0.0.1:{int(m.group(1))}"
                # drain the request log in the background so the pipe never fills and blocks the server
                import threading
                threading.Thread(target=self._drain, daemon=True).start()
                return self
        self.kill()
        raise RuntimeError(f"moto server did not start: {seen.decode(errors='replace')[-2000:]}")

    def _drain(self) -> None:
        proc = self.proc
        if proc is not None and proc.stdout is not None:
            for _ in proc.stdout:
                pass

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self) -> Any:
        import boto3
        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` (if absent) and return ``s3://name``."""
        c = self.client()
        try:
            c.create_bucket(Bucket=name)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        return f"s3://{name}"

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


def _serve() -> Iterator[S3Server]:
    pytest.importorskip("moto.server", reason="moto[server] is in the test extras")
    server = S3Server().start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    yield from _serve()


@pytest.fixture
def s3_private_server() -> Iterator[S3Server]:
    yield from _serve()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The shared server with its credentials and endpoint in this process's environment."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return s3_server
