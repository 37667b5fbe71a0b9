import logging

import pytest
import torch
import torch.nn.functional as F

from hpctrain.config import load_config
from hpctrain.core.env import ClusterEnv
from hpctrain.core.errors import UserError
from hpctrain.models import REGISTRY, ModelError, build_model, count_parameters
from hpctrain.parallel import unwrap
from hpctrain.train import build_components, fit, load_data, seed_everything

CPU = torch.device("cpu")
TINY = (128,)  # synthetic_tiny's sample shape


def test_simple_cnn_has_exactly_the_workshop_parameter_count():
    assert count_parameters(build_model("simple_cnn")) == 2_474_506


@pytest.mark.parametrize("name", sorted(n for n, s in REGISTRY.items() if s.input_dtype == torch.float32))
def test_registered_models_run_on_their_input_shape(name):  # token models (gpt): tests/models/tests/models/test_gpt.py
    model = build_model(name, num_classes=7, input_shape=REGISTRY[name].input_shape).eval()
    out = model(torch.zeros(2, *REGISTRY[name].input_shape))
    assert out.shape == (2, 7)


def test_mnist_cnn_matches_the_tutorial_layers():
    model = build_model("mnist_cnn")
    assert (model.conv1.out_channels, model.conv2.out_channels) == (32, 64)
    assert (model.fc1.in_features, model.fc1.out_features, model.fc2.out_features) == (9216, 128, 10)


@pytest.mark.parametrize("name, classes", [
    ("tests.user_models:tiny_mlp", 3),        # num_classes only
    ("tests.user_models:no_args", 10),        # nothing
    ("tests.user_models:channels_only", 10),  # in_channels only (required)
    ("tests.user_models:both_args", 5),       # both
    ("tests.user_models:any_kwargs", 4),      # **kwargs
    ("tests.user_models:TinyNet", 6),         # an nn.Module subclass, with an extra defaulted argument
])
def test_user_models_get_only_the_arguments_they_accept(name, classes):
    model = build_model(name, num_classes=classes, input_shape=TINY)
    assert model(torch.zeros(4, 128)).shape == (4, classes)


def test_token_models_are_checked_with_integer_inputs():
    model = build_model("tests.user_models:token_classifier", 4, input_shape=(16,), input_dtype=torch.long)
    assert model(torch.ones(3, 16, dtype=torch.long)).shape == (3, 4)
    with pytest.raises(ModelError, match="does not run"):  # float zeros cannot index an embedding
        build_model("tests.user_models:token_classifier", 4, input_shape=(16,))


def test_a_tuple_output_passes_the_check_with_its_first_element():
    model = build_model("tests.user_models:tuple_output", 10, input_shape=TINY)
    assert model(torch.zeros(2, 128))[0].shape == (2, 10)


def test_kwargs_factory_receives_both_arguments():
    got = build_model("tests.user_models:any_kwargs", 4, input_shape=TINY).got
    assert got == {"num_classes": 4, "in_channels": 128}


@pytest.mark.parametrize("name, shape, hint", [
    ("vgg", TINY, "is not registered"),
    ("tests.user_models:nope", TINY, "has no 'nope'"),
    ("no_such_pkg.x:f", TINY, "cannot import 'no_such_pkg.x'"),
    ("tests.user_models:", TINY, "package.module:NAME"),
    ("tests.user_models:__doc__", TINY, "is a str, not a factory"),
    ("tests.user_models:needs_depth", TINY, "requires 'depth'"),
    ("tests.user_models:raises", TINY, "raised RuntimeError: CUDA driver not found"),
    ("tests.user_models:not_a_module", TINY, "returned a dict, not a torch.nn.Module"),
    ("tests.user_models:three_classes", TINY, r"returned shape \(2, 3\) .* task classification expects \(2, 10\)"),
    ("tests.models.output_models:hidden_only", TINY, r"a dict with keys \['hidden'\]; expected logits"),
    ("tests.user_models:tiny_mlp", (3, 32, 32), r"does not run on the data's input shape \(3, 32, 32\)"),
    ("mnist_cnn", (3, 32, 32), "does not run on"),
])
def test_wrong_models_are_user_errors_naming_model_name(name, shape, hint):
    with pytest.raises(ModelError, match=hint) as info:
        build_model(name, num_classes=10, input_shape=shape)
    assert isinstance(info.value, UserError) and f"model.name={name!r}" in str(info.value)


def test_the_check_changes_no_state():
    """The dummy forward leaves weights, BatchNorm statistics, the RNG and the mode as they were."""
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    model = build_model("simple_cnn", input_shape=(3, 32, 32))
    after_build = torch.get_rng_state()
    torch.manual_seed(0)
    plain = build_model("simple_cnn")
    assert torch.equal(after_build, torch.get_rng_state()) and not torch.equal(rng, after_build)
    assert model.training
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_softmax_outputs_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        build_model("tests.user_models:softmax_probs", input_shape=TINY)
    assert "seems to end in softmax" in caplog.text


def test_cross_entropy_on_log_probs_is_nll_loss_with_the_same_gradient():
    """The documented convention: F.cross_entropy takes logits and log-probabilities alike."""
    torch.manual_seed(0)
    z = (torch.randn(64, 10, dtype=torch.float64) * 5).requires_grad_()
    t = torch.randint(0, 10, (64,))
    log_probs = F.log_softmax(z, dim=1)
    assert torch.allclose(torch.logsumexp(log_probs, 1), torch.zeros(64, dtype=torch.float64), atol=1e-12)
    on_logits, on_log_probs = F.cross_entropy(z, t), F.cross_entropy(log_probs, t)
    assert torch.allclose(on_log_probs, F.nll_loss(log_probs, t), atol=1e-12)
    assert torch.allclose(on_logits, on_log_probs, atol=1e-12)
    g_logits, = torch.autograd.grad(on_logits, z)
    g_log_probs, = torch.autograd.grad(on_log_probs, z)
    assert torch.allclose(g_logits, g_log_probs, atol=1e-12)


def _train(model_name: str) -> tuple[dict[str, torch.Tensor], float]:
    cfg = load_config(None, [f"model.name={model_name}", "data.name=synthetic_tiny", "data.synthetic_size=512",
                             "data.batch_size=16", "train.max_steps=12", "train.progress=false",
                             "train.eval_each_epoch=false", "optim.lr=0.2"])
    env = ClusterEnv()
    parts = build_components(cfg, env, CPU, load_data(cfg, env, CPU))
    seed_everything(cfg.seed)
    fit(cfg, env, CPU, parts)
    from hpctrain.evaluation.evaluate import evaluate

    res = evaluate(parts.model, parts.val_loader, parts.metrics, env, CPU, parts.precision)
    return unwrap(parts.model).state_dict(), res.metrics["loss"]


def test_logits_and_log_softmax_models_train_to_the_same_weights():
    logits_state, logits_loss = _train("tests.user_models:tiny_mlp")
    log_probs_state, log_probs_loss = _train("tests.user_models:tiny_mlp_log_probs")
    assert logits_state.keys() == log_probs_state.keys()
    for name, tensor in logits_state.items():
        assert torch.allclose(tensor, log_probs_state[name], atol=1e-5), name
    assert abs(logits_loss - log_probs_loss) < 1e-5
    initial = build_model("tests.user_models:tiny_mlp")  # and training did move the weights
    assert not torch.allclose(initial.state_dict()["0.weight"], logits_state["0.weight"], atol=1e-3)
