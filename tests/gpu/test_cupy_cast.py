"""CuPy kernels of the 16-bit casts ``fp16`` and ``bf16``: the numpy reference's payload bytes and
residuals on every length, edge values, a misaligned view and many pushes; exact decoding of
every 16-bit pattern; overflow refusal and saturation on the device."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import require_cupy

from kvstore.codecs import cast, get_codec
from kvstore.errors import CodecError

cupy = require_cupy()  # pytest.importorskip("cupy"), and a device

from kvstore.codecs.cast import cuda_kernels as cast_cuda  # noqa: E402  (importing it needs CuPy)

pytestmark = pytest.mark.gpu

FLOAT32_MAX = float(np.finfo(np.float32).max)
LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 4095, 4097, 10007, 1_000_003]
CASES = [("fp16", False), ("fp16", True), ("bf16", False), ("bf16", True)]
CASE_IDS = ["fp16", "fp16-ef", "bf16", "bf16-ef"]


def _edge_values(name, error_feedback, numel, rng):
    """Random magnitudes over the whole range mixed with signed zeros, subnormals, ties and the
    largest values that do not overflow (anything with error feedback)."""
    tiny = 2.0**-149
    edges = [0.0, -0.0, tiny, -tiny, 1e-40, -1e-39, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-14]
    edges += [1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 65504.0, -65519.99]
    if name == "bf16":
        edges += [3.38e38, -3.39e38]
    if error_feedback:
        edges += [65520.0, -1e6, 3.3961e38, FLOAT32_MAX, -FLOAT32_MAX]
    spread = np.sign(rng.standard_normal(numel)) * 10.0 ** rng.uniform(-45, 4.8, numel)
    values = np.where(rng.random(numel) < 0.3, rng.choice(edges, numel), spread)
    return values.astype(np.float32)


def _encoders(name, error_feedback, numel):
    codec = get_codec(name, error_feedback=error_feedback)
    reference = codec.make_encoder(numel, "float32")
    reference.implementation = "numpy"
    return reference, codec.make_encoder(numel, "float32", device=cupy.cuda.Device(0))


def _push(encoder, values):
    frames = [bytes(memoryview(f)) for f in encoder.encode(values)]
    return frames, {k: v.tobytes() for k, v in encoder.state().items()}


@pytest.mark.parametrize("name, error_feedback", CASES, ids=CASE_IDS)
def test_cupy_encodes_like_the_numpy_reference(name, error_feedback):
    rng = np.random.default_rng(1)
    for numel in LENGTHS:
        reference, device = _encoders(name, error_feedback, numel)
        for step in range(2 if numel > 10_000 else 4):  # the residual carries
            grad = _edge_values(name, error_feedback, numel, rng)
            assert _push(device, cupy.asarray(grad)) == _push(reference, grad), (numel, step)


@pytest.mark.parametrize("name, error_feedback", CASES, ids=CASE_IDS)
def test_a_misaligned_view_over_many_pushes(name, error_feedback):
    rng = np.random.default_rng(2)
    reference, device = _encoders(name, error_feedback, 4097)
    for _ in range(40):
        grad = (rng.standard_normal(4098) * 1e-3).astype(np.float32)
        on_device = cupy.asarray(grad)[1:]  # starts 4 bytes into an allocation
        assert _push(device, on_device) == _push(reference, grad[1:])


@pytest.mark.parametrize("name, error_feedback", CASES, ids=CASE_IDS)
def test_all_zero_and_all_equal_chunks(name, error_feedback):
    for value in (0.0, -0.0, 0.1, -3.0, 2.0**-20, 2.0**-140):
        reference, device = _encoders(name, error_feedback, 33)
        grad = np.full(33, value, np.float32)
        for _ in range(3):
            assert _push(device, cupy.asarray(grad)) == _push(reference, grad)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_every_16_bit_pattern_decodes_like_numpy(name):
    fmt = get_codec(name).format
    codes = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    widened = fmt.widen(codes)
    out = cupy.full(65536, cupy.nan, cupy.float32)
    cast_cuda.decode(cupy.asarray(codes), out, name == "bf16", False)
    assert out.get().view(np.uint32).tobytes() == widened.view(np.uint32).tobytes()
    finite = np.isfinite(widened)
    base = np.full(65536, 2.0**-130, np.float32)  # a subnormal addend: kept, not flushed
    acc = cupy.asarray(base)
    cast_cuda.decode(cupy.asarray(codes), acc, name == "bf16", True)
    assert np.array_equal(acc.get()[finite], (base + widened)[finite])


def _boundaries(fmt):
    """Every float32 at and next to each rounding boundary, both signs."""
    lows = fmt.widen(np.arange(fmt.largest_finite + 1, dtype=np.uint16)).astype(np.float64)
    highs = fmt.widen(np.arange(1, fmt.largest_finite + 2, dtype=np.uint16)).astype(np.float64)
    if fmt.name == "fp16":
        highs[-1] = 65536.0
    midpoints = ((lows + highs) / 2).astype(np.float32)
    below = np.nextafter(midpoints, np.float32(0))
    above = np.nextafter(midpoints, np.float32(np.inf))
    positive = np.concatenate([midpoints, below, above, lows.astype(np.float32)])
    return np.concatenate([positive, -positive])


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_rounding_boundaries_and_random_patterns_encode_like_numpy(name):
    fmt = get_codec(name).format
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 4_000_000, dtype=np.uint64).astype(np.uint32)
    patterns = bits[(bits & 0x7F80_0000) != 0x7F80_0000].view(np.float32)
    reports = cast_cuda.OverflowReports()
    small = np.linspace(-1, 1, 1001, dtype=np.float32)  # after overflows: no stale report
    for values in (_boundaries(fmt), patterns, small, patterns, small, small):
        out = cupy.empty(values.size, cupy.uint16)
        largest = cast_cuda.encode(cupy.asarray(values), None, out, name == "bf16", reports)
        assert np.array_equal(out.get(), fmt.round(values))
        magnitudes = values.view(np.uint32) & 0x7FFF_FFFF
        overflowing = magnitudes[magnitudes >= fmt.overflow_bits]
        assert largest == (int(overflowing.max()) if overflowing.size else 0)
        assert cast_cuda.largest_magnitude(cupy.asarray(values)) == magnitudes.max()


def test_an_overflow_is_refused_on_the_device_too():
    device = cupy.cuda.Device(0)
    encoder = get_codec("fp16").make_encoder(5, "float32", device=device)
    with pytest.raises(CodecError, match="'fp16'.*70000.*bf16"):
        encoder.encode(cupy.asarray([1, -70000, 2, 3, 4], cupy.float32))
    key_encoder = get_codec("bf16").make_key_encoder(
        "w", 30, "float32", [(0, 10), (10, 20), (20, 30)], device
    )
    grad = cupy.ones(30, cupy.float32)
    grad[25] = FLOAT32_MAX
    with pytest.raises(CodecError, match="'bf16'"):
        key_encoder.begin(grad, finite=True)
    grad[25] = 1
    key_encoder.begin(grad)
    for i, chunk in enumerate(key_encoder.chunks):
        (frame,) = chunk.encode(grad[i * 10 : i * 10 + 10])
        assert bytes(frame) == np.full(10, 0x3F80, "<u2").tobytes()


def test_error_feedback_saturates_on_the_device():
    encoder = get_codec("fp16", error_feedback=True).make_encoder(
        2, "float32", device=cupy.cuda.Device(0)
    )
    (frame,) = encoder.encode(cupy.asarray([1e6, -65520], cupy.float32))
    assert np.frombuffer(bytes(frame), "<u2").tolist() == [0x7BFF, 0xFBFF]
    assert encoder.residual.get().tolist() == [1e6 - 65504, -16.0]


def test_the_host_frames_are_pinned_numpy_arrays():
    encoder = get_codec("bf16").make_encoder(100, "float32", device=cupy.cuda.Device(0))
    values = np.linspace(-1, 1, 100, dtype=np.float32)
    (frame,) = encoder.encode(cupy.asarray(values))
    assert isinstance(frame, np.ndarray)
    expected = cast.bf16_round_reference(values)
    assert bytes(frame) == expected.astype("<u2").tobytes()
