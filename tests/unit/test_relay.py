"""Relayed pulls: a worker's sum of a round's pushes must equal the server's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.codecs import get_codec
from kvstore.codecs.twobit import encode
from kvstore.errors import CodecError


def _round_of_pushes(numel: int, workers: int, threshold: float, seed: int) -> list[list]:
    """Each worker's 2-bit payload of one step (with some residual carried from a first step)."""
    rng = np.random.default_rng(seed)
    pushes = []
    for _ in range(workers):
        residual = np.zeros(numel, np.float32)
        encode(rng.normal(0, threshold, numel).astype(np.float32), residual, threshold)
        words = encode(rng.normal(0, threshold, numel).astype(np.float32), residual, threshold)
        pushes.append([words.tobytes()])
    return pushes


def _server_sum(codec, pushes, numel: int) -> np.ndarray:
    aggregator = codec.make_aggregator(numel, "float32")
    for i, payloads in enumerate(pushes):
        aggregator.add(payloads, first=i == 0)
    return aggregator.result.copy()


@pytest.mark.parametrize("numel", [1, 15, 16, 17, 2048, 2049, 100_003])
@pytest.mark.parametrize("workers", [1, 2, 3, 8])
@pytest.mark.parametrize("threshold", [0.5, 0.02, 1e-3])
def test_worker_sum_equals_the_server_sum_bit_for_bit(numel, workers, threshold):
    codec = get_codec("2bit", threshold=threshold)
    pushes = _round_of_pushes(numel, workers, threshold, seed=numel * 31 + workers)
    expected = _server_sum(codec, pushes, numel)
    out = np.full(numel, np.nan, np.float32)  # every element must be written
    codec.sum_relay(pushes, numel, "float32", out)
    assert out.tobytes() == expected.tobytes()


def test_order_matters_so_the_relay_keeps_it():
    # With t = 0.1 (not a power of two) float32 sums depend on the order of the additions; the
    # server relays pushes in the order it summed them, and the worker must follow it.
    t = np.float32(0.1)
    codec = get_codec("2bit", threshold=0.1)
    plus = encode(np.full(16, 0.1, np.float32), np.zeros(16, np.float32), 0.1).tobytes()
    minus = encode(np.full(16, -0.1, np.float32), np.zeros(16, np.float32), 0.1).tobytes()
    a = [[plus], [plus], [plus], [minus]]
    b = [[minus], [plus], [plus], [plus]]
    assert ((t + t) + t) - t != ((-t + t) + t) + t  # the premise: float32 order dependence
    for pushes in (a, b):
        out = np.empty(16, np.float32)
        codec.sum_relay(pushes, 16, "float32", out)
        assert out.tobytes() == _server_sum(codec, pushes, 16).tobytes()


def test_numpy_and_compiled_kernels_sum_alike(monkeypatch):
    pushes = _round_of_pushes(4099, 5, 0.02, seed=7)
    results = []
    for kernels in ("numpy", "numba"):
        monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
        codec = get_codec("2bit", threshold=0.02)
        out = np.empty(4099, np.float32)
        codec.sum_relay(pushes, 4099, "float32", out)
        results.append(out.tobytes())
    assert results[0] == results[1]


def test_relay_limit_keeps_relays_at_most_half_the_dense_bytes():
    twobit = get_codec("2bit", threshold=0.5)
    assert twobit.relay_limit(10_000_000, "float32") == 8  # 8 x n/4 bytes = half of 4n
    assert twobit.relay_limit(16, "float32") == 8
    assert twobit.relay_limit(1, "float32") == 0  # one word of codes for one float: never
    assert twobit.relay_limit(0, "float32") == 0
    assert get_codec("none").relay_limit(10_000_000, "float32") == 0


def test_bad_relays_are_refused_with_the_reason():
    codec = get_codec("2bit", threshold=0.5)
    out = np.empty(32, np.float32)
    with pytest.raises(CodecError, match="at least one push"):
        codec.sum_relay([], 32, "float32", out)
    with pytest.raises(CodecError, match=r"payload frames of \[8\] bytes, got \[4\]"):
        codec.sum_relay([[b"\x00" * 8], [b"\x00" * 4]], 32, "float32", out)
    with pytest.raises(CodecError, match="does not relay"):
        get_codec("none").sum_relay([[out.tobytes()]], 32, "float32", out)
