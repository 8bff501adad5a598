"""The 16-bit casts ``fp16`` and ``bf16``: the numpy reference against a per-element oracle, the
numba bit-pattern conversions against numpy (exhaustively where it matters), the encoders'
error feedback, saturation and overflow refusal, decoding, aggregation and checkpoints."""

from __future__ import annotations

import math
import re
import struct

import numpy as np
import pytest

from kvstore.codecs import cast, get_codec
from kvstore.codecs.base import frame_array
from kvstore.codecs.cast import numba_kernels as cast_numba
from kvstore.errors import CodecError

FLOAT32_MAX = float(np.finfo(np.float32).max)
FORMATS = {"fp16": (10, -14, 65504.0), "bf16": (7, -126, float.fromhex("0x1.fep127"))}
"""Per format: fraction bits, smallest normal exponent, largest finite value."""

LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 4095, 4097, 10007]
CASES = [("fp16", False), ("fp16", True), ("bf16", False), ("bf16", True)]
CASE_IDS = ["fp16", "fp16-ef", "bf16", "bf16-ef"]


# the oracle: DESIGN's definition, one element at a time, in exact arithmetic ----------------


def oracle_round(name: str, x: float) -> int:
    """The 16-bit pattern of float32 ``x`` rounded to nearest even (infinity past the range)."""
    fraction_bits, min_exponent, largest = FORMATS[name]
    if x == 0:
        value = x
    else:
        _, exponent = math.frexp(abs(x))  # |x| = m * 2**exponent, 0.5 <= m < 1
        quantum = 2.0 ** (max(exponent - 1, min_exponent) - fraction_bits)
        value = round(abs(x) / quantum) * quantum  # exact; round() ties to even
        value = math.copysign(math.inf if value > largest else value, x)
    if name == "fp16":
        if math.isinf(value):
            return 0xFC00 if value < 0 else 0x7C00
        return struct.unpack("<H", struct.pack("<e", value))[0]
    return struct.unpack("<I", struct.pack("<f", value))[0] >> 16


def oracle_widen(name: str, h: int) -> np.float32:
    if name == "fp16":
        return np.float32(struct.unpack("<e", struct.pack("<H", h))[0])
    return np.float32(struct.unpack("<f", struct.pack("<I", h << 16))[0])


def oracle_encode(name: str, grad, residual):
    """Codes and the new residual (None without error feedback), element by element."""
    codes, kept = [], []
    for j, g in enumerate(grad):
        if residual is None:
            codes.append(oracle_round(name, float(g)))
            continue
        with np.errstate(over="ignore"):
            p = np.float32(residual[j]) + np.float32(g)
        if math.isinf(p):
            p = np.float32(math.copysign(FLOAT32_MAX, p))
        h = oracle_round(name, float(p))
        if math.isinf(oracle_widen(name, h)):  # saturate at the largest finite value
            h = (h & 0x8000) | (0x7BFF if name == "fp16" else 0x7F7F)
        codes.append(h)
        kept.append(np.float32(p - oracle_widen(name, h)))
    return np.array(codes, np.uint16), None if residual is None else np.array(kept, np.float32)


# helpers ---------------------------------------------------------------------------------------


def _encoder(name, error_feedback, numel, implementation):
    encoder = get_codec(name, error_feedback=error_feedback).make_encoder(numel, "float32")
    encoder.implementation = implementation
    return encoder


def _push(encoder, grad):
    """Payload bytes and state bytes after one push."""
    frames = [bytes(memoryview(f)) for f in encoder.encode(grad)]
    return frames, {k: v.tobytes() for k, v in encoder.state().items()}


def _arrays(frames):
    """Payload bytes as the uint8 arrays the server decodes."""
    return [frame_array(f, np.uint8) for f in frames]


def _edge_values(name, error_feedback, numel, rng):
    """Random values mixed with the edges: signed zeros, float32 and 16-bit subnormals, ties,
    the largest values that do not overflow (anything with error feedback)."""
    tiny = np.float32(2.0**-149)
    edges = [0.0, -0.0, tiny, -tiny, 1e-40, -1e-39, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-14]
    edges += [1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 65504.0, -65519.99]
    if name == "bf16":
        edges += [3.38e38, -3.39e38]
    if error_feedback:
        edges += [65520.0, -1e6, 3.3961e38, FLOAT32_MAX, -FLOAT32_MAX]
    spread = np.sign(rng.standard_normal(numel)) * 10.0 ** rng.uniform(-45, 4.8, numel)
    values = np.where(rng.random(numel) < 0.3, rng.choice(edges, numel), spread)
    return values.astype(np.float32)


# numpy reference against the oracle ------------------------------------------------------------


@pytest.mark.parametrize("name, error_feedback", CASES, ids=CASE_IDS)
def test_the_numpy_reference_is_the_per_element_definition(name, error_feedback):
    rng = np.random.default_rng(1)
    encoder = _encoder(name, error_feedback, 300, "numpy")
    residual = np.zeros(300, np.float32) if error_feedback else None
    for _ in range(4):  # the residual carries from push to push
        grad = _edge_values(name, error_feedback, 300, rng)
        codes, residual = oracle_encode(name, grad, residual)
        frames, state = _push(encoder, grad)
        assert frames == [codes.astype("<u2").tobytes()]
        if error_feedback:
            assert state["residual"] == residual.tobytes()
        decoded = np.empty(300, np.float32)
        encoder.codec.decode_into(_arrays(frames), 300, decoded, False, "numpy")
        oracle = np.array([oracle_widen(name, int(h)) for h in codes], np.float32)
        assert decoded.tobytes() == oracle.tobytes()


def test_worked_examples():
    fp16 = cast.fp16_round_reference
    values = np.array([1.0, -0.0, 65504, 65519.99, 65520, 2.0**-24, 2.0**-25, -3e-8], np.float32)
    assert [hex(h) for h in fp16(values)] == [
        "0x3c00", "0x8000", "0x7bff", "0x7bff", "0x7c00", "0x1", "0x0", "0x8001",
    ]  # fmt: skip
    bf16 = cast.bf16_round_reference(np.array([1.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32))
    assert [hex(h) for h in bf16] == ["0x3f80", "0x3f80", "0x3f82"]  # ties to even


# numba conversions against numpy ---------------------------------------------------------------


def test_every_16_bit_pattern_widens_like_numpy():
    codes = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    for name, kernel in (("fp16", cast_numba.decode_fp16), ("bf16", cast_numba.decode_bf16)):
        fmt = get_codec(name).format
        out = np.empty(65536, np.float32)
        kernel(codes, out, False)
        assert out.view(np.uint32).tobytes() == fmt.widen(codes).view(np.uint32).tobytes()
        finite = ~np.isnan(out)
        base = np.full(65536, 0.75, np.float32)
        kernel(codes, base, True)
        with np.errstate(invalid="ignore"):
            expected = np.float32(0.75) + fmt.widen(codes)
        assert np.array_equal(base[finite], expected[finite])


def _boundaries(name):
    """Every float32 at, just below and just above each rounding boundary (the midpoints of
    consecutive 16-bit values, both signs), and the 16-bit values themselves."""
    fmt = get_codec(name).format
    lows = fmt.widen(np.arange(fmt.largest_finite + 1, dtype=np.uint16)).astype(np.float64)
    highs = fmt.widen(np.arange(1, fmt.largest_finite + 2, dtype=np.uint16)).astype(np.float64)
    if name == "fp16":
        highs[-1] = 65536.0
    midpoints = ((lows + highs) / 2).astype(np.float32)  # exact: a 16-bit midpoint fits
    below = np.nextafter(midpoints, np.float32(0))
    above = np.nextafter(midpoints, np.float32(np.inf))
    positive = np.concatenate([midpoints, below, above, lows.astype(np.float32)])
    return np.concatenate([positive, -positive])


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_rounding_boundaries_and_random_patterns_encode_like_numpy(name):
    fmt = get_codec(name).format
    kernel = cast_numba.encode_fp16 if name == "fp16" else cast_numba.encode_bf16
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, 3_000_000, dtype=np.uint64).astype(np.uint32)
    patterns = bits[(bits & 0x7F80_0000) != 0x7F80_0000].view(np.float32)  # finite ones
    for values in (_boundaries(name), patterns):
        out = np.empty(values.size, np.uint16)
        largest = kernel(values, out)
        assert np.array_equal(out, fmt.round(values))
        assert largest == cast.largest_magnitude_reference(values)
    sample = _boundaries(name)[::97]
    assert [oracle_round(name, float(x)) for x in sample] == fmt.round(sample).tolist()


# numba against numpy through the encoders ------------------------------------------------------


@pytest.mark.parametrize("name, error_feedback", CASES, ids=CASE_IDS)
def test_numba_encodes_like_numpy_on_every_length(name, error_feedback):
    rng = np.random.default_rng(3)
    for numel in [*LENGTHS, 1_000_003]:
        reference = _encoder(name, error_feedback, numel, "numpy")
        compiled = _encoder(name, error_feedback, numel, "numba")
        for _ in range(1 if numel > 10_000 else 3):
            grad = _edge_values(name, error_feedback, numel, rng)
            assert _push(compiled, grad) == _push(reference, grad), numel


@pytest.mark.parametrize("name, error_feedback", CASES, ids=CASE_IDS)
def test_all_zero_and_all_equal_chunks(name, error_feedback):
    for value in (0.0, -0.0, 0.1, -3.0, 2.0**-20):
        grad = np.full(33, value, np.float32)
        reference = _encoder(name, error_feedback, 33, "numpy")
        compiled = _encoder(name, error_feedback, 33, "numba")
        for _ in range(3):
            got = _push(compiled, grad)
            assert got == _push(reference, grad)
        if not error_feedback:  # (with it, the residual may tip single elements)
            assert len(set(np.frombuffer(got[0][0], "<u2").tolist())) == 1


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_error_feedback_carries_over_many_pushes(name):
    rng = np.random.default_rng(4)
    reference = _encoder(name, True, 1000, "numpy")
    compiled = _encoder(name, True, 1000, "numba")
    decoded_sum = np.zeros(1000, np.float64)
    grad_sum = np.zeros(1000, np.float64)
    for _ in range(60):
        grad = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
        previous = reference.residual.copy()
        frames, state = _push(reference, grad)
        assert _push(compiled, grad) == (frames, state)
        decoded = np.empty(1000, np.float32)
        reference.codec.decode_into(_arrays(frames), 1000, decoded, False, "numba")
        # what was sent plus what is kept is exactly p = r + g
        assert np.array_equal(decoded + reference.residual, previous + grad)
        decoded_sum += decoded
        grad_sum += grad
    np.testing.assert_allclose(decoded_sum + reference.residual, grad_sum, atol=1e-6)


# overflow, saturation, bad values --------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["numpy", "numba"])
def test_an_overflow_without_error_feedback_is_refused(implementation):
    for name, value, fine in (("fp16", 70000.0, 65519.99), ("bf16", FLOAT32_MAX, 3.3895e38)):
        encoder = _encoder(name, False, 5, implementation)
        encoder.encode(np.full(5, fine, np.float32))
        grad = np.array([1, -value, 2, 3, 4], np.float32)
        with pytest.raises(
            CodecError, match=f"'{name}'.*{re.escape(f'{value:.7g}')}.*error_feedback"
        ) as caught:
            encoder.encode(grad)
        assert ("with 'bf16'" in str(caught.value)) == (name == "fp16")  # fp16's remedy
        assert "scale the loss" in str(caught.value)


def test_an_overflow_in_a_later_chunk_is_refused_before_any_chunk_is_encoded():
    codec = get_codec("fp16")
    key_encoder = codec.make_key_encoder("w", 30, "float32", [(0, 10), (10, 20), (20, 30)])
    grad = np.ones(30, np.float32)
    grad[25] = -1e5
    with pytest.raises(CodecError, match="100000"):
        key_encoder.begin(grad, finite=True)
    assert not any(chunk.checked for chunk in key_encoder.chunks)
    grad[25] = 1
    key_encoder.begin(grad)
    frames = [
        chunk.encode(grad[i * 10 : i * 10 + 10]) for i, chunk in enumerate(key_encoder.chunks)
    ]
    assert all(bytes(f[0]) == np.full(10, 0x3C00, "<u2").tobytes() for f in frames)


@pytest.mark.parametrize("implementation", ["numpy", "numba"])
def test_error_feedback_saturates_and_carries_the_rest(implementation):
    fp16 = _encoder("fp16", True, 2, implementation)
    frames = fp16.encode(np.array([1e6, -65520], np.float32))
    assert np.frombuffer(bytes(frames[0]), "<u2").tolist() == [0x7BFF, 0xFBFF]
    assert fp16.residual.tolist() == [1e6 - 65504, -16.0]
    bf16 = _encoder("bf16", True, 1, implementation)
    for _ in range(3):  # the second push's sum passes float32's range: clamped, not infinite
        frames = bf16.encode(np.array([FLOAT32_MAX], np.float32))
        assert bytes(frames[0]) == np.array([0x7F7F], "<u2").tobytes()
        assert np.isfinite(bf16.residual).all()
    assert bf16.residual[0] == np.float32(FLOAT32_MAX) - np.float32(float.fromhex("0x1.fep127"))


@pytest.mark.parametrize("name, error_feedback", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_values_are_refused_with_the_state_unchanged(name, error_feedback, bad):
    codec = get_codec(name, error_feedback=error_feedback)
    key_encoder = codec.make_key_encoder("w", 20, "float32", [(0, 10), (10, 20)])
    grad = np.linspace(-1, 1, 20, dtype=np.float32)
    key_encoder.begin(grad)
    for i, chunk in enumerate(key_encoder.chunks):
        chunk.encode(grad[i * 10 : i * 10 + 10])
    before = [chunk.state() for chunk in key_encoder.chunks]
    grad[13] = bad
    with pytest.raises(CodecError, match="NaN or infinite"):
        key_encoder.begin(grad)
    with pytest.raises(CodecError, match="NaN or infinite"):
        key_encoder.chunks[1].encode(grad[10:20])
    for chunk, saved in zip(key_encoder.chunks, before, strict=True):
        state = chunk.state()
        assert state.keys() == saved.keys()
        assert all(state[k].tobytes() == saved[k].tobytes() for k in state)


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0])
def test_error_feedback_must_be_a_bool(value):
    with pytest.raises(CodecError, match="error_feedback"):
        get_codec("fp16", error_feedback=value)
    with pytest.raises(CodecError, match="unknown parameter"):
        get_codec("bf16", threshold=0.5)


def test_the_codec_describes_its_payload_and_state():
    codec = get_codec("bf16", error_feedback=np.bool_(True))
    assert codec.spec() == {"type": "bf16", "error_feedback": True}
    assert codec.payload_nbytes(1001, "float32") == (2002,)
    assert codec.pushed_fraction(1001, "float32") == 0.5
    assert (codec.code_bits(), codec.scale_count(1001)) == (16, 0)
    assert codec.make_encoder(3, "float32").state_names == ("residual",)
    assert get_codec("fp16").make_encoder(3, "float32").state() == {}
    assert get_codec("fp16") != get_codec("bf16")
    with pytest.raises(CodecError, match="float32"):
        codec.make_encoder(3, "float16")


# decoding, aggregation, checkpoints ------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("implementation", ["numpy", "numba"])
def test_decode_into_writes_and_accumulates(name, implementation):
    rng = np.random.default_rng(5)
    codec = get_codec(name)
    grad = rng.standard_normal(4097).astype(np.float32)
    payload = codec.make_encoder(4097, "float32").encode(grad)[0]
    misaligned = frame_array(b"\0" + bytes(payload), np.uint8)[1:]  # a frame at an odd address
    widened = codec.format.widen(codec.format.round(grad))
    for frame in (frame_array(bytes(payload), np.uint8), misaligned):
        out = np.full(4097, np.nan, np.float32)
        codec.decode_into([frame], 4097, out, False, implementation)
        assert out.tobytes() == widened.tobytes()
        codec.decode_into([frame], 4097, out, True, implementation)
        assert out.tobytes() == (widened + widened).tobytes()
    empty = np.zeros(0, np.float32)
    codec.decode_into([frame_array(b"", np.uint8)], 0, empty, True, implementation)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_the_aggregator_sums_the_decoded_pushes(name):
    rng = np.random.default_rng(6)
    codec = get_codec(name, error_feedback=True)
    encoders = [codec.make_encoder(1000, "float32") for _ in range(3)]
    aggregator = codec.make_aggregator(1000, "float32")
    for _ in range(2):  # two rounds: the first push of each overwrites
        expected = np.zeros(1000, np.float32)
        for i, encoder in enumerate(encoders):
            frames = [bytes(f) for f in encoder.encode(rng.standard_normal(1000, np.float32))]
            aggregator.add(frames, first=i == 0)
            decoded = np.empty(1000, np.float32)
            codec.decode_into([frame_array(frames[0], np.uint8)], 1000, decoded, False, "numpy")
            expected = decoded if i == 0 else expected + decoded
        assert aggregator.result.tobytes() == expected.tobytes()


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_checkpoint_round_trip_gives_the_same_next_push(name):
    rng = np.random.default_rng(7)
    codec = get_codec(name, error_feedback=True)
    original = codec.make_encoder(777, "float32")
    for _ in range(3):
        original.encode(rng.standard_normal(777).astype(np.float32))
    restored = codec.make_encoder(777, "float32")
    restored.load_state(original.state())
    grad = rng.standard_normal(777).astype(np.float32)
    assert _push(restored, grad) == _push(original, grad)
    with pytest.raises(CodecError, match="residual"):
        restored.load_state({"residual": np.zeros(776, np.float32)})
    with pytest.raises(CodecError, match="keeps state"):
        get_codec(name).make_encoder(777, "float32").load_state(original.state())
