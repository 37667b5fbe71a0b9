"""Loggers write through their real libraries and the results are read back with them."""

from __future__ import annotations

import json
import logging
import struct
import sys
from pathlib import Path

import pytest

from hpctrain.core.errors import RunIOError
from hpctrain.telemetry.loggers import LoggerError, LoggerOptions, Loggers, build_loggers, scalars

ROWS = [{"step": s, "epoch": 0, "loss": 1.0 / s, "samples_per_s": 100.0 * s} for s in (1, 2, 3)]
STRAGGLER = {"step": 3, "kind": "straggler", "imbalance": 1.5, "stragglers": [1],
             "ranks": [{"rank": 0, "node": "n0", "work_s": 0.1, "relative": 1.0, "individual": 1.0},
                       {"rank": 1, "node": "n1", "work_s": 0.2, "relative": 0.5, "individual": 0.9}]}


def _options(**kw) -> LoggerOptions:
    return LoggerOptions(run_name="test-run", config={"optim": {"lr": 0.1}, "seed": 3}, **kw)


def _log_all(loggers: Loggers) -> None:
    for row in [*ROWS, STRAGGLER]:
        loggers.log(row)
    loggers.close()


def test_scalars_flatten_per_rank_series():
    flat = scalars(STRAGGLER)
    assert flat["straggler/imbalance"] == 1.5
    assert flat["straggler/rank1/relative"] == 0.5 and flat["straggler/rank0/work_s"] == 0.1
    assert "straggler/rank1/node" not in flat and scalars(ROWS[0]) == {"epoch": 0.0, "loss": 1.0,
                                                                        "samples_per_s": 100.0}


def test_jsonl_always_on_and_other_ranks_write_nothing(tmp_path):
    loggers = build_loggers([], tmp_path, _options())
    assert loggers.names == ["jsonl"]
    _log_all(loggers)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [*ROWS, STRAGGLER]
    other = tmp_path / "rank1"
    other.mkdir()
    assert build_loggers(["jsonl"], other, _options(), is_main=False).names == []
    assert not list(other.iterdir())


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_jsonl_on_a_full_disk_ends_the_run_naming_the_file(tmp_path, caplog):
    """metrics.jsonl is the run's record: a row that cannot be written is a RunIOError naming
    the file (exit 1), not a warning, and not an internal error (issue 17)."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC
    loggers = build_loggers([], tmp_path, _options())
    with pytest.raises(RunIOError, match=rf"cannot append a row to {tmp_path / 'metrics.jsonl'}: "
                                         r"No space left on device; hint: free space") as caught:
        loggers.log(ROWS[0])
    assert caught.value.exit_code == 1
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        loggers.close()  # the dropped file is not flushed again: no second error, no warning
    assert loggers.names == [] and caplog.records == []


def test_tensorboard_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_all(build_loggers(["tensorboard"], tmp_path, _options()))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(s, pytest.approx(1.0 / s)) for s in (1, 2, 3)]
    assert [e.value for e in acc.Scalars("straggler/rank1/relative")] == [0.5]


def test_mlflow_read_back_local_default(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    pytest.importorskip("sqlalchemy", reason="the local MLflow store needs sqlalchemy (the mlflow extra)")
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "run").mkdir()
    _log_all(build_loggers(["mlflow"], tmp_path / "run", _options()))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("hpctrain").experiment_id])[0]
    assert run.info.run_name == "test-run" and run.info.status == "FINISHED"
    assert run.data.params == {"optim.lr": "0.1", "seed": "3"}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, pytest.approx(1.0 / s)) for s in (1, 2, 3)]
    assert run.data.metrics["straggler/rank1/relative"] == 0.5


def _wandb_records(path):
    """Records of a W&B transaction log (.wandb): a 7-byte header, then LevelDB-style
    32 KiB blocks of chunks (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written outside tmp
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    _log_all(build_loggers(["wandb"], tmp_path, _options()))
    [log_file] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in _wandb_records(log_file) if r.HasField("history")]
    losses = [(h["_step"], h["loss"]) for h in history if "loss" in h]
    assert losses == [(s, pytest.approx(1.0 / s)) for s in (1, 2, 3)]
    assert any(h.get("straggler/rank1/relative") == 0.5 for h in history)


class _Broken:
    def __init__(self) -> None:
        self.calls = 0

    def log(self, row, step) -> None:
        self.calls += 1
        raise ConnectionError("server down")

    def close(self) -> None:
        raise ConnectionError("server down")


def test_failing_logger_warns_once_and_training_goes_on(tmp_path, caplog):
    broken = _Broken()
    loggers = Loggers([("jsonl", build_loggers([], tmp_path, _options()).backends[0][1]), ("mlflow", broken)])
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        _log_all(loggers)
    assert broken.calls == 1
    assert [r.message for r in caplog.records if "switched off" in r.message] != []
    assert len([r for r in caplog.records if "mlflow failed" in r.message]) == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_mlflow_server_down_does_not_stop_training(tmp_path, monkeypatch, caplog):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        loggers = build_loggers(["mlflow"], tmp_path, _options(mlflow_uri="http://127.0.0.1:9"))  # discard port
        _log_all(loggers)
    assert loggers.names == [] and any("mlflow could not start" in r.message for r in caplog.records)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_unknown_logger_and_missing_package_are_user_errors(tmp_path, monkeypatch):
    with pytest.raises(LoggerError, match="unknown.*neptune.*choose from jsonl, tensorboard, mlflow, wandb"):
        build_loggers(["neptune"], tmp_path, _options())
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(LoggerError, match=r"pip install 'hpctrain\[wandb\]'"):
        build_loggers(["wandb"], tmp_path, _options(), is_main=False)
