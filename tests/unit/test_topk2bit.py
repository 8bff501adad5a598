"""The ``topk2bit`` codec: a hand-computed push, the numpy reference against the encoder and the
numba kernels, the residual identity, the server's decode and sum, payload validation, and the
codec's declared limits (no relay), and compressed pulls that hold the server's bits."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.codecs import get_codec
from kvstore.codecs.pulled import DELTA, HeldWeights, PublishedWeights, pull_codec_from_spec
from kvstore.codecs.sparse import top_count
from kvstore.codecs.sparse.topk import top_selection
from kvstore.codecs.sparse.topk2bit import (
    decode_reference,
    encode_reference,
    levels,
    quantize_reference,
)
from kvstore.errors import CodecError


def _key_encoder(numel, bounds, kernels, monkeypatch, **params):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
    return get_codec("topk2bit", **params).make_key_encoder("w", numel, "float32", bounds)


def _push(key_encoder, grad):
    """One push: each chunk's frames as bytes."""
    key_encoder.begin(grad)
    return [[bytes(memoryview(f).cast("B")) for f in c.encode(None)] for c in key_encoder.chunks]


def _decoded(frames_per_chunk, bounds, numel):
    """The dense values the pushes decode to (the numpy decoder)."""
    out = np.zeros(numel, np.float32)
    for (start, _), (idx, codes, bounds_frame) in zip(bounds, frames_per_chunk, strict=True):
        indices = np.frombuffer(idx, np.uint32).astype(np.int64)
        lo, hi = np.frombuffer(bounds_frame, np.float32)
        out[start + indices] = decode_reference(
            np.frombuffer(codes, np.uint8), indices.size, lo, hi
        )
    return out


def _payload(indices, codes, lo_hi):
    return [
        np.array(indices, np.uint32).tobytes(),
        np.array(codes, np.uint8).tobytes(),
        np.array(lo_hi, np.float32).tobytes(),
    ]


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_a_hand_computed_push(kernels, monkeypatch):
    # k = ceil(0.5 * 8) = 4: |-4|, 8, |-6|, 2 are the largest (indices 1, 3, 5, 6).
    grad = np.array([1, -4, 0.5, 8, -1, -6, 2, 0], np.float32)
    encoder = _key_encoder(8, [(0, 4), (4, 8)], kernels, monkeypatch, ratio=0.5, sample=0)
    (idx0, codes0, range0), (idx1, codes1, range1) = _push(encoder, grad)
    # chunk 0 sends -4 and 8: lo 4, hi 8, mid 6; decoded magnitudes 5 (low) and 7 (high).
    assert np.frombuffer(idx0, np.uint32).tolist() == [1, 3]
    assert np.frombuffer(range0, np.float32).tolist() == [4.0, 8.0]
    # -4: sign 1, magnitude 0 -> code 2; 8: sign 0, magnitude 1 -> code 1, in bits 2-3.
    assert codes0 == bytes([0b0110])
    # chunk 1 sends -6 and 2 (local 1, 2): lo 2, hi 6, mid 4; low 3, high 5.
    assert np.frombuffer(idx1, np.uint32).tolist() == [1, 2]
    assert np.frombuffer(range1, np.float32).tolist() == [2.0, 6.0]
    # -6: code 3; 2: code 0.
    assert codes1 == bytes([0b0011])
    decoded = _decoded([(idx0, codes0, range0), (idx1, codes1, range1)], encoder.bounds, 8)
    assert decoded.tolist() == [0, -5, 0, 7, 0, -5, 3, 0]
    # the residual keeps what was not sent and the quantization error of what was
    assert encoder.state["residual"].tolist() == [1, 1, 0.5, 1, -1, -1, -1, 0]
    # the metrics' view of chunk 0: what was pushed, what is kept, what was sent as nonzero
    assert tuple(encoder.chunks[0].quality(grad[:4])) == (1 + 16 + 0.25 + 64, 3.25, 2)


def test_equal_magnitudes_decode_exactly():
    codes, lo, hi, decoded = quantize_reference(np.array([-3, 3, 3, -3, 3], np.float32))
    assert (lo, hi) == (3, 3)
    assert decoded.tolist() == [-3, 3, 3, -3, 3]
    assert codes.tolist() == [0b11_01_01_11, 0b01]  # codes 3, 1, 1, 3; then 1 and unused 0s
    assert decode_reference(codes, 5, lo, hi).tolist() == decoded.tolist()


def test_levels_are_float32_and_inside_the_range():
    mid, low, high = levels(np.float32(1e-3), np.float32(3e38))  # lo + hi would overflow
    assert all(isinstance(x, np.float32) for x in (mid, low, high))
    assert np.float32(1e-3) < low < mid < high < np.float32(3e38)


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
@pytest.mark.parametrize("sample", [0, 0.05])
def test_the_encoder_is_the_numpy_reference(kernels, sample, monkeypatch):
    numel, bounds = 5003, [(0, 1024), (1024, 3000), (3000, 5003)]
    encoder = _key_encoder(numel, bounds, kernels, monkeypatch, ratio=0.02, sample=sample)
    residual = np.zeros(numel, np.float32)
    rng = np.random.default_rng(3)
    for step in range(8):
        grad = (rng.standard_t(1.5, numel) * 0.1).astype(np.float32)
        frames = _push(encoder, grad)
        selection = top_selection(numel, 0.02, sample, 0, encoder.key_hash, step)
        want = encode_reference(residual, grad, selection.k, selection.sample, bounds)
        for got, (idx, codes, lo, hi) in zip(frames, want, strict=True):
            assert got == [idx.tobytes(), codes.tobytes(), np.array([lo, hi]).tobytes()]
        assert encoder.state["residual"].tobytes() == residual.tobytes()


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_the_residual_is_what_was_there_plus_the_gradient_minus_what_was_sent(kernels, monkeypatch):
    numel, bounds = 4099, [(0, 1000), (1000, 4099)]
    encoder = _key_encoder(numel, bounds, kernels, monkeypatch, ratio=0.03)
    rng = np.random.default_rng(11)
    k = top_count(0.03, numel)
    for _ in range(10):
        grad = rng.normal(0, 1, numel).astype(np.float32)
        before = encoder.state["residual"].copy()
        frames = _push(encoder, grad)
        decoded = _decoded(frames, bounds, numel)
        sent = sum(len(f[0]) // 4 for f in frames)
        assert k // 2 <= sent <= 13 * k // 10 + 1
        # bit for bit: (r + g) - decoded, with decoded 0 where nothing was sent
        assert encoder.state["residual"].tobytes() == ((before + grad) - decoded).tobytes()


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_the_server_decodes_and_sums_pushes_in_arrival_order(kernels, monkeypatch):
    numel, bounds = 3001, [(0, 3001)]
    codec = get_codec("topk2bit", ratio=0.05)
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
    aggregator = codec.make_aggregator(numel, "float32")
    aggregator.result[:] = np.nan  # the first push must overwrite every element
    expected = np.zeros(numel, np.float32)
    rng = np.random.default_rng(5)
    for worker in range(3):
        encoder = _key_encoder(numel, bounds, kernels, monkeypatch, ratio=0.05)
        (frames,) = _push(encoder, rng.normal(0, 1, numel).astype(np.float32))
        aggregator.add(frames, first=worker == 0)
        expected += _decoded([frames], bounds, numel)
    aggregator.add(_payload([], [], [0, 0]), first=False)  # a push that sent nothing
    assert aggregator.finish() is None
    assert aggregator.result.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    "payloads, match",
    [
        (_payload([1], [0], [1, 2])[:2], "needs 3 payload frames"),
        ([b"\0" * 6, b"\0" * 2, b"\0" * 8], "not whole uint32s"),
        (_payload([1, 2, 3], [], [1, 2]), "3 indices need 1 code bytes, got 0"),
        (_payload([1, 2], [0, 0], [1, 2]), "2 indices need 1 code bytes, got 2"),
        (_payload([1], [0], [1]), "must be 8 bytes, got 4"),
        (_payload([1], [0], [2, 1]), r"needs 0 <= lo <= hi"),
        (_payload([1], [0], [-1, 1]), r"needs 0 <= lo <= hi"),
        (_payload([1], [0], [np.nan, 1]), "not finite"),
        (_payload([1], [0], [0, np.inf]), "not finite"),
        (_payload([1, 2], [0b010000], [1, 2]), "unused bits of the last code byte"),
        (_payload([2, 2], [0], [1, 2]), "strictly ascending, but index 1 is 2 after 2"),
        (_payload([3, 10], [0], [1, 2]), "index 10 is out of range"),
        (_payload(range(11), [0, 0, 0], [1, 2]), "more than the chunk's elements"),
    ],
)
def test_malformed_payloads_are_refused_with_the_reason(payloads, match):
    codec = get_codec("topk2bit")
    with pytest.raises(CodecError, match=match):
        codec.validate_payloads(payloads, 10, "float32")
    aggregator = codec.make_aggregator(10, "float32")
    aggregator.result[:] = 7
    with pytest.raises(CodecError):
        aggregator.add(payloads, first=True)
    assert (aggregator.result == 7).all()  # untouched


def test_non_finite_gradients_are_refused_before_the_state_changes(monkeypatch):
    encoder = _key_encoder(100, [(0, 100)], "numba", monkeypatch, ratio=0.1)
    _push(encoder, np.linspace(-1, 1, 100, dtype=np.float32))
    saved = encoder.chunks[0].state()
    with pytest.raises(CodecError, match="NaN or infinite"):
        encoder.begin(np.full(100, np.inf, np.float32))
    assert encoder.state["residual"].tobytes() == saved["residual"].tobytes()


def test_saved_state_resumes_bit_identically(monkeypatch):
    numel, bounds = 2000, [(0, 1000), (1000, 2000)]
    grads = [np.random.default_rng(s).normal(0, 1, numel).astype(np.float32) for s in range(6)]
    first = _key_encoder(numel, bounds, "numba", monkeypatch, ratio=0.02)
    for grad in grads[:3]:
        _push(first, grad)
    saved = [chunk.state() for chunk in first.chunks]
    resumed = _key_encoder(numel, bounds, "numba", monkeypatch, ratio=0.02)
    for chunk, state in zip(resumed.chunks, saved, strict=True):
        chunk.load_state(state)
    for grad in grads[3:]:
        assert _push(resumed, grad) == _push(first, grad)


def test_payload_size_and_declared_limits():
    codec = get_codec("topk2bit", ratio=0.01)
    assert codec.spec() == {"type": "topk2bit", "ratio": 0.01, "sample": 0.01}
    # 10 000 elements: 100 kept, 400 index bytes + 25 code bytes + 8 range bytes
    assert codec.pushed_fraction(10_000, "float32") == 433 / 40_000
    assert not codec.relayable
    assert codec.relay_limit(10_000, "float32") == 0
    with pytest.raises(CodecError, match="does not relay"):
        codec.sum_relay([], 10, "float32", np.zeros(10, np.float32))
    assert pull_codec_from_spec({"type": "topk2bit", "ratio": 0.05}) == get_codec(
        "topk2bit", ratio=0.05
    )
    with pytest.raises(CodecError, match="float32"):
        codec.make_aggregator(10, "float16")


def test_compressed_pulls_hold_the_servers_bits_and_carry_the_error():
    codec = pull_codec_from_spec({"type": "topk2bit", "ratio": 0.05, "sample": 0})
    rng = np.random.default_rng(2)
    weights = rng.normal(size=1000).astype(np.float32)
    published = PublishedWeights(codec, "w", weights)
    held = HeldWeights(codec, 1000)
    kind, frames = published.reply(-1)
    held.apply(kind, published.version, -1, frames)
    start = weights
    for _ in range(40):
        weights = weights + (rng.normal(size=1000) * 0.01).astype(np.float32)
        published.advance(weights)
        kind, frames = published.reply(held.version)
        assert kind == DELTA
        nbytes = held.apply(kind, published.version, published.version - 1, frames)
        assert nbytes == 50 * 4 + 13 + 8  # 50 indices, 13 code bytes, lo and hi
        assert held.w_pub.tobytes() == published.w_pub.tobytes()
    # the deltas carried most of the change; the rest is still owed (error feedback)
    owed, moved = np.linalg.norm(weights - held.w_pub), np.linalg.norm(weights - start)
    assert 0 < owed < moved / 2, (owed, moved)
