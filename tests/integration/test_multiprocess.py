"""End to end with real processes: 4 workers x 2 servers started by kvstore-launch.

Keys of several sizes (a 1,500,000-element key split over both servers, lengths that are not
multiples of 16), int and str keys. Checked against closed forms (dense sums), the 2-bit numpy
reference (compressed rounds with residuals carried; itself checked against the per-element
oracle in tests/unit), numpy (server-side SGD with momentum),
the sum of all pushes (dist_async), and the same scenarios in ``local`` mode in this process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scenario_worker as sw

from kvstore.codecs import twobit

pytestmark = pytest.mark.integration

N, S = 4, 2
SCRIPT = str(Path(sw.__file__).resolve())
f32 = np.float32


def launch(
    name: str, outdir: Path, n: int = N, s: int = S, env: dict[str, str] | None = None
) -> list[dict[str, np.ndarray]]:
    """Run scenario ``name`` with ``kvstore-launch`` (``env``: its environment, else ours)."""
    command = [sys.executable, "-m", "kvstore.deploy", "-n", str(n), "-s", str(s)]
    command += ["--server-threads", "2", "--", sys.executable, SCRIPT, name, str(outdir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return [dict(np.load(outdir / f"{name}_rank{r}.npz")) for r in range(n)]


def run_local(name: str, outdir: Path) -> list[dict[str, np.ndarray]]:
    assert sw.main(["scenario_worker", name, str(outdir), "local"]) == 0
    return [dict(np.load(outdir / f"{name}_rank0.npz"))]


def check_dense(results: list[dict[str, np.ndarray]]) -> None:
    n = len(results)
    for saved in results:
        for key, shape in sw.DENSE_KEYS.items():
            np.testing.assert_array_equal(saved[f"init/{key}"], sw.init_value(key, shape, 0))
            for step in range(sw.STEPS):
                # worker r pushes (r + 1) * b: the round's sum is N(N+1)/2 * b
                expected = (n * (n + 1) // 2) * sw.dense_push(key, shape, step, 0)
                np.testing.assert_array_equal(saved[f"{step}/{key}"], expected, err_msg=str(key))


def check_twobit(results: list[dict[str, np.ndarray]]) -> None:
    n = len(results)
    t = sw.THRESHOLD
    expected: dict[str, list[np.ndarray]] = {}
    for key, shape in sw.TWOBIT_KEYS.items():
        residual = np.zeros(int(np.prod(shape)), np.float32)  # every worker's residual
        expected[key] = []
        for step in range(sw.STEPS):
            grad = sw.twobit_grad(key, shape, step, None).ravel()
            words = twobit.encode(grad, residual, t, kernels="numpy")
            expected[key].append(f32(n) * twobit.decode(words, grad.size, t, kernels="numpy"))
    key, shape = sw.MIXED_KEY
    residuals = [np.zeros(int(np.prod(shape)), np.float32) for _ in range(n)]
    expected[key] = []
    for step in range(sw.STEPS):
        total = np.zeros(int(np.prod(shape)), np.float32)
        for rank in range(n):
            grad = sw.twobit_grad(key, shape, step, rank).ravel()
            words = twobit.encode(grad, residuals[rank], t, kernels="numpy")
            total += twobit.decode(words, grad.size, t, kernels="numpy")
        expected[key].append(total)
    for saved in results:
        for key, per_step in expected.items():
            for step, values in enumerate(per_step):
                pulled = saved[f"{step}/{key}"].ravel()
                np.testing.assert_array_equal(pulled, values, err_msg=f"{key} step {step}")


def check_sgd(results: list[dict[str, np.ndarray]]) -> None:
    n = len(results)
    lr, momentum, wd, rescale = f32(sw.LR), f32(0.875), f32(0.0625), f32(1.0 / n)
    for key, shape in sw.SGD_KEYS.items():
        weight = sw.init_value(key, shape, 0)
        mom = np.zeros(shape, np.float32)
        for step in range(sw.STEPS):
            grad = sum(sw.exact_grad(key, shape, step, r) for r in range(n))
            mom = momentum * mom - (lr * wd) * weight - lr * (rescale * grad)
            weight = weight + mom
            for saved in results:
                np.testing.assert_allclose(saved[f"{step}/{key}"], weight, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_dense_sync_sums(tmp_path):
    check_dense(launch("dense", tmp_path))


@pytest.mark.slow
def test_twobit_rounds_match_the_reference(tmp_path):
    check_twobit(launch("twobit", tmp_path))


@pytest.mark.slow
def test_server_side_sgd_with_momentum(tmp_path):
    check_sgd(launch("sgd", tmp_path))


@pytest.mark.slow
def test_dist_async_ends_at_the_sum_of_all_pushes(tmp_path):
    results = launch("async", tmp_path)
    for key, shape in sw.ASYNC_KEYS.items():
        total = sum(
            sw.exact_grad(key, shape, step, rank)
            for step in range(sw.STEPS + 2)
            for rank in range(N)
        )
        expected = sw.init_value(key, shape, 0) - f32(sw.LR) * total
        for saved in results:
            np.testing.assert_array_equal(saved[f"final/{key}"], expected)


@pytest.mark.parametrize(
    "name, check", [("dense", check_dense), ("twobit", check_twobit), ("sgd", check_sgd)]
)
def test_local_mode_gives_the_same_results_in_one_process(tmp_path, name, check):
    check(run_local(name, tmp_path))
