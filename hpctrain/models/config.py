"""The ``model`` config section."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.section import ConfigError, opt, positive


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = opt("mnist_cnn", "Registered model (`hpctrain models`) or a user model as `package.module:NAME` (a factory or an nn.Module class).")
    num_classes: int | None = opt(None, "Output classes; default: taken from the dataset.")
    n_layers: int = opt(4, "gpt: transformer blocks.")
    hidden: int = opt(128, "gpt: model width (embedding size); a multiple of model.heads.")
    heads: int = opt(4, "gpt: attention heads per block.")
    seq_len: int = opt(128, "gpt: the longest context in tokens (learned positions); data.name=shakespeare is sharded at this length (a user factory's seq_len is the data's).")
    vocab: int | None = opt(None, "gpt and a user factory's vocab_size: vocabulary size; default: the data's for causal_lm (256 for byte-level text).")
    tie_weights: bool = opt(True, "gpt: share the token embedding with the output projection.")
    dropout: float = opt(0.0, "gpt: dropout after the embeddings, attention and MLP (0 = off).")
    use_model_loss: bool = opt(False, "A user model that computes its own loss from labels (Hugging Face style): "
                               "called as model(inputs, labels=...) in training, its output's `loss` is the training "
                               "loss (labels: the class ids; for causal_lm the inputs, which the model shifts). "
                               "Validation keeps the task's exact metrics on the logits.")

    def __post_init__(self) -> None:
        positive("model", self, "num_classes", "n_layers", "hidden", "heads", "seq_len", "vocab")
        if self.hidden % self.heads:
            raise ConfigError(f"model.hidden ({self.hidden}) must be divisible by model.heads ({self.heads}); "
                              f"hint: model.hidden={self.hidden // self.heads * self.heads or self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout!r} must be in [0, 1)")
