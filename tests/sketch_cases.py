"""The grid the count sketch's kernels are checked on, shared by tests/unit (numba) and
tests/gpu (CuPy): every implementation must give the numpy reference's bits on each case."""

from __future__ import annotations

import numpy as np

SIZES = (1, 17, 4099, 65537)
COLUMNS = (1, 7, 1000)
ROWS = (1, 3, 5, 7, 9, 15)  # each median network, and the insertion sort beyond them
STARTS = (0, 12345, 2**32 - 3000)  # the last: blocks whose indices cross 2**32


def awkward_values(n: int, seed: int) -> np.ndarray:
    """Normal values with ties, zeros, a spike and a subnormal."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n).astype(np.float32)
    values[::5] = 0
    values[1::7] = values[0]  # ties
    values[2::11] = -values[0]
    if n > 3:
        values[3] = 1e4  # a spike: the small values lose low bits in fixed point
    if n > 4:
        values[4] = np.float32(1e-42)  # subnormal
    return values
