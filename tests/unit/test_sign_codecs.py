"""The sign quantizers ``1bit`` and ``efsign``: the numpy reference against a per-element oracle
written from the design's definition, the numba kernels against the reference (lengths, edge
values, saturation, many pushes), refused values, decoding, aggregation and checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.codecs import codec_from_spec, get_codec
from kvstore.codecs.base import frame_array
from kvstore.errors import CodecError

NAMES = ["1bit", "efsign"]
LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 4095, 4097, 10007, 1_000_003]
FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
TINY = np.float32(1e-45)  # the smallest subnormal


# the oracle: the design's definition, one element at a time ----------------------------------


def oracle_blocked_sum(terms: list[float]) -> float:
    """Blocks of 4096; in a block, lane j % 32 adds its terms in order from +0.0; the block is
    lane 0 + ... + lane 31; the block sums are lane-summed the same way (Python floats are
    IEEE doubles)."""

    def lane_sum(values):
        lanes = [0.0] * 32
        for j, value in enumerate(values):
            lanes[j % 32] += value
        total = 0.0
        for lane in lanes:
            total += lane
        return total

    return lane_sum([lane_sum(terms[i : i + 4096]) for i in range(0, len(terms), 4096)])


def oracle_push(name: str, grad, residual):
    """(scales, code bytes, new residual) of one push, element by element."""
    p = []
    for r, g in zip(residual, grad, strict=True):
        with np.errstate(over="ignore"):
            x = np.float32(r) + np.float32(g)
        p.append(min(max(x, -FLOAT32_MAX), FLOAT32_MAX))  # saturated; keeps -0.0
    bits = [1 if x >= 0 else 0 for x in p]
    n = len(p)
    if name == "1bit":
        c_pos = sum(bits)
        s_pos = oracle_blocked_sum([float(x) if b else 0.0 for x, b in zip(p, bits, strict=True)])
        s_neg = oracle_blocked_sum([0.0 if b else float(x) for x, b in zip(p, bits, strict=True)])
        hi = np.float32(s_pos / c_pos) if c_pos else np.float32(0.0)
        lo = np.float32(s_neg / (n - c_pos)) if n - c_pos else np.float32(0.0)
        scales = [hi, lo]
    else:
        s = np.float32(oracle_blocked_sum([abs(float(x)) for x in p]) / n) if n else np.float32(0)
        hi, lo = s, -s
        scales = [s]
    codes = bytearray((n + 7) // 8)
    for j, bit in enumerate(bits):
        codes[j // 8] |= bit << (j % 8)
    kept = [x - (hi if b else lo) for x, b in zip(p, bits, strict=True)]
    return np.array(scales, np.float32).tobytes(), bytes(codes), np.array(kept, np.float32)


# helpers -----------------------------------------------------------------------------------


def _encoder(name, n, kernels, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)  # read when the encoder is made
    return get_codec(name).make_encoder(n, "float32")


def _push(encoder, grad):
    """One push: (scales bytes, codes bytes, residual bytes)."""
    frames = encoder.encode(grad)
    return bytes(frames[0]), bytes(frames[1]), encoder.residual.tobytes()


def _mixed(rng, n, step):
    """Normal values with zeros of both signs, subnormals and ties mixed in."""
    g = rng.standard_normal(n).astype(np.float32)
    if n:
        g[rng.integers(0, n, max(1, n // 7))] = 0.0
        g[rng.integers(0, n, max(1, n // 11))] = -0.0
        g[rng.integers(0, n, max(1, n // 13))] = TINY * np.float32(rng.integers(-50, 50))
        g[rng.integers(0, n, max(1, n // 17))] = np.float32(0.5 * (step + 1))
    return g


def _decoded(name, frames, n):
    out = np.zeros(n, np.float32)
    get_codec(name).decode_into(
        [np.frombuffer(f, np.uint8) for f in frames], n, out, False, "numpy"
    )
    return out


# the reference against the oracle ------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 33, 4097, 9000])
def test_reference_matches_the_per_element_oracle(name, n, monkeypatch):
    rng = np.random.default_rng(n)
    encoder = _encoder(name, n, "numpy", monkeypatch)
    residual = np.zeros(n, np.float32)
    for step in range(3):
        g = _mixed(rng, n, step)
        scales, codes, residual = oracle_push(name, g, residual)
        assert _push(encoder, g) == (scales, codes, residual.tobytes()), step


@pytest.mark.parametrize(
    "name, scales, residual",
    [
        ("1bit", [0.75, -3.0], [0.25, 1.25, 0.0, -0.75, -0.75]),
        ("efsign", [1.2], [-0.20000005, 0.79999995, -1.8, -1.2, -1.2]),
    ],
)
@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_the_worked_examples_of_the_docstrings(name, scales, residual, kernels, monkeypatch):
    encoder = _encoder(name, 5, kernels, monkeypatch)
    got_scales, codes, _ = _push(encoder, np.array([1, 2, -3, 0, -0.0], np.float32))
    assert got_scales == np.array(scales, np.float32).tobytes()
    assert codes == b"\x1b"
    assert encoder.residual.tolist() == np.array(residual, np.float32).tolist()


# numba against numpy ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_numba_encodes_like_numpy_at_every_length(name, monkeypatch):
    rng = np.random.default_rng(1)
    for n in LENGTHS:
        reference = _encoder(name, n, "numpy", monkeypatch)
        compiled = _encoder(name, n, "numba", monkeypatch)
        for step in range(2 if n > 100_000 else 3):
            g = _mixed(rng, n, step)
            assert _push(compiled, g) == _push(reference, g), (n, step)


def _edge_chunks(n):
    rng = np.random.default_rng(n)
    signs = np.where(rng.random(n) < 0.5, np.float32(-1), np.float32(1))
    return {
        "zeros": np.zeros(n, np.float32),
        "negative zeros": np.full(n, -0.0, np.float32),
        "equal": np.full(n, 0.375, np.float32),
        "equal negative": np.full(n, -2.5, np.float32),
        "subnormals": signs * TINY * rng.integers(0, 1000, n).astype(np.float32),
        "negative subnormals": -TINY * rng.integers(1, 1000, n).astype(np.float32),
        "huge": signs * FLOAT32_MAX * rng.uniform(0.5, 1, n).astype(np.float32),
        "huge positive": np.full(n, FLOAT32_MAX, np.float32),
    }


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 9, 4097])
def test_edge_values_encode_as_the_oracle_in_both_implementations(name, n, monkeypatch):
    for what, g in _edge_chunks(n).items():
        reference = _encoder(name, n, "numpy", monkeypatch)
        compiled = _encoder(name, n, "numba", monkeypatch)
        residual = np.zeros(n, np.float32)
        for step in range(2):  # the second push of a huge chunk saturates r + g
            scales, codes, residual = oracle_push(name, g, residual)
            want = (scales, codes, residual.tobytes())
            assert _push(reference, g) == want, (what, step)
            assert _push(compiled, g) == want, (what, step)
            assert np.isfinite(residual).all()


@pytest.mark.parametrize("name", NAMES)
def test_special_chunks(name, monkeypatch):
    zero_scales = [0.0, 0.0] if name == "1bit" else [0.0]
    encoder = _encoder(name, 9, "numba", monkeypatch)
    scales, codes, residual = _push(encoder, np.full(9, -0.0, np.float32))
    assert np.frombuffer(scales, np.float32).tolist() == zero_scales
    assert codes == b"\xff\x01"  # -0.0 >= 0: every bit set; the padding bits clear
    assert not np.frombuffer(residual, np.float32).any()
    # a chunk of equal values is sent exactly
    encoder = _encoder(name, 9, "numba", monkeypatch)
    scales, codes, residual = _push(encoder, np.full(9, -2.5, np.float32))
    assert codes == b"\x00\x00"
    assert _decoded(name, (scales, codes), 9).tolist() == [-2.5] * 9
    assert not np.frombuffer(residual, np.float32).any()
    # a negative subnormal is negative (bit 0), not flushed to -0.0
    encoder = _encoder(name, 2, "numba", monkeypatch)
    _, codes, _ = _push(encoder, np.array([-TINY, TINY], np.float32))
    assert codes == b"\x02"
    # an empty chunk sends zero scales and no codes
    encoder = _encoder(name, 0, "numba", monkeypatch)
    assert _push(encoder, np.zeros(0, np.float32)) == (
        np.array(zero_scales, np.float32).tobytes(),
        b"",
        b"",
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_an_overflowing_sum_saturates(name, kernels, monkeypatch):
    big = np.array([FLOAT32_MAX, -FLOAT32_MAX, 1], np.float32)
    encoder = _encoder(name, 3, kernels, monkeypatch)
    encoder.load_state({"residual": big.copy()})
    got = _push(encoder, big)
    scales, codes, residual = oracle_push(name, big, big)  # p = [MAX, -MAX, 2]
    assert got == (scales, codes, residual.tobytes())
    assert np.isfinite(np.frombuffer(scales, np.float32)).all()
    assert np.isfinite(residual).all()


@pytest.mark.parametrize("name", NAMES)
def test_the_residual_carries_over_many_pushes(name, monkeypatch):
    n, steps = 1000, 40
    rng = np.random.default_rng(5)
    reference = _encoder(name, n, "numpy", monkeypatch)
    compiled = _encoder(name, n, "numba", monkeypatch)
    pushed = np.zeros(n, np.float64)
    sent = np.zeros(n, np.float64)
    for step in range(steps):
        g = (rng.standard_normal(n) * (1 + step % 5)).astype(np.float32)
        frames = _push(compiled, g)
        assert frames == _push(reference, g), step
        pushed += g
        sent += _decoded(name, frames[:2], n)
    # error feedback: what was pushed is what was sent plus what is kept (up to rounding)
    np.testing.assert_allclose(sent + compiled.residual, pushed, atol=1e-3)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kernels", ["numpy", "numba"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_infinity_are_refused_with_the_state_unchanged(name, kernels, bad, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
    n = 50
    codec = get_codec(name)
    key_encoder = codec.make_key_encoder("w", n, "float32", [(0, 20), (20, n)])
    g = np.linspace(-1, 1, n, dtype=np.float32)
    key_encoder.begin(g)
    for chunk, (start, stop) in zip(key_encoder.chunks, [(0, 20), (20, n)], strict=True):
        chunk.encode(g[start:stop])
    before = [c.residual.copy() for c in key_encoder.chunks]
    g[33] = bad
    with pytest.raises(CodecError, match="NaN or infinite"):
        key_encoder.begin(g)
    with pytest.raises(CodecError, match="NaN or infinite"):  # a chunk's encoder on its own
        key_encoder.chunks[1].encode(g[20:])
    for chunk, residual in zip(key_encoder.chunks, before, strict=True):
        assert chunk.residual.tobytes() == residual.tobytes()


@pytest.mark.parametrize("name", NAMES)
def test_bad_parameters_and_dtypes(name):
    with pytest.raises(CodecError, match="unknown parameter"):
        codec_from_spec({"type": name, "threshold": 0.5})
    with pytest.raises(CodecError, match="float32"):
        get_codec(name).make_encoder(10, "float16")
    encoder = get_codec(name).make_encoder(10, "float32")
    with pytest.raises(CodecError, match="expected 10 float32 values"):
        encoder.encode(np.zeros(11, np.float32))
    with pytest.raises(CodecError, match="residual"):
        encoder.load_state({"residual": np.zeros(9, np.float32)})
    with pytest.raises(CodecError, match="keeps state"):
        encoder.load_state({"memory": np.zeros(10, np.float32)})
    assert get_codec(name).spec() == {"type": name}


@pytest.mark.parametrize("name, scale_bytes", [("1bit", 8), ("efsign", 4)])
def test_payload_sizes(name, scale_bytes):
    codec = get_codec(name)
    for n, code_bytes in [(0, 0), (1, 1), (8, 1), (9, 2), (4097, 513)]:
        assert codec.payload_nbytes(n, "float32") == (scale_bytes, code_bytes)
    codec.validate_payloads([bytes(scale_bytes), bytes(2)], 9, "float32")
    with pytest.raises(CodecError, match="payload frames"):
        codec.validate_payloads([bytes(scale_bytes), bytes(3)], 9, "float32")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("implementation", ["numpy", "numba"])
def test_decode_into_writes_and_accumulates(name, implementation, monkeypatch):
    n = 4099
    codec = get_codec(name)
    rng = np.random.default_rng(3)
    g = _mixed(rng, n, 0)
    scales, codes, _ = oracle_push(name, g, np.zeros(n, np.float32))
    levels = np.frombuffer(scales, np.float32)
    hi, lo = (levels[0], levels[1]) if name == "1bit" else (levels[0], -levels[0])
    bits = np.unpackbits(np.frombuffer(codes, np.uint8), count=n, bitorder="little")
    expected = np.where(bits == 1, hi, lo)
    frames = [frame_array(scales, np.uint8), frame_array(codes, np.uint8)]  # read-only
    out = rng.standard_normal(n).astype(np.float32)
    codec.decode_into(frames, n, out, False, implementation)
    assert out.tobytes() == expected.tobytes()
    start = rng.standard_normal(n).astype(np.float32)
    out = start.copy()
    codec.decode_into(frames, n, out, True, implementation)
    assert out.tobytes() == (start + expected).tobytes()


@pytest.mark.parametrize("name", NAMES)
def test_decode_refuses_scales_that_are_not_finite(name):
    codec = get_codec(name)
    scales = np.array([np.inf, -1.0][: codec.scale_count(9)], np.float32).tobytes()
    aggregator = codec.make_aggregator(9, "float32")
    aggregator.result[:] = 1.0
    with pytest.raises(CodecError, match="non-finite scale"):
        aggregator.add([scales, bytes(2)], first=False)
    assert aggregator.result.tolist() == [1.0] * 9
    out = np.ones(9, np.float32)
    with pytest.raises(CodecError, match="unknown CPU kernel set"):
        codec.decode_into([bytes(len(scales)), bytes(2)], 9, out, True, "fortran")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_the_aggregator_sums_the_decoded_pushes_in_order(name, kernels, monkeypatch):
    n, workers = 1031, 3
    rng = np.random.default_rng(7)
    encoders = [_encoder(name, n, kernels, monkeypatch) for _ in range(workers)]
    aggregator = get_codec(name).make_aggregator(n, "float32")
    for _ in range(2):  # two rounds: the first push of each overwrites
        expected = None
        for rank, encoder in enumerate(encoders):
            frames = _push(encoder, _mixed(rng, n, rank))[:2]
            aggregator.add(list(frames), first=rank == 0)
            decoded = _decoded(name, frames, n)
            expected = decoded if expected is None else expected + decoded
        assert aggregator.result.tobytes() == expected.tobytes()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_checkpoint_round_trip(name, kernels, monkeypatch):
    n = 777
    rng = np.random.default_rng(11)
    grads = [_mixed(rng, n, step) for step in range(3)]
    encoder = _encoder(name, n, kernels, monkeypatch)
    for g in grads[:2]:
        encoder.encode(g)
    saved = encoder.state()
    assert list(saved) == ["residual"] and saved["residual"].dtype == np.float32
    restored = _encoder(name, n, kernels, monkeypatch)
    restored.load_state(saved)
    assert _push(restored, grads[2]) == _push(encoder, grads[2])


@pytest.mark.parametrize("name", NAMES)
def test_misaligned_values_and_metrics(name, monkeypatch):
    n = 4101
    rng = np.random.default_rng(13)
    base = _mixed(rng, n + 1, 0)
    reference = _encoder(name, n, "numpy", monkeypatch)
    compiled = _encoder(name, n, "numba", monkeypatch)
    assert _push(compiled, base[1:]) == _push(reference, base[1:])
    quality = compiled.quality(base[1:])
    assert quality.residual_sq == pytest.approx(float(np.sum(compiled.residual.astype(float) ** 2)))
    assert quality.sent_nonzero == n
