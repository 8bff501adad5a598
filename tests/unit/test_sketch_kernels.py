"""The numba kernels of the count sketch give the numpy reference's bits, and the sketch keeps
the promises its specification (``kvstore.codecs.sketch.hashing``) makes: linear to rounding,
exact where nothing collides, hashes that depend only on the element's index in its key, and
an integer sum that cannot overflow."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from sketch_cases import COLUMNS, ROWS, SIZES, STARTS, awkward_values

from kvstore.codecs.counter_rng import stable_key_hash
from kvstore.codecs.sketch import numba_kernels as kernels
from kvstore.codecs.sketch.hashing import (
    buckets_and_signs_reference,
    estimates_reference,
    fixed_point_exponent,
    row_keys,
    sketch_reference,
    zero_buckets_reference,
)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("columns", COLUMNS)
def test_numba_kernels_give_the_reference_bits(n, columns):
    rng = np.random.default_rng(n * 31 + columns)
    for rows in ROWS:
        for start in STARTS:
            keys = row_keys(seed=5, key_hash=stable_key_hash(("w", n)), rows=rows)
            for values in (awkward_values(n, rows + start), np.zeros(n, np.float32)):
                table = sketch_reference(values, keys, start, columns)
                assert same_bits(kernels.sketch(values, keys, start, columns), table)

                summed = table + sketch_reference(values[::-1].copy(), keys, start, columns)
                expected = estimates_reference(summed, keys, start, n)
                got = np.empty(n, np.float32)
                kernels.estimates_into(summed, keys, start, got)
                assert same_bits(got, expected)

                local = rng.choice(n, size=min(n, 25), replace=False)
                for index_type in (np.int64, np.uint32):
                    want, have = summed.copy(), summed.copy()
                    zero_buckets_reference(want, keys, start, local)
                    kernels.zero_buckets(have, keys, start, local.astype(index_type))
                    assert same_bits(have, want)


@pytest.mark.parametrize("rows", (1, 3, 5, 7, 9))
def test_the_medians_are_the_middle_of_every_order(rows):
    """Every order of ``rows`` distinct values (all of them up to 7 rows, a sample beyond) and
    of values with ties: a median network that swapped one pair wrongly fails some order."""
    rng = np.random.default_rng(rows)
    if rows <= 7:
        orders = np.array(list(itertools.permutations(range(rows))), np.float32)
    else:
        orders = np.argsort(rng.random((5000, rows)), axis=1).astype(np.float32)
    ties = rng.integers(-2, 3, size=(3000, rows)).astype(np.float32)
    for columns in (orders - rows // 2, ties):
        gathered = np.ascontiguousarray(columns.T)
        out = np.empty(gathered.shape[1], np.float32)
        kernels._medians(gathered, out.size, out)
        expected = np.sort(columns, axis=1)[:, rows // 2]
        assert same_bits(out, expected + np.float32(0))  # a zero median as +0.0


def test_peak_abs_is_the_largest_magnitude():
    assert kernels.peak_abs(np.zeros(0, np.float32)) == 0.0
    values = awkward_values(4099, 1)
    values[77] = -3e38
    assert kernels.peak_abs(values) == float(np.max(np.abs(values))) == float(np.float32(3e38))
    tiny = np.array([0, -1e-44, 1e-45], np.float32)
    assert kernels.peak_abs(tiny) == float(np.float32(1e-44))


def test_sketch_into_with_a_given_exponent_and_scratch():
    keys = row_keys(9, 4, 5)
    values = awkward_values(4099, 2)
    q = fixed_point_exponent(kernels.peak_abs(values), values.size)
    scratch = np.full((5, 7), 123456789, np.int64)  # stale contents must not leak in
    out = np.full((5, 7), np.nan, np.float32)
    kernels.sketch_into(values, keys, 100, 7, q, scratch, out)
    assert same_bits(out, sketch_reference(values, keys, 100, 7))
    kernels.sketch_into(np.zeros(3, np.float32), keys, 0, 7, 60, scratch, out)
    assert same_bits(out, np.zeros((5, 7), np.float32))


def test_fixed_point_rounds_half_to_even():
    # With a peak of 1 among 4 values q = 58, so 2.5 * 2**-58 and 3.5 * 2**-58 are exactly
    # half-way: they round to 2 and 4 units. One row of many columns keeps them apart.
    keys = row_keys(0, 0, 1)
    unit = 2.0**-58
    values = np.array([1.0, 2.5 * unit, 3.5 * unit, -2.5 * unit], np.float32)
    buckets, _ = buckets_and_signs_reference(keys, np.arange(4, dtype=np.uint64), 1000)
    assert len(set(buckets[0].tolist())) == 4
    table = kernels.sketch(values, keys, 0, 1000)
    assert same_bits(table, sketch_reference(values, keys, 0, 1000))
    assert sorted(np.abs(table[0][buckets[0][1:]]).tolist()) == [2 * unit, 2 * unit, 4 * unit]


def test_the_sketch_is_linear_to_rounding():
    """``sketch(a) + sketch(b)`` against ``sketch(a + b)``: every table entry within
    ``8 * 2**-24 * M + n * 2**-q`` where ``M`` is the bucket's mass ``sum(|a_i| + |b_i|)`` and
    ``q`` the smallest of the three fixed-point exponents. The float32 sum ``a + b``, the three
    conversions to float32 and the float32 add of the two tables round by at most ``2**-24``
    of ``M`` each; each element's fixed-point value rounds by at most half a unit ``2**-q``."""
    rng = np.random.default_rng(11)
    n, columns, start = 65537, 1000, 12345
    keys = row_keys(3, 77, 5)
    a = rng.standard_normal(n).astype(np.float32)
    b = (rng.standard_normal(n) * 10).astype(np.float32)
    total = a + b
    summed = kernels.sketch(a, keys, start, columns) + kernels.sketch(b, keys, start, columns)
    together = kernels.sketch(total, keys, start, columns)
    buckets, _ = buckets_and_signs_reference(
        keys, np.arange(start, start + n, dtype=np.uint64), columns
    )
    mass = np.zeros((5, columns))
    for j in range(5):
        np.add.at(mass[j], buckets[j], np.abs(a.astype(np.float64)) + np.abs(b))
    q = min(fixed_point_exponent(float(np.max(np.abs(x))), n) for x in (a, b, total))
    bound = 8 * 2.0**-24 * mass + n * 2.0**-q
    difference = np.abs(summed.astype(np.float64) - together)
    assert np.all(difference <= bound)
    assert np.any(difference > 0)  # the bound is not vacuous: rounding does show


def test_a_sparse_vector_is_recovered_exactly():
    n, columns, rows, start = 65537, 1000, 5, 12345
    keys = row_keys(seed=2, key_hash=stable_key_hash("layer.weight"), rows=rows)
    values = np.zeros(n, np.float32)
    where = np.array([0, 4098, 30000, 65536])
    # within 2**30 of each other, so fixed point holds them exactly (q = 62 - 10 - 17)
    values[where] = np.array([3.25, -1e-3, 700.5, -2.0], np.float32)
    indices = np.arange(start, start + n, dtype=np.uint64)
    buckets, _ = buckets_and_signs_reference(keys, indices, columns)
    # The premise: in every row the nonzeros have buckets of their own, and every other element
    # shares a bucket with a nonzero in fewer than a majority of the rows.
    occupied = buckets[:, where]
    assert all(len(set(row.tolist())) == len(where) for row in occupied)
    hits = sum(np.isin(buckets[j], occupied[j]) for j in range(rows))
    hits[where] = 0
    assert hits.max() <= rows // 2
    table = kernels.sketch(values, keys, start, columns)
    estimates = np.empty(n, np.float32)
    kernels.estimates_into(table, keys, start, estimates)
    assert same_bits(estimates, values)


def test_hashes_depend_only_on_the_index_in_the_key():
    rows, columns = 15, 1000
    keys = row_keys(seed=8, key_hash=stable_key_hash("k"), rows=rows)
    indices = np.array([0, 1, 12345, 65536, 2**32 - 1], dtype=np.uint64)
    buckets, negative = buckets_and_signs_reference(keys, indices, columns)
    assert buckets.min() >= 0 and buckets.max() < columns
    assert negative.any() and not negative.all()
    whole = np.zeros(65537, np.float32)
    for t, index in enumerate(indices.tolist()):
        alone = kernels.sketch(np.ones(1, np.float32), keys, index, columns)  # a chunk of one
        expected = np.zeros((rows, columns), np.float32)
        expected[np.arange(rows), buckets[:, t]] = np.where(negative[:, t], -1.0, 1.0)
        assert same_bits(alone, expected)
        if index < whole.size:  # the same element inside a whole key starting at 0
            whole[:] = 0
            whole[index] = 1
            assert same_bits(kernels.sketch(whole, keys, 0, columns), expected)
    assert not np.array_equal(row_keys(8, stable_key_hash("k"), 1), row_keys(9, 0, 1))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize(
    ("n", "value", "columns"),
    [
        (1, 3e38, 1),
        (1, -3.4028235e38, 7),
        (2, 3.4028235e38, 1),
        (65537, 1e30, 1),
        (65537, -1e30, 7),
    ],
)
def test_extreme_values_do_not_overflow_the_integer_sum(n, value, columns):
    keys = row_keys(1, 1, 3)
    values = np.full(n, value, np.float32)
    expected = sketch_reference(values, keys, 0, columns)
    table = kernels.sketch(values, keys, 0, columns)
    assert same_bits(table, expected)
    if n > 2:  # far below float32's range: every bucket holds its exact signed sum
        assert np.isfinite(table).all()
        assert np.abs(table).sum(axis=1).max() <= n * abs(float(np.float32(value))) * (1 + 1e-6)
    if n == 2:  # two maxima in one bucket: beyond float32, as in the reference
        assert np.isinf(expected).any() and np.isinf(table).any()
