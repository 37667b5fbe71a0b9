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
    ("precision=fp8", "fp32, bf16, fp16"), ("data.batch_size=0", "must be > 0"),
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
