"""Small user models that return what real ones do: a tuple, a dict, a ``ModelOutput``, their
own loss from labels, or a language model's logits of the wrong shape (``model.name=`` targets)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, V), wrapped as ``wrap`` says; with ``labels`` (the
    inputs, Hugging Face style: shifted here) a dict output also carries the loss."""

    def __init__(self, vocab_size: int, wrap: str = "tensor") -> None:
        super().__init__()
        self.wrap = wrap
        self.emb = nn.Embedding(vocab_size, 16)
        self.head = nn.Linear(16, vocab_size)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None):  # noqa: ANN201
        logits = self.head(torch.tanh(self.emb(tokens)))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        if self.wrap == "tuple":
            return logits, logits.detach()  # (logits, something else): the first element is read
        if self.wrap == "dict":
            return {"loss": loss, "logits": logits} if loss is not None else {"logits": logits}
        if self.wrap == "output":
            from transformers.modeling_outputs import CausalLMOutput

            return CausalLMOutput(loss=loss, logits=logits)
        if self.wrap == "last":
            return logits[:, -1]  # the classic mistake: the last position only, (B, V)
        return logits


def tuple_lm(vocab_size: int) -> nn.Module:
    return TinyLM(vocab_size, "tuple")


def dict_lm(vocab_size: int) -> nn.Module:
    return TinyLM(vocab_size, "dict")


def output_lm(vocab_size: int) -> nn.Module:
    return TinyLM(vocab_size, "output")


def last_position_lm(vocab_size: int) -> nn.Module:
    return TinyLM(vocab_size, "last")


def small_vocab_lm() -> nn.Module:
    return TinyLM(100)  # below the byte-level data's 256 token ids


class DictClassifier(nn.Module):
    """Features -> ``{"logits": (B, C)}``; with class-id ``labels`` also the mean cross-entropy
    (padding labels -100 skipped), times ``scale`` so a test can tell whose loss trained."""

    def __init__(self, num_classes: int = 10, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self.net = nn.Sequential(nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        if labels is None:
            return {"logits": logits}
        return {"logits": logits, "loss": self.scale * F.cross_entropy(logits, labels, ignore_index=-100)}


def dict_classifier(num_classes: int = 10) -> nn.Module:
    return DictClassifier(num_classes)


class _IgnoresLabels(nn.Linear):
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


def lossless_classifier(num_classes: int = 10) -> nn.Module:
    """Takes labels but returns logits only: under model.use_model_loss=true the check refuses it."""
    return _IgnoresLabels(128, num_classes)


class _HiddenOnly(nn.Linear):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"hidden": super().forward(x)}


def hidden_only(num_classes: int = 10) -> nn.Module:
    """A dict without `logits`: nothing for the task to read."""
    return _HiddenOnly(128, num_classes)


FORWARDS: list[str] = []  # the device of every forward of recording_lm


class _RecordingLM(TinyLM):
    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None):  # noqa: ANN201
        FORWARDS.append(tokens.device.type)
        return super().forward(tokens, labels)


def recording_lm(vocab_size: int) -> nn.Module:
    return _RecordingLM(vocab_size)


def token_classes() -> dict:
    """``data.name=tests.models.output_models:token_classes``: 16 token ids (int64, below 100) per
    sample, the class (3) by which third of the vocabulary the first token falls in: integer
    inputs for a BERT-style classifier, as users' own datasets hold them."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 99, (96, 16), generator=gen)
    labels = ids[:, 0] // 33
    data = torch.utils.data
    dataset = data.TensorDataset(ids, labels)
    return {"train": data.Subset(dataset, range(64)), "val": data.Subset(dataset, range(64, 96)), "num_classes": 3}
