import pytest
import torch

from hpctrain.config import ConfigError
from hpctrain.models import REGISTRY, build_model, count_parameters


def test_simple_cnn_has_exactly_the_workshop_parameter_count():
    assert count_parameters(build_model("simple_cnn")) == 2_474_506


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_registered_models_run_on_their_input_shape(name):
    model = build_model(name, num_classes=7).eval()
    out = model(torch.zeros(2, *REGISTRY[name].input_shape))
    assert out.shape == (2, 7)


def test_mnist_cnn_matches_the_tutorial_layers():
    model = build_model("mnist_cnn")
    assert (model.conv1.out_channels, model.conv2.out_channels) == (32, 64)
    assert (model.fc1.in_features, model.fc1.out_features, model.fc2.out_features) == (9216, 128, 10)


def test_user_factory():
    model = build_model("tests.models:tiny_mlp", num_classes=3)
    assert model(torch.zeros(4, 128)).shape == (4, 3)


@pytest.mark.parametrize("name, hint", [("vgg", "registered"), ("tests.models:nope", "cannot load"),
                                        ("no_such_pkg.x:f", "cannot load")])
def test_bad_model_names(name, hint):
    with pytest.raises(ConfigError, match=hint):
        build_model(name)
