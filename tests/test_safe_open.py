"""hpctrain.core.safe_open: the one bounded, non-blocking, size-checked regular-file open."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from hpctrain.core import safe_open
from hpctrain.core.safe_open import NotRegularError, TooLargeError, WrongSizeError


def test_reads_a_regular_file_whole_and_its_head(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    assert safe_open.read_regular(path, limit=10) == b"0123456789"
    assert safe_open.read_regular(path, limit=10, size=10) == b"0123456789"
    assert safe_open.read_head(path, 4) == b"0123"
    fh, size = safe_open.open_regular(path)
    with fh:
        assert size == 10 and safe_open.read_at_most(fh, 3) == b"012"


def test_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done: list[BaseException] = []

    def attempt() -> None:
        try:
            safe_open.read_regular(fifo, limit=1 << 20)
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            done.append(err)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(20)
    assert len(done) == 1 and isinstance(done[0], NotRegularError) and done[0].kind == "FIFO"


def test_refuses_devices_directories_and_wrong_sizes(tmp_path: Path) -> None:
    with pytest.raises(NotRegularError, match="character device"):
        safe_open.open_regular("/dev/zero")
    with pytest.raises(NotRegularError, match="directory"):
        safe_open.read_head(tmp_path, 10)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    with pytest.raises(TooLargeError) as big:
        safe_open.read_regular(path, limit=99)
    assert (big.value.size, big.value.limit) == (100, 99)
    with pytest.raises(WrongSizeError) as wrong:
        safe_open.open_regular(path, size=12)
    assert (wrong.value.size, wrong.value.expected) == (100, 12)
    with pytest.raises(ValueError):  # every refusal is a ValueError, so callers wrap one class
        safe_open.check_regular(path, limit=1)
    with pytest.raises(FileNotFoundError):
        safe_open.read_regular(tmp_path / "absent", limit=1)
