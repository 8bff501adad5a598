"""The quantizer family's shared arithmetic against its definitions: blocked lane sums (numpy
reference and numba) and the code packing (the codecs' own tests check their kernels' packing)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.codecs import codec_from_spec
from kvstore.codecs.quantize import (
    LANES,
    blocked_sum_reference,
    lane_sum_reference,
    pack_codes_reference,
    packed_nbytes,
    unpack_codes_reference,
)
from kvstore.codecs.quantize import numba_kernels as qn
from kvstore.errors import CodecError


def _lane_sum_by_definition(values):
    lanes = [0.0] * LANES
    for j, v in enumerate(values):
        lanes[j % LANES] += float(v)
    total = 0.0
    for lane in lanes:
        total += lane
    return total


def _blocked_sum_by_definition(values, block):
    sums = [_lane_sum_by_definition(values[i : i + block]) for i in range(0, len(values), block)]
    return _lane_sum_by_definition(sums)


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 255, 257, 1000])
def test_sums_follow_their_definition(n):
    rng = np.random.default_rng(n)
    values = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))).astype(np.float32)
    wide = values.astype(np.float64)
    assert lane_sum_reference(wide) == _lane_sum_by_definition(wide)
    assert blocked_sum_reference(wide, 64) == _blocked_sum_by_definition(wide, 64)


@pytest.mark.parametrize("n", [0, 1, 17, 4095, 4096, 4097, 100_003])
def test_numba_sums_are_the_reference_bit_for_bit(n):
    rng = np.random.default_rng(n)
    values = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)
    values[::7] = np.float32(3.0e38)  # float32 overflow would show; float64 does not
    wide = values.astype(np.float64)
    assert qn.blocked_sum(values, 4096) == blocked_sum_reference(wide)
    assert qn.lane_sum(wide) == lane_sum_reference(wide)


def test_sums_of_negative_zeros_are_positive_zero():
    # Every lane starts from +0.0, so -0.0 terms give +0.0 in all implementations.
    zeros = np.full(100, -0.0, dtype=np.float32)
    for total in (
        blocked_sum_reference(zeros.astype(np.float64)),
        qn.blocked_sum(zeros, 4096),
        lane_sum_reference(np.array([-0.0])),
    ):
        assert total == 0.0 and not np.signbit(total)


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 1001])
def test_packing_is_one_little_endian_bit_stream(width, n):
    rng = np.random.default_rng(width * 1000 + n)
    codes = rng.integers(0, 1 << width, n).astype(np.uint8)
    packed = pack_codes_reference(codes, width)
    assert packed.size == packed_nbytes(n, width)
    stream = "".join(format(int(c), f"0{width}b")[::-1] for c in codes)  # LSB first
    stream += "0" * (8 * packed.size - len(stream))
    expected = bytes(int(stream[8 * i : 8 * i + 8][::-1], 2) for i in range(packed.size))
    assert packed.tobytes() == expected
    assert np.array_equal(unpack_codes_reference(packed, width, n), codes)


@pytest.mark.parametrize("name", ["1bit", "efsign", "terngrad", "qsgd"])
def test_the_server_refuses_nan_scales_before_touching_the_sum(name):
    codec = codec_from_spec({"type": name})
    encoder = codec.make_encoder(1000, "float32")
    frames = [np.array(f, copy=True) for f in encoder.encode(np.ones(1000, np.float32))]
    frames[0].view(np.float32)[-1] = np.nan
    aggregator = codec.make_aggregator(1000, "float32")
    aggregator.result[:] = 7.0
    with pytest.raises(CodecError, match="scale"):
        aggregator.add(frames, first=False)
    assert (aggregator.result == 7.0).all()
