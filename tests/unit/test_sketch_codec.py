"""The ``sketch`` codec's parameters, chunk sizes, linearity, recovery and hostile payloads."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvstore.codecs import codec_from_spec
from kvstore.codecs.sketch import share
from kvstore.codecs.sketch.hashing import sketch_reference
from kvstore.errors import CodecError


def _codec(**params):
    return codec_from_spec({"type": "sketch", **params})


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"rows": 4}, "odd"),
        ({"rows": 17}, "odd"),
        ({"rows": True}, "rows"),
        ({"columns": 0}, "at least 1"),
        ({"columns": 1.5}, "(0, 1]"),
        ({"columns": "wide"}, "columns"),
        ({"k": 0.0}, "(0, 1]"),
        ({"k": -3}, "at least 1"),
        ({"momentum": 1.0}, "[0, 1)"),
        ({"exact": "yes"}, "exact"),
        ({"seed": -1}, "seed"),
        ({"colums": 10}, "did you mean"),
    ],
)
def test_bad_parameters_are_refused_by_name(params, needle):
    with pytest.raises(CodecError, match=re.escape(needle)):
        _codec(**params)


def test_counts_and_fractions_are_shared_out_by_chunk():
    assert share(100, 250, 1000) == 25 and share(100, 1, 1000) == 1
    assert share(0.02, 1000, 5000) == 20 and share(0.07, 100, 100) == 7
    codec = _codec(columns=300, k=30)
    plans = [codec.plan(a, b - a, 3000) for a, b in [(0, 1000), (1000, 3000)]]
    assert [(p.columns, p.k, p.candidates) for p in plans] == [(100, 10, 20), (200, 20, 40)]
    assert not any(p.dense for p in plans)
    narrow = codec.plan(0, 400, 3000)  # 40 columns: raised to the floor of 64
    assert (narrow.columns, narrow.dense) == (64, False)
    small = codec.plan(0, 300, 300)  # 5 rows of 64 columns would be larger than 300 values
    assert small.dense and small.pushed == 300 and small.k == 30


def test_the_servers_sum_of_sketches_is_the_sketch_of_the_sum():
    codec = _codec(columns=0.1, momentum=0.0)
    rng = np.random.default_rng(3)
    grads = [rng.normal(0, 1, 5000).astype(np.float32) for _ in range(3)]
    encoder = codec.make_key_encoder("w", 5000, "float32", [(0, 5000)])
    aggregator = codec.make_chunk_aggregator(5000, "float32", shape=(5000,), start=0, key="w")
    for i, g in enumerate(grads):
        aggregator.add([bytes(encoder.chunks[0].encode(g)[0])], i == 0)
    summed = aggregator._sum
    direct = sketch_reference(sum(grads), codec.row_keys("w"), 0, 500)
    # Each table is its exact integer sum rounded once to float32, and the server's two
    # additions round once more each: at most eps/2 of each magnitude involved.
    tables = [sketch_reference(g, codec.row_keys("w"), 0, 500) for g in grads]
    bound = 2 * np.finfo(np.float32).eps * (sum(np.abs(t) for t in tables) + np.abs(direct))
    assert np.all(np.abs(summed - direct) <= bound)
    assert sum(tables[1:], tables[0]).tobytes() == summed.tobytes()  # the server's own sum
    assert not np.array_equal(summed, np.zeros_like(summed))


def test_few_nonzeros_and_enough_columns_are_recovered_exactly():
    codec = _codec(columns=2000, k=12, momentum=0.0)
    aggregator = codec.make_chunk_aggregator(20_000, "float32", shape=(20_000,), start=0, key=3)
    encoder = codec.make_key_encoder(3, 20_000, "float32", [(0, 20_000)])
    assert not aggregator.plan.dense
    rng = np.random.default_rng(0)
    total = np.zeros(20_000, np.float32)
    for rank in range(2):
        g = np.zeros(20_000, np.float32)
        g[rng.choice(20_000, 6, replace=False)] = rng.normal(0, 3, 6).astype(np.float32)
        total += g
        aggregator.add([bytes(encoder.chunks[0].encode(g)[0])], rank == 0)
    assert aggregator.finish() is None
    assert aggregator.result.tobytes() == total.tobytes()


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ([b"\0" * 8], "needs 1280 bytes"),
        ([np.zeros(320, np.float32), b""], "1 payload frame"),
        ([np.full(320, np.nan, np.float32)], "NaN or infinite"),
        ([np.full(320, np.inf, np.float32)], "NaN or infinite"),
    ],
)
def test_a_bad_push_is_refused_before_the_state_changes(frames, needle):
    codec = _codec(columns=5, k=2)  # (64 columns: the floor)
    aggregator = codec.make_chunk_aggregator(1000, "float32", shape=(1000,), start=0, key="w")
    aggregator.momentum += 1
    before = {name: array.copy() for name, array in aggregator.state().items()}
    with pytest.raises(CodecError, match=needle):
        aggregator.add(frames, True)
    for name, array in aggregator.state().items():
        np.testing.assert_array_equal(array, before[name])


def test_server_optimizers_that_would_double_momentum_or_clip_are_refused():
    fetch, exact = _codec(), _codec(exact=True)
    fetch.check_optimizer("sgd", {"momentum": 0.0, "nesterov": False, "clip_gradient": None})
    for name, params, needle in [
        ("sgd", {"momentum": 0.9}, "momentum=0"),
        ("sgd", {"momentum": 0.0, "nesterov": True}, "nesterov"),
        ("sgd", {"momentum": 0.0, "clip_gradient": 1.0}, "clip"),
        ("adam", {"beta1": 0.0}, "'sgd'"),
    ]:
        with pytest.raises(CodecError, match=needle):
            fetch.check_optimizer(name, params)
    exact.check_optimizer("adam", {"beta1": 0.0})
    with pytest.raises(CodecError, match="again"):
        exact.check_optimizer("sgd", {"momentum": 0.9})


def test_a_worker_refuses_a_reply_that_is_not_indices_of_its_chunk():
    codec = _codec(columns=10, k=4, exact=True)
    chunk = codec.make_key_encoder("w", 400, "float32", [(0, 400)]).chunks[0]
    chunk.encode(np.ones(400, np.float32))
    for reply, needle in [
        ([np.array([3, 2], np.uint32)], "ascending"),
        ([np.array([400], np.uint32)], "out of range"),
        ([np.arange(9, dtype=np.uint32)], "more than"),
        ([b"\0" * 3], "whole uint32"),
    ]:
        with pytest.raises(CodecError, match=needle):
            chunk.next_round(reply)


def test_aggregator_state_round_trips_and_checks_its_shapes():
    codec = _codec(columns=0.1, k=0.01)
    aggregator = codec.make_chunk_aggregator(1000, "float32", shape=(1000,), start=0, key="w")
    state = {name: np.full(a.shape, 2.0, np.float32) for name, a in aggregator.state().items()}
    aggregator.check_state(state)
    aggregator.load_state(state)
    assert float(aggregator.error.sum()) == 2.0 * aggregator.error.size
    aggregator.load_state(None)
    assert not aggregator.error.any() and not aggregator.momentum.any()
    with pytest.raises(CodecError, match="chunk sizes"):
        aggregator.check_state({name: np.zeros(7, np.float32) for name in state})


def test_a_failed_exact_round_starts_over_with_a_sketch():
    codec = _codec(columns=10, k=4, exact=True)
    aggregator = codec.make_chunk_aggregator(400, "float32", shape=(400,), start=0, key="w")
    chunk = codec.make_key_encoder("w", 400, "float32", [(0, 400)]).chunks[0]
    table = bytes(chunk.encode(np.arange(400, dtype=np.float32))[0])
    aggregator.add([table], True)
    candidates = aggregator.finish()
    assert candidates is not None and len(bytes(candidates[0])) == 4 * 8
    with pytest.raises(CodecError, match="exact values of the candidates"):
        aggregator.add([table], True)  # a table where the candidates' values belong
    aggregator.abandon()  # what the server does with a round that failed
    aggregator.add([table], True)
    assert bytes(aggregator.finish()[0]) == bytes(candidates[0])
