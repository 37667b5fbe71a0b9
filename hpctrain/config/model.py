"""The ``model`` config section."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpctrain.core.section import ConfigError, opt, positive

if TYPE_CHECKING:
    from hpctrain.config.parallel import ParallelConfig


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
    bias: bool = opt(True, "gpt: biases in every linear layer and layer norm (GPT-2's layout); false: none, as nanoGPT's bias=False (fewer tensors for the optimizer, a slightly faster step).")
    experts: int = opt(0, "llama: a mixture of experts: each block's SwiGLU MLP becomes this many expert MLPs behind a softmax top-k router (0 = dense MLP; >= 2); parallel.ep shards them over ranks (docs/parallel.md).")
    top_k: int = opt(2, "llama with model.experts: experts each token is routed to (1 <= top_k <= experts); with top_k > 1 the chosen experts' router weights are renormalized to sum to 1.")
    aux_loss_coef: float = opt(0.01, "llama with model.experts: weight of the load-balancing auxiliary loss (Switch Transformer's E * sum_e tokens_e * prob_e) added to the training loss (0 = off).")
    capacity_factor: float = opt(0.0, "llama with model.experts: 0 = dropless (every routed token is computed); > 0: each expert takes at most ceil(factor x tokens x top_k / experts) of a rank's micro-batch tokens, the rest of its assignments are dropped (the residual carries them).")
    shared_expert: bool = opt(False, "llama with model.experts: add one dense SwiGLU expert every token passes through (DeepSeek-MoE's shared expert), besides the routed ones.")
    input_shape: list[int] | None = opt(None, "A user's model under parallel.strategy=auto (and hpctrain plan): one sample's shape, e.g. [3, 224, 224] (a float tensor) or [2048] (token ids: a causal LM), to measure the model with on the meta device; registered models know theirs.")
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
        self._check_experts()
        if not self.bias and self.name != "gpt":  # a key another model would silently ignore is an error
            raise ConfigError(f"model.bias=false applies to model.name=gpt only (got model.name={self.name}); "
                              "hint: drop model.bias")

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
                              f"{max(d for d in range(1, min(self.kv_heads, self.heads) + 1) if self.heads % d == 0)}")
        if (self.hidden // self.heads) % 2:
            raise ConfigError(f"model.name=llama: the head width model.hidden / model.heads = {self.hidden // self.heads} "
                              "must be even (rotary embeddings turn pairs of features); hint: "
                              f"model.hidden={2 * self.hidden}")
        if self.dropout:
            raise ConfigError(f"model.dropout={self.dropout} applies to model.name=gpt; llama trains without "
                              "dropout; hint: drop model.dropout")

    def _check_experts(self) -> None:
        if not self.experts:
            given = "shared_expert" if self.shared_expert else "capacity_factor" if self.capacity_factor else None
            if given:
                raise ConfigError(f"model.{given} applies to a mixture of experts only (model.experts=0); hint: "
                                  f"set model.experts (e.g. 8), or drop model.{given}")
            return
        if self.name != "llama":
            raise ConfigError(f"model.experts applies to model.name=llama only (got model.name={self.name}); "
                              "hint: drop model.experts, or model.name=llama")
        if self.experts < 2:
            raise ConfigError(f"model.experts={self.experts} must be 0 (a dense MLP) or >= 2; hint: model.experts=8")
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"model.top_k={self.top_k} must be between 1 and model.experts ({self.experts}); "
                              f"hint: model.top_k={min(max(self.top_k, 1), self.experts)}")
        if self.aux_loss_coef < 0 or self.capacity_factor < 0:
            key = "aux_loss_coef" if self.aux_loss_coef < 0 else "capacity_factor"
            raise ConfigError(f"model.{key}={getattr(self, key)} must be >= 0; hint: model.{key}=0")


def check_experts(model: ModelConfig, parallel: ParallelConfig) -> None:
    """What a mixture of experts and expert parallelism need of each other and of the other
    dimensions (a ConfigError, exit 2): checked across the ``model`` and ``parallel`` sections."""
    ep = parallel.ep
    if ep > 1 and not model.experts:
        raise ConfigError(f"parallel.ep={ep} needs a mixture of experts; hint: model.name=llama model.experts=<a "
                          f"multiple of {ep}>, or parallel.ep=1")
    if ep > 1 and model.experts % ep:
        raise ConfigError(f"model.experts ({model.experts}) must be divisible by parallel.ep ({ep}): each rank "
                          f"holds whole experts; hint: parallel.ep={math.gcd(model.experts, ep)}")
    if ep > 1 and parallel.strategy != "fsdp":
        raise ConfigError(f"parallel.ep={ep} runs with parallel.strategy=fsdp (got {parallel.strategy}): FSDP shards "
                          "the other weights, expert parallelism the experts; hint: parallel.strategy=fsdp")
    if ep > 1 and (parallel.meta_init or parallel.cpu_offload):
        key = "meta_init" if parallel.meta_init else "cpu_offload"
        raise ConfigError(f"parallel.{key}=true with parallel.ep={ep} is not supported yet; hint: "
                          f"parallel.{key}=false")
    if model.experts and (parallel.tp > 1 or parallel.pp > 1 or getattr(parallel, "cp", 1) > 1):
        dim = "tp" if parallel.tp > 1 else "pp" if parallel.pp > 1 else "cp"
        raise ConfigError(f"model.experts with parallel.{dim}={getattr(parallel, dim)} is not supported yet (a "
                          f"mixture of experts runs with data and expert parallelism); hint: parallel.{dim}=1")
