from pathlib import Path

import pytest

from hpctrain.config import ConfigError, check_world, load_config, reference_markdown, to_yaml

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_and_overrides():
    cfg = load_config(None, ["optim.lr=0.05", "data.batch_size=32", "precision=bf16", "train.max_steps=7"])
    assert cfg.optim.lr == 0.05 and cfg.data.batch_size == 32
    assert cfg.precision == "bf16" and cfg.train.max_steps == 7
    assert cfg.model.name == "mnist_cnn" and cfg.data.name == "mnist"


def test_yaml_then_overrides(tmp_path):
    file = tmp_path / "job.yaml"
    file.write_text("seed: 3\noptim:\n  lr: 0.2\n  name: adamw\ndata:\n  batch_size: 16\n")
    cfg = load_config(file, ["optim.lr=1e-3"])
    assert cfg.seed == 3 and cfg.optim.name == "adamw" and cfg.data.batch_size == 16
    assert cfg.optim.lr == pytest.approx(1e-3)  # YAML reads 1e-3 as a string; accepted as float


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.batchsize=3"])
    message = str(err.value)
    assert "data.batchsize" in message
    for valid in ("batch_size", "num_workers", "max_train_samples"):
        assert valid in message


def test_unknown_section_lists_sections():
    with pytest.raises(ConfigError, match="valid keys: .*optim.*train"):
        load_config(None, ["optimizer.lr=1"])


@pytest.mark.parametrize("override, key", [
    ("optim.lr=fast", "optim.lr"), ("data.batch_size=1.5", "data.batch_size"),
    ("train.compile=maybe", "train.compile"), ("optim.betas=0.9", "optim.betas"),
])
def test_wrong_type_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize("override, hint", [
    ("precision=fp4", "fp32, bf16, fp16, fp8"), ("data.batch_size=0", "must be > 0"),
    ("train.grad_accum=-1", "must be > 0"), ("optim.min_lr_ratio=2", "within"),
])
def test_bad_values_explained(override, hint):
    with pytest.raises(ConfigError, match=hint):
        load_config(None, [override])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["optim.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_world_size_check_names_the_numbers():
    cfg = load_config(None, ["data.max_train_samples=100", "data.batch_size=32", "train.grad_accum=2"])
    check_world(cfg, 1)
    with pytest.raises(ConfigError, match=r"data.batch_size \(32\) x world_size \(2\)"):
        check_world(cfg, 2)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["optim.betas=[0.8,0.9]", "train.clip_grad_norm=1"])
    file = tmp_path / "resolved.yaml"
    file.write_text(to_yaml(cfg))
    assert load_config(file) == cfg


def test_docs_config_reference_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == reference_markdown(), \
        "regenerate: hpctrain config doc > docs/config.md"


def test_text_fields_keep_override_text_verbatim(tmp_path):
    cfg = load_config(None, ["data.stage_dir=off", "run.dir=123", "data.path=null", "resume=never"])
    assert cfg.data.stage_dir == "off" and cfg.run.dir == "123" and cfg.data.path is None
    file = tmp_path / "job.yaml"
    file.write_text("data:\n  stage_dir: off\n")
    with pytest.raises(ConfigError, match="quote it"):
        load_config(file)


# ---------------------------------------------------------------- sections next to their components


def test_sections_are_frozen_and_keyword_only():
    import dataclasses

    from hpctrain.config.data import DataConfig

    cfg = load_config(None, ["data.batch_size=8"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.batch_size = 9  # type: ignore[misc]
    with pytest.raises(TypeError):
        DataConfig("mnist")  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"data\.batch_size=0 must be > 0"):
        DataConfig(batch_size=0)  # a section checks itself, also when built by hand


def test_none_words_are_read_as_none_not_rewritten_later():
    for text in ("None", "null", "off"):
        assert load_config(None, [f"checkpoint.every_seconds={text}"]).checkpoint.every_seconds is None
    assert load_config(None, ["data.stage_dir=none"]).data.stage_dir == "none"  # a text field keeps its text


# ---------------------------------------------------------------- data.global_batch_size


@pytest.mark.parametrize("world, micro, accum", [(1, 8, 4), (2, 8, 2), (4, 8, 1), (8, 4, 1), (3, None, None)])
def test_global_batch_is_split_into_equal_micro_batches(world, micro, accum):
    from hpctrain.config import for_world

    cfg = load_config(None, ["data.global_batch_size=32", "data.batch_size=8"])
    if micro is None:
        with pytest.raises(ConfigError, match=r"data.global_batch_size \(32\) is not a multiple of world_size \(3\)"):
            for_world(cfg, world)
        return
    run = for_world(cfg, world)
    assert (run.data.batch_size, run.train.grad_accum) == (micro, accum)
    assert run.data.batch_size * run.train.grad_accum * world == 32
    assert cfg.data.batch_size == 8 and cfg.train.grad_accum == 1  # the given config is untouched
    assert for_world(run, world) is run  # resolving twice changes nothing


def test_global_batch_micro_batches_never_exceed_batch_size():
    from hpctrain.config import for_world

    run = for_world(load_config(None, ["data.global_batch_size=48", "data.batch_size=20"]), 2)
    assert (run.data.batch_size, run.train.grad_accum) == (12, 2)  # 24 per rank: 2 x 12, not 20 + 4
    without = load_config(None, ["data.batch_size=8", "train.grad_accum=3"])
    assert for_world(without, 4) is without


def test_global_batch_and_grad_accum_are_not_both_set():
    with pytest.raises(ConfigError, match="leave train.grad_accum at 1"):
        load_config(None, ["data.global_batch_size=32", "train.grad_accum=2"])
    with pytest.raises(ConfigError, match=r"data.max_train_samples \(16\) is smaller than one global batch"):
        check_world(load_config(None, ["data.global_batch_size=32", "data.max_train_samples=16"]), 2)


def test_config_cli_exit_codes(tmp_path):
    from hpctrain.cli import main

    assert main(["config", "show", "data.global_batch_size=32"]) == 0
    assert _exit_code(main, ["config", "show", "data.batchsize=3"]) == 2
    assert _exit_code(main, ["config", "show", "data.global_batch_size=0"]) == 2
    assert _exit_code(main, ["config", "show", str(tmp_path / "missing.yaml")]) == 2


def _exit_code(main, argv):
    try:
        return main(argv)
    except SystemExit as exc:  # argparse and the CLI's error path exit through SystemExit
        return exc.code


def test_the_default_run_dir_is_one_folder_whatever_the_names() -> None:
    """data.name / model.name may be a file source or an import path: each names one folder."""
    from hpctrain.core.rundir import resolve_run_dir

    cfg = load_config(None, ["data.name=csv:data/x.csv", "model.name=tests.user_models:tiny_mlp"])
    assert resolve_run_dir(cfg.run.dir, cfg) == Path("runs/csv-data-x.csv-tests.user_models-tiny_mlp")
    cfg = load_config(None, ["run.dir=/scratch/{model.name}/seed{seed}"])
    assert resolve_run_dir(cfg.run.dir, cfg) == Path(f"/scratch/mnist_cnn/seed{cfg.seed}")


def test_an_import_path_is_found_in_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hpctrain train model.name=mynet:Net` from the directory holding mynet.py, as `python -m`
    would find it (the console script does not put the current directory on sys.path)."""
    import sys

    from hpctrain.core.section import load_import_path

    (tmp_path / "hpctrain_test_here_mod.py").write_text("def make():\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_import_path("model.name", "hpctrain_test_here_mod:make")() == 42
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_anywhere'"):
        load_import_path("model.name", "no_such_module_anywhere:make")
