"""The ``model`` config section."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.core.section import ConfigError, opt, positive


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = opt("mnist_cnn", "Registered model (`hpctrain models`) or a user model as `package.module:NAME` (a factory or an nn.Module class).")
    num_classes: int | None = opt(None, "Output classes; default: taken from the dataset.")
    n_layers: int = opt(4, "gpt, llama: transformer blocks.")
    hidden: int = opt(128, "gpt, llama: model width (embedding size); a multiple of model.heads.")
    heads: int = opt(4, "gpt, llama: attention (query) heads per block.")
    kv_heads: int | None = opt(None, "llama: key/value heads (grouped-query attention); a divisor of model.heads and, with parallel.tp, a multiple of tp; default: model.heads.")
    ffn_hidden: int | None = opt(None, "llama: SwiGLU MLP width; default: Llama's 8h/3 rounded up to a multiple of 256.")
    seq_len: int = opt(128, "gpt, llama: the longest context in tokens (gpt: learned positions; llama: rotary); data.name=shakespeare is sharded at this length (a user factory's seq_len is the data's).")
    vocab: int | None = opt(None, "gpt, llama and a user factory's vocab_size: vocabulary size; default: the data's for causal_lm (256 for byte-level text).")
    tie_weights: bool = opt(True, "gpt, llama: share the token embedding with the output projection.")
    dropout: float = opt(0.0, "gpt: dropout after the embeddings, attention and MLP (0 = off).")
    family: str | None = opt(None, "The model family whose parallel plans (tensor parallel, pipeline split, FSDP and activation-checkpoint units) the model gets: a registered name (gpt, llama, hf-llama) or your own as `package.module:FAMILY` (a hpctrain.models.family.ModelFamily; docs/models.md); default: found from the built model.")
    use_model_loss: bool = opt(False, "A user model that computes its own loss from labels (Hugging Face style): "
                               "called as model(inputs, labels=...) in training, its output's `loss` is the training "
                               "loss (labels: the class ids; for causal_lm the inputs, which the model shifts). "
                               "Validation keeps the task's exact metrics on the logits.")

    def __post_init__(self) -> None:
        positive("model", self, "num_classes", "n_layers", "hidden", "heads", "kv_heads", "ffn_hidden", "seq_len", "vocab")
        if self.hidden % self.heads:
            raise ConfigError(f"model.hidden ({self.hidden}) must be divisible by model.heads ({self.heads}); "
                              f"hint: model.hidden={self.hidden // self.heads * self.heads or self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout!r} must be in [0, 1)")
        self._check_llama_keys()

    def _check_llama_keys(self) -> None:
        if self.name != "llama":  # a key another model would silently ignore is an error
            given = [key for key in ("kv_heads", "ffn_hidden") if getattr(self, key) is not None]
            if given:
                raise ConfigError(f"model.{given[0]} applies to model.name=llama only (got model.name={self.name}); "
                                  f"hint: drop model.{given[0]}, or model.name=llama")
            return
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ConfigError(f"model.kv_heads ({self.kv_heads}) must divide model.heads ({self.heads}): each "
                              "key/value head serves a whole group of query heads; hint: model.kv_heads="
                              f"{max(d for d in range(1, self.kv_heads + 1) if self.heads % d == 0)}")
        if (self.hidden // self.heads) % 2:
            raise ConfigError(f"model.name=llama: the head width model.hidden / model.heads = {self.hidden // self.heads} "
                              "must be even (rotary embeddings turn pairs of features); hint: "
                              f"model.hidden={2 * self.hidden}")
        if self.dropout:
            raise ConfigError(f"model.dropout={self.dropout} applies to model.name=gpt; llama trains without "
                              "dropout; hint: drop model.dropout")
