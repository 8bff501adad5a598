"""The 2-bit codec: numpy reference and compiled kernels against the per-element oracle."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from kvtest import oracle_decode, oracle_encode

from kvstore.codecs import get_codec, twobit
from kvstore.errors import CodecError

KERNELS = ["numpy", "numba"]
LENGTHS = [0, 1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 100, 255, 1000, 2047, 2048]
LENGTHS += [2049, 4097, 6160]  # around the compiled kernels' 2048-element blocks
THRESHOLDS = [1e-3, 0.1, 0.5, 1.0, 3.75]


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 bit patterns, so -0.0 != 0.0 and NaNs compare by payload."""
    return a.view(np.uint32)


def _inputs(rng: np.random.Generator, n: int, threshold: float, kind: str) -> np.ndarray:
    if kind == "normal":
        return (rng.standard_normal(n) * threshold * 1.5).astype(np.float32)
    if kind == "negative":
        return -np.abs(rng.standard_normal(n) * threshold * 2).astype(np.float32)
    if kind == "small":  # below the threshold: only the residual carries them over
        return (rng.standard_normal(n) * threshold * 0.2).astype(np.float32)
    if kind == "ties":  # exactly +-t, 0, -0.0 and neighbours of t
        t = np.float32(threshold)
        pool = np.array(
            [t, -t, 0.0, -0.0, np.nextafter(t, 0), -np.nextafter(t, 0), 2 * t, -2 * t],
            dtype=np.float32,
        )
        return rng.choice(pool, n).astype(np.float32)
    if kind == "wide":  # huge and tiny magnitudes, including denormals
        mags = 10.0 ** rng.uniform(-42, 30, n)
        return (np.sign(rng.standard_normal(n)) * mags).astype(np.float32)
    if kind == "special":  # inf, -inf and NaN among ordinary values
        pool = np.array([np.inf, -np.inf, np.nan, 0.3, -0.7, 1e30], dtype=np.float32)
        return rng.choice(pool, n).astype(np.float32)
    raise ValueError(kind)


def test_worked_example_from_the_design():
    g = np.array([0.6, -0.7, 0.1, 0.5, -0.5] + [0.0] * 10 + [1.0, 0.9], dtype=np.float32)
    expected_residual = np.array([0.1, -0.2, 0.1, 0, 0] + [0] * 10 + [0.5, 0.4], dtype=np.float32)
    oracle_residual = np.zeros(17, np.float32)
    oracle_bytes, codes = oracle_encode(g, oracle_residual, 0.5)
    assert oracle_bytes.hex() == "e3800003c0000000"
    np.testing.assert_allclose(oracle_residual, expected_residual, atol=1e-6)
    for kernels in KERNELS:
        residual = np.zeros(17, np.float32)
        words = twobit.encode(g, residual, 0.5, kernels=kernels)
        assert words.view(np.uint8).tobytes().hex() == "e3800003c0000000"
        assert [hex(w) for w in words] == ["0x30080e3", "0xc0"]
        assert np.array_equal(_bits(residual), _bits(oracle_residual))
        decoded = twobit.decode(words, 17, 0.5, kernels=kernels)
        expected = [0.5, -0.5, 0, 0.5, -0.5] + [0] * 10 + [0.5, 0.5]
        assert decoded.tolist() == expected
        assert np.array_equal(decoded, oracle_decode(codes, 0.5))


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("kind", ["normal", "negative", "small", "ties", "wide", "special"])
def test_encode_matches_oracle_for_many_lengths_and_thresholds(kernels, kind):
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    for n in LENGTHS:
        for threshold in THRESHOLDS:
            g = _inputs(rng, n, threshold, kind)
            start = (rng.standard_normal(n) * threshold * 0.5).astype(np.float32)
            r_oracle = start.copy()
            r_kernel = start.copy()
            expected, _ = oracle_encode(g, r_oracle, threshold)
            words = twobit.encode(g, r_kernel, threshold, kernels=kernels)
            assert words.view(np.uint8).tobytes() == expected, (n, threshold)
            assert np.array_equal(_bits(r_kernel), _bits(r_oracle)), (n, threshold)


@pytest.mark.parametrize("kernels", KERNELS)
def test_residual_carries_over_many_steps(kernels):
    rng = np.random.default_rng(7)
    n, threshold = 100, 0.3
    r_oracle = np.zeros(n, np.float32)
    r_kernel = np.zeros(n, np.float32)
    sent = np.zeros(n, np.float64)
    total = np.zeros(n, np.float64)
    for _ in range(50):
        g = (rng.standard_normal(n) * 0.1).astype(np.float32)  # mostly below t
        expected, codes = oracle_encode(g, r_oracle, threshold)
        words = twobit.encode(g, r_kernel, threshold, kernels=kernels)
        assert words.view(np.uint8).tobytes() == expected
        assert np.array_equal(_bits(r_kernel), _bits(r_oracle))
        sent += twobit.decode(words, n, threshold, kernels=kernels)
        total += g
        assert np.all(np.abs(r_kernel) < 2 * threshold + 1)
    # error feedback: what was sent plus what is kept is what was pushed
    np.testing.assert_allclose(sent + r_kernel, total, atol=1e-4)
    assert np.abs(sent).sum() > 0  # small gradients did get through, via the residual


@pytest.mark.parametrize("kernels", KERNELS)
def test_one_quantum_per_step(kernels):
    g = np.array([1.3, -1.3, 0.5, -0.5], dtype=np.float32)
    r = np.zeros(4, np.float32)
    words = twobit.encode(g, r, 0.5, kernels=kernels)
    assert twobit.decode(words, 4, 0.5, kernels=kernels).tolist() == [0.5, -0.5, 0.5, -0.5]
    np.testing.assert_allclose(r, [0.8, -0.8, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("kernels", KERNELS)
def test_decode_accumulates_and_ignores_padding_and_code_01(kernels):
    # Word with codes 11, 10, 01, 00 and garbage in the padding beyond n = 3.
    words = np.array([0b11_10_01_11 | 0xFFFFFF00], dtype=np.uint32)
    out = np.full(3, 1.0, np.float32)
    twobit.decode(words, 3, 0.25, out, accumulate=True, kernels=kernels)
    assert out.tolist() == [1.25, 0.75, 1.0]
    twobit.decode(words, 3, 0.25, out, accumulate=False, kernels=kernels)
    assert out.tolist() == [0.25, -0.25, 0.0]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, 2048, 4097, 6160])
def test_decode_matches_oracle(n):
    rng = np.random.default_rng(n)
    g = (rng.standard_normal(n)).astype(np.float32)
    _, codes = oracle_encode(g, np.zeros(n, np.float32), 0.5)
    words = twobit.encode(g, np.zeros(n, np.float32), 0.5)
    for kernels in KERNELS:
        assert np.array_equal(
            twobit.decode(words, n, 0.5, kernels=kernels), oracle_decode(codes, 0.5)
        )


def test_codec_objects_agree_with_functions():
    codec = get_codec("2bit", threshold=0.25)
    assert codec.params() == {"threshold": 0.25}
    assert codec.payload_nbytes(17, "float32") == (8,)
    assert codec.payload_nbytes(0, "float32") == (0,)
    rng = np.random.default_rng(3)
    encoder = codec.make_encoder(1000, "float32")
    aggregator = codec.make_aggregator(1000, "float32")
    residual = np.zeros(1000, np.float32)
    for step in range(3):
        g = rng.standard_normal(1000).astype(np.float32)
        (payload,) = encoder.encode(g)
        expected = twobit.encode(g, residual, 0.25)
        assert bytes(payload) == bytes(expected)
        aggregator.add([bytes(payload)], first=True)
        aggregator.add([bytes(payload)], first=False)
        np.testing.assert_array_equal(aggregator.result, 2 * twobit.decode(expected, 1000, 0.25))
        assert np.array_equal(encoder.residual, residual), step


@pytest.mark.parametrize(
    "bad", [0, 0.0, -0.5, float("nan"), float("inf"), 1e-50, "0.5", None, True]
)
def test_bad_thresholds_are_rejected(bad):
    with pytest.raises(CodecError, match="threshold"):
        get_codec("2bit", threshold=bad)
    with pytest.raises(CodecError, match="threshold"):
        twobit.encode(np.zeros(4, np.float32), np.zeros(4, np.float32), bad)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_non_float32_input_is_rejected(dtype):
    with pytest.raises(CodecError, match="float32"):
        twobit.encode(np.zeros(4, dtype), np.zeros(4, np.float32), 0.5)
    codec = get_codec("2bit")
    with pytest.raises(CodecError, match="float32"):
        codec.make_encoder(4, np.dtype(dtype).name)


def test_unknown_codec_and_parameters_are_rejected():
    with pytest.raises(CodecError, match=r"unknown codec '3bit'.*2bit.*none"):
        get_codec("3bit")
    with pytest.raises(CodecError, match="unknown parameter.*'thresold'.*threshold"):
        get_codec("2bit", thresold=0.5)
    with pytest.raises(CodecError, match="unknown CPU kernel set"):
        twobit.cpu_kernels("fortran")


def test_kernel_choice_follows_the_environment(monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numpy")
    assert twobit.cpu_kernels()[0] is twobit.encode_reference
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numba")
    assert twobit.cpu_kernels()[0] is not twobit.encode_reference
