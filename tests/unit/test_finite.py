"""Counting NaN and infinities (kvstore.codecs.finite): the compiled kernel, the numpy
reference and numpy's own isfinite agree on every float dtype, with every kind of bad value."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.codecs.finite import count_nonfinite

LENGTHS = [0, 1, 15, 16, 17, 1000, 4097, 65_537]


def _specials(dtype: np.dtype) -> np.ndarray:
    info = np.finfo(dtype)
    unsigned = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    exponent = {2: 0x7C00, 4: 0x7F80_0000, 8: 0x7FF0_0000_0000_0000}[dtype.itemsize]
    quiet = {2: 0x0200, 4: 0x0040_0000, 8: 0x0008_0000_0000_0000}[dtype.itemsize]
    # NaNs with other payloads and signs: the signalling NaN and a negative one
    odd_nans = np.array([exponent | 1, exponent | quiet | 5], unsigned).view(dtype)
    return np.concatenate(
        [
            np.array([np.nan, np.inf, -np.inf, -np.nan], dtype),
            odd_nans,
            -odd_nans,
            np.array([0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_subnormal], dtype),
        ]
    )


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_counts_match_isfinite(dtype, kernels):
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(7)
    specials = _specials(dtype)
    for n in LENGTHS:
        with np.errstate(over="ignore"):
            x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-5, 5, n)).astype(dtype)
        if n:
            spots = rng.integers(0, n, size=min(n, 12))
            x[spots] = rng.choice(specials, size=spots.size)
        expected = int(np.count_nonzero(~np.isfinite(x)))
        assert count_nonfinite(x, kernels=kernels) == expected, (n, x[~np.isfinite(x)])


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_finite_extremes_and_integers_count_zero(kernels):
    for dtype in ["float16", "float32", "float64"]:
        info = np.finfo(dtype)
        x = np.array([info.max, -info.max, info.tiny, -0.0, info.smallest_subnormal], dtype)
        assert count_nonfinite(x, kernels=kernels) == 0
    for dtype in ["int32", "int64"]:
        x = np.array([-1, 0x7F80_0000, 0x7FFF_FFFF], dtype)  # NaN's bits, as integers
        assert count_nonfinite(x, kernels=kernels) == 0


def test_the_environment_picks_the_kernel(monkeypatch):
    x = np.array([1.0, np.nan], np.float32)
    for name in ("numba", "numpy"):
        monkeypatch.setenv("KVSTORE_CPU_KERNELS", name)
        assert count_nonfinite(x) == 1
