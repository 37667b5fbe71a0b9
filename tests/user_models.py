"""Tiny user models for tests, loaded as ``model.name=tests.user_models:NAME`` (shared by all tests)."""

from __future__ import annotations

from torch import nn


def tiny_mlp(num_classes: int = 10) -> nn.Module:
    """128 -> 32 -> classes, no dropout: runs on synthetic_tiny, deterministic across world sizes."""
    return nn.Sequential(nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, num_classes))


def tiny_linear(num_classes: int = 10) -> nn.Module:
    """One Linear 128 -> classes (the per-step overhead benchmark's model)."""
    return nn.Linear(128, num_classes)


class _Slow(nn.Module):
    """Sleeps in forward so a signal can be sent while training is surely still running."""

    def __init__(self, inner: nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x):  # noqa: ANN001, ANN201
        import time

        if self.training:
            time.sleep(self.seconds)
        return self.inner(x)


def slow_mlp(num_classes: int = 10) -> nn.Module:
    """tiny_mlp whose training forward takes >= 20 ms (same weights and results as tiny_mlp)."""
    return _Slow(tiny_mlp(num_classes), 0.02)


def straggler_mlp(num_classes: int = 10) -> nn.Module:
    """tiny_mlp whose training forward sleeps 30 ms on every rank, plus 270 ms more on the rank
    named by $HPCTRAIN_TEST_SLOW_RANK (none if unset): a straggler, or a balanced run. With two
    ranks the median is their mean (165 ms), so the straggler stands at 1.8x it: still over a
    threshold of 1.5 when load slows the other rank's steps by 70 ms (at 120 ms it was 1.6x, and
    15 ms of load hid it)."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    slow = os.environ.get("HPCTRAIN_TEST_SLOW_RANK")
    return _Slow(tiny_mlp(num_classes), 0.30 if slow is not None and int(slow) == rank else 0.03)


# ---------------------------------------------------------------- user models as users write them


def tiny_mlp_log_probs(num_classes: int = 10) -> nn.Module:
    """tiny_mlp ending in log_softmax (as the PyTorch MNIST example does): same parameter
    names and, under the same seed, the same initial weights as tiny_mlp."""
    return nn.Sequential(nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, num_classes), nn.LogSoftmax(dim=1))


def no_args() -> nn.Module:
    """A factory that takes nothing (10 classes, 128 inputs hard-coded)."""
    return tiny_mlp()


def channels_only(in_channels: int) -> nn.Module:
    """Takes only in_channels (required): hpctrain must pass it, and only it."""
    return nn.Linear(in_channels, 10)


def both_args(in_channels: int, num_classes: int) -> nn.Module:
    return nn.Linear(in_channels, num_classes)


def any_kwargs(**kwargs: int) -> nn.Module:
    """**kwargs accepts everything offered; records what it got."""
    model = nn.Linear(kwargs["in_channels"], kwargs["num_classes"])
    model.got = dict(kwargs)  # type: ignore[assignment]
    return model


class TinyNet(nn.Module):
    """An nn.Module subclass named directly as model.name; an extra argument with a default."""

    def __init__(self, num_classes: int = 10, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.body(x)


def needs_depth(depth: int) -> nn.Module:
    """A required argument hpctrain cannot supply."""
    return nn.Linear(128, depth)


def raises(num_classes: int = 10) -> nn.Module:
    raise RuntimeError("CUDA driver not found (simulated)")


def not_a_module(num_classes: int = 10) -> object:
    return {"weights": None}


def three_classes() -> nn.Module:
    """Ignores the dataset: 3 outputs where synthetic_tiny has 10 classes."""
    return tiny_mlp(3)


def softmax_probs(num_classes: int = 10) -> nn.Module:
    """Ends in softmax (probabilities): trains, but hpctrain warns."""
    return nn.Sequential(nn.Linear(128, num_classes), nn.Softmax(dim=1))


class _TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(128, 10)

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.fc(x), x


def tuple_output() -> nn.Module:
    return _TupleOut()


def token_classifier(num_classes: int = 10) -> nn.Module:
    """Integer token ids in (an embedding first): checked with input_dtype=torch.long."""
    return nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 16, num_classes))


class _Deadlocking(nn.Module):
    """A deadlock in user code: the training forward number ``at`` of rank ``rank`` takes a
    lock it already holds, in the first attempt only (a torchrun restart runs normally)."""

    def __init__(self, inner: nn.Module, rank: int, at: int) -> None:
        super().__init__()
        self.inner, self.rank, self.at, self.calls = inner, rank, at, 0

    def forward(self, x):  # noqa: ANN001, ANN201
        import os
        import threading

        if self.training and x.device.type != "meta":
            self.calls += 1
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if first_attempt and self.calls == self.at and int(os.environ.get("RANK", "0")) == self.rank:
                lock = threading.Lock()
                lock.acquire()
                lock.acquire()  # never returns
        return self.inner(x)


def deadlocking_mlp(num_classes: int = 10) -> nn.Module:
    """tiny_mlp that deadlocks on rank $HPCTRAIN_TEST_STALL_RANK (default 1) at its training
    forward $HPCTRAIN_TEST_STALL_AT (default 6), in the first attempt only."""
    import os

    return _Deadlocking(tiny_mlp(num_classes), int(os.environ.get("HPCTRAIN_TEST_STALL_RANK", "1")),
                        int(os.environ.get("HPCTRAIN_TEST_STALL_AT", "6")))
