"""The CuPy kernels of the count sketch give the numpy reference's bits: the peak, the sketch
(integer atomics, so no order of additions shows), the median estimates and bucket zeroing,
over sizes, widths, row counts and offsets in the key."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import require_cupy
from sketch_cases import COLUMNS, ROWS, SIZES, STARTS, awkward_values

from kvstore.codecs.counter_rng import stable_key_hash
from kvstore.codecs.sketch.hashing import (
    estimates_reference,
    row_keys,
    sketch_reference,
    zero_buckets_reference,
)

cupy = require_cupy()

from kvstore.codecs.sketch import cuda_kernels  # noqa: E402  (needs CuPy)

pytestmark = pytest.mark.gpu


def same_bits(device: object, host: np.ndarray) -> bool:
    got = cupy.asnumpy(device)
    return got.dtype == host.dtype and got.shape == host.shape and got.tobytes() == host.tobytes()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("columns", COLUMNS)
def test_cupy_kernels_give_the_reference_bits(n, columns):
    rng = np.random.default_rng(n * 31 + columns)
    for rows in ROWS:
        for start in STARTS:
            keys = row_keys(seed=5, key_hash=stable_key_hash(("w", n)), rows=rows)
            for values in (awkward_values(n, rows + start), np.zeros(n, np.float32)):
                on_device = cupy.asarray(values)
                assert cuda_kernels.peak_abs(on_device) == float(np.max(np.abs(values)))
                table = sketch_reference(values, keys, start, columns)
                assert same_bits(cuda_kernels.sketch(on_device, keys, start, columns), table)

                summed = table + sketch_reference(values[::-1].copy(), keys, start, columns)
                expected = estimates_reference(summed, keys, start, n)
                got = cuda_kernels.estimates(cupy.asarray(summed), keys, start, n)
                assert same_bits(got, expected)

                local = rng.choice(n, size=min(n, 25), replace=False)
                for index_type in (np.int64, np.uint32):
                    want = summed.copy()
                    zero_buckets_reference(want, keys, start, local)
                    have = cupy.asarray(summed)
                    cuda_kernels.zero_buckets(have, keys, start, cupy.asarray(local, index_type))
                    assert same_bits(have, want)


def test_wide_tables_take_the_global_atomics_path():
    # rows * columns above SHARED_ENTRIES: every block adds straight into device memory
    keys = row_keys(1, 2, 15)
    values = awkward_values(1_000_003, 4)
    columns = cuda_kernels.SHARED_ENTRIES // 15 + 1
    assert 15 * columns > cuda_kernels.SHARED_ENTRIES
    table = cuda_kernels.sketch(cupy.asarray(values), keys, 7, columns)
    assert same_bits(table, sketch_reference(values, keys, 7, columns))


def test_an_empty_chunk_and_extreme_values():
    keys = row_keys(3, 3, 5)
    empty = cupy.zeros(0, dtype=cupy.float32)
    assert cuda_kernels.peak_abs(empty) == 0.0
    assert same_bits(cuda_kernels.sketch(empty, keys, 0, 7), np.zeros((5, 7), np.float32))
    assert same_bits(
        cuda_kernels.estimates(cupy.zeros((5, 7), cupy.float32), keys, 0, 0),
        np.zeros(0, np.float32),
    )
    for n, value, columns in ((1, 3e38, 1), (65537, 1e30, 1), (65537, -1e30, 7), (4, 1e-44, 3)):
        values = np.full(n, value, np.float32)
        expected = sketch_reference(values, keys, 0, columns)
        assert same_bits(cuda_kernels.sketch(cupy.asarray(values), keys, 0, columns), expected)


def test_the_sketch_is_the_same_on_every_call():
    # integer atomics: a large chunk in a narrow table, sketched repeatedly, never changes a bit
    keys = row_keys(4, 4, 3)
    values = cupy.asarray(awkward_values(1_000_003, 9))
    first = cupy.asnumpy(cuda_kernels.sketch(values, keys, 0, 7))
    for _ in range(5):
        assert same_bits(cuda_kernels.sketch(values, keys, 0, 7), first)
