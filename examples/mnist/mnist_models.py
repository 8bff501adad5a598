"""The example's two networks: a small MLP (the default) and the CNN of the Deep Gradient
Compression MNIST experiments. Both take images as flat rows of 784 values in [0, 1]."""

from __future__ import annotations

from torch import nn

MODELS = ("mlp", "cnn")
"""The names ``make_model`` accepts."""


def make_mlp(hidden: int) -> nn.Module:
    """784 -> ``hidden`` -> ``hidden // 2`` -> 10, ReLU between layers."""
    return nn.Sequential(
        nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden // 2), nn.ReLU(),
        nn.Linear(hidden // 2, 10),
    )  # fmt: skip


def make_cnn() -> nn.Module:
    """Two 5x5 convolutions (32 and 64 filters, padding 2, so 28x28 stays 28x28 before each
    pooling), each followed by ReLU and 2x2 max-pooling, then a 1,024-unit dense layer with ReLU
    and dropout 0.5, and 10 outputs: 3,274,634 parameters, 98% of them in the dense layer."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)),  # the rows of 784 values are one-channel images
        nn.Conv2d(1, 32, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 14 x 14
        nn.Conv2d(32, 64, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # 64 x 7 x 7
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 1024), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(1024, 10),
    )  # fmt: skip


def make_model(name: str, hidden: int = 256) -> nn.Module:
    """The network called ``name`` (one of :data:`MODELS`); ``hidden`` sizes the MLP only."""
    if name == "mlp":
        return make_mlp(hidden)
    if name == "cnn":
        return make_cnn()
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
