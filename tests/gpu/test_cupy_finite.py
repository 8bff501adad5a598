"""The CuPy count of NaN and infinities equals the CPU kernels' on every float dtype."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import require_cupy

from kvstore.codecs.finite import count_nonfinite

cupy = require_cupy()

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32"])
def test_gpu_count_matches_the_cpu(dtype):
    rng = np.random.default_rng(3)
    for n in [0, 1, 17, 4097, 1_000_003]:
        x = rng.standard_normal(n).astype(dtype)
        if n and dtype.startswith("float"):
            spots = rng.integers(0, n, size=min(n, 50))
            x[spots] = rng.choice(np.array([np.nan, np.inf, -np.inf, 1.0], dtype), spots.size)
        expected = count_nonfinite(x, kernels="numpy")
        assert count_nonfinite(x, kernels="numba") == expected
        on_gpu = cupy.asarray(x)
        assert count_nonfinite(on_gpu) == expected
        for offset in (1, 3):  # views that are not 16-byte aligned, and their vector tails
            assert count_nonfinite(on_gpu[offset:]) == count_nonfinite(x[offset:], kernels="numpy")
