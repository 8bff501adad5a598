"""The ``powersgd`` codec without servers: the defined matmuls against a per-element oracle, the
numba kernels against the numpy reference (payloads and state, push after push), the server's
aggregator round by round, which keys and chunks are compressed, parameters, non-finite values
and checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest
from codec_parity import host_bytes, play_rounds

from kvstore.codecs import codec_from_spec, powersgd
from kvstore.codecs.base import Encoder
from kvstore.codecs.powersgd import PowerSGDAggregator, PowerSGDEncoder
from kvstore.errors import CodecError
from kvstore.topology import plan_chunks


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _dot(a, b):
    """The defined dot product, one element at a time: float64 (Python float) sums from +0.0 in
    index order of exact products of float32 values, rounded once to float32."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        total += float(x) * float(y)
    return np.float32(total)


# the defined matmuls ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows, cols, rank", [(1, 3, 1), (3, 5, 2), (7, 4, 3)])
def test_references_are_the_per_element_definition(rows, cols, rank):
    rng = np.random.default_rng(rows * 100 + cols)
    m, q, p = _f32(rng, rows, cols), _f32(rng, cols, rank), _f32(rng, rows, rank)
    m[0, 0] = np.float32(1e-40)  # a subnormal term survives
    project = powersgd.project_reference(m, q)
    back = powersgd.back_project_reference(m, p)
    approx = powersgd.approximation_reference(p, q)
    for i in range(rows):
        for k in range(rank):
            assert project[i, k] == _dot(m[i, :], q[:, k])
    for j in range(cols):
        for k in range(rank):
            assert back[j, k] == _dot(m[:, j], p[:, k])
    for i in range(rows):
        for j in range(cols):
            assert approx[i, j] == _dot(p[i, :], q[j, :])


def test_a_sum_starts_from_positive_zero():
    # -0.0 + nothing else: the sum is +0.0 (0.0 + -0.0), in every implementation
    m = np.array([[-0.0]], dtype=np.float32)
    out = powersgd.project_reference(m, np.ones((1, 1), np.float32))
    assert np.signbit(out[0, 0]) == np.False_


def test_gram_schmidt_orthonormalizes_and_keeps_a_zero_column_zero():
    rng = np.random.default_rng(1)
    p = rng.standard_normal((20, 3))
    p[:, 2] = 0.0
    powersgd.orthonormalize(p)
    gram = p[:, :2].T @ p[:, :2]
    assert np.allclose(gram, np.eye(2), atol=1e-7)  # (eps: norms a hair under 1)
    assert not p[:, 2].any()


def test_the_initial_factor_is_the_same_for_every_worker_and_close_to_normal():
    a = powersgd.initial_factor(5, 123, 500, 4)
    assert a.dtype == np.float32 and a.shape == (500, 4)
    assert np.array_equal(a, powersgd.initial_factor(5, 123, 500, 4))
    assert not np.array_equal(a, powersgd.initial_factor(6, 123, 500, 4))
    assert not np.array_equal(a, powersgd.initial_factor(5, 124, 500, 4))
    assert abs(float(a.mean())) < 0.1 and abs(float(a.std()) - 1) < 0.1
    codec = codec_from_spec({"type": "powersgd", "rank": 4, "seed": 5})
    encoders = [
        codec.make_key_encoder("w", 2000, "float32", [(0, 2000)], worker=w, shape=(40, 50))
        for w in range(2)
    ]
    assert np.array_equal(encoders[0].chunks[0].factor, encoders[1].chunks[0].factor)


# which keys and chunks are compressed -------------------------------------------------------------


def test_keys_that_cannot_gain_are_dense():
    assert powersgd.key_matrix(None, 4) is None
    assert powersgd.key_matrix((1000,), 4) is None  # 1-D
    assert powersgd.key_matrix((8, 8), 4) is None  # (8 + 8) * 4 * 2 >= 64
    assert powersgd.key_matrix((0, 100), 4) is None
    assert powersgd.key_matrix((64, 3, 3, 3), 4) == (64, 27, 4)
    assert powersgd.key_matrix((100, 50), 4) == (100, 50, 4)
    assert powersgd.key_matrix((100, 50), 30) is None  # (100 + 50) * 30 * 2 >= 5000


def test_a_chunk_is_compressed_only_with_whole_rows_that_gain():
    shape = (40, 50)
    assert powersgd.chunk_matrix(shape, 0, 2000, 2) == powersgd.ChunkMatrix(40, 50, 2)
    assert powersgd.chunk_matrix(shape, 500, 1000, 2) == powersgd.ChunkMatrix(20, 50, 2)
    assert powersgd.chunk_matrix(shape, 16, 1984, 2) is None  # not on a row boundary
    assert powersgd.chunk_matrix(shape, 0, 1008, 2) is None  # ends mid-row
    assert powersgd.chunk_matrix(shape, 0, 50, 2) is None  # one row never gains
    assert powersgd.chunk_matrix(shape, 0, 2000, 8) == powersgd.ChunkMatrix(40, 50, 8)
    assert powersgd.chunk_matrix(shape, 0, 1000, 8) is None  # the key gains, this half not


def test_the_chunks_of_a_compressed_key_hold_whole_rows():
    codec = codec_from_spec({"type": "powersgd"})
    assert codec.chunk_alignment((1000,)) == 16
    assert codec.chunk_alignment((8, 8)) == 16
    assert codec.chunk_alignment((300, 3, 3, 3)) == math.lcm(16, 27) == 432
    chunks = plan_chunks("w", 300 * 27, 3, bigarray_bound=1000, partition_elems=1024, alignment=432)
    assert len({c.server for c in chunks}) == 3 and len(chunks) > 3
    for chunk in chunks:
        assert chunk.start % 27 == 0 and chunk.numel % 27 == 0 and chunk.numel <= 1024 + 15
    compressed = [powersgd.chunk_matrix((300, 3, 3, 3), c.start, c.numel, 4) for c in chunks]
    assert sum(m is not None for m in compressed) >= len(chunks) - 3  # (short slice tails)


def test_aligned_plans_keep_chunks_within_a_partition_and_refuse_bad_alignments():
    # 1024-element partition, rows of 27 (alignment 432): a slice's tail that would push its
    # last chunk past the partition becomes a chunk of its own
    for rows in range(1, 200):
        chunks = plan_chunks(
            "k", rows * 27, 2, bigarray_bound=1000, partition_elems=1024, alignment=432
        )
        assert sum(c.numel for c in chunks) == rows * 27
        assert all(c.numel % 27 == 0 and 0 < c.numel <= 1024 for c in chunks)
    for bad in (0, 24, 2048):
        with pytest.raises(ValueError, match="alignment"):
            plan_chunks("k", 100, 1, bigarray_bound=1000, partition_elems=1024, alignment=bad)


def test_one_dimensional_and_small_keys_push_dense_once():
    codec = codec_from_spec({"type": "powersgd", "rank": 4})
    grad = np.arange(64, dtype=np.float32)
    for shape in [(64,), (8, 8), None]:
        key = codec.make_key_encoder("b", 64, "float32", [(0, 32), (32, 64)], shape=shape)
        key.begin(grad)
        for chunk, (start, stop) in zip(key.chunks, [(0, 32), (32, 64)], strict=True):
            frames = chunk.encode(grad[start:stop])
            assert chunk.round_trips == 1 and chunk.state() == {}
            assert np.array_equal(
                np.frombuffer(host_bytes(frames[0]), np.float32), grad[start:stop]
            )
    aggregator = codec.make_chunk_aggregator(32, "float32", shape=(64,), start=0)
    aggregator.add([grad[:32]], True)
    aggregator.add([grad[:32]], False)
    assert aggregator.finish() is None and aggregator.reply_frames() is None
    assert np.array_equal(aggregator.result, 2 * grad[:32])


# the encoder and the aggregator -----------------------------------------------------------------


def _chunk_encoders(spec, shape, bounds, workers=1, kernels="numba", monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
    codec = codec_from_spec(spec)
    numel = math.prod(shape)
    keys = [
        codec.make_key_encoder("w", numel, "float32", bounds, worker=w, shape=shape)
        for w in range(workers)
    ]
    aggregators = [
        codec.make_chunk_aggregator(b - a, "float32", shape=shape, start=a) for a, b in bounds
    ]
    return codec, keys, aggregators


def _step(keys, aggregators, bounds, grads):
    """One step of every worker through one-worker-per-round aggregators; returns the dense
    results per chunk and every payload sent (bytes)."""
    sent = []
    for key, grad in zip(keys, grads, strict=True):
        key.begin(grad)
    results = []
    for index, (start, stop) in enumerate(bounds):
        agg = aggregators[index]
        chunks = [key.chunks[index] for key in keys]
        first = [
            [host_bytes(f) for f in c.encode(g[start:stop])]
            for c, g in zip(chunks, grads, strict=True)
        ]
        sent += first
        for w, frames in enumerate(first):
            agg.add(frames, w == 0)
        reply = agg.finish()
        if reply is not None:
            reply = [host_bytes(f) for f in reply]
            second = [[host_bytes(f) for f in c.next_round(reply)] for c in chunks]
            sent += second
            for w, frames in enumerate(second):
                agg.add(frames, w == 0)
            assert agg.finish() is None
            ack = [host_bytes(f) for f in agg.reply_frames()]
            for c in chunks:
                c.end_step(ack)
        results.append(agg.result.copy())
    return np.concatenate(results), sent


def test_rank_r_gradients_are_summed_exactly_and_errors_add_up():
    shape, bounds = (40, 24), [(0, 480), (480, 960)]
    _, keys, aggregators = _chunk_encoders({"type": "powersgd", "rank": 2}, shape, bounds, 2)
    rng = np.random.default_rng(3)
    u = _f32(rng, 40, 2)
    grads = [(u @ _f32(rng, 2, 24)).ravel() for _ in range(2)]
    result, _ = _step(keys, aggregators, bounds, grads)
    want = grads[0] + grads[1]
    assert np.allclose(result, want, atol=1e-5 * np.abs(want).max())
    # summed over workers, the errors are exactly what the server did not apply (to rounding)
    errors = sum(np.concatenate([c.error for c in key.chunks]) for key in keys)
    assert np.allclose(errors, want - result, atol=1e-6 * np.abs(want).max())


def test_the_round_trips_of_a_step():
    shape, bounds = (16, 40), [(0, 640)]
    spec = {"type": "powersgd", "rank": 3, "warmup_steps": 1}
    _, keys, aggregators = _chunk_encoders(spec, shape, bounds)
    chunk, aggregator = keys[0].chunks[0], aggregators[0]
    grad = np.random.default_rng(0).standard_normal(640).astype(np.float32)
    # warm-up: dense, one round, the error stays zero
    keys[0].begin(grad)
    frames = chunk.encode(grad)
    assert chunk.round_trips == 1 and np.array_equal(frames[0], grad) and not chunk.error.any()
    # then P (16 x 3), the orthonormal P_hat back, Q (40 x 3), Q_sum back
    keys[0].begin(grad)
    frames = chunk.encode(grad)
    assert chunk.round_trips == 2 and len(host_bytes(frames[0])) == 4 * 16 * 3
    aggregator.add(frames, True)
    p_hat = np.frombuffer(host_bytes(aggregator.finish()[0]), np.float32).reshape(16, 3)
    assert np.allclose(p_hat.T @ p_hat, np.eye(3), atol=1e-5)
    q = chunk.next_round([p_hat.tobytes()])
    assert len(host_bytes(q[0])) == 4 * 40 * 3
    aggregator.add(q, True)
    assert aggregator.finish() is None
    q_sum = aggregator.reply_frames()
    assert host_bytes(q_sum[0]) == host_bytes(q[0])  # one worker: Q_sum is its Q
    q_values = np.frombuffer(host_bytes(q[0]), np.float32)
    want = powersgd.approximation_reference(p_hat, q_values.reshape(40, 3))
    assert np.array_equal(aggregator.result, want.ravel())
    chunk.end_step(q_sum)
    assert np.array_equal(chunk.factor, q_values)
    assert np.array_equal(chunk.error, grad - want.ravel())


def test_the_aggregator_refuses_what_does_not_fit_the_round():
    aggregator = PowerSGDAggregator(640, powersgd.ChunkMatrix(16, 40, 3))
    with pytest.raises(CodecError, match="takes dense"):
        aggregator.add([np.zeros(7, np.float32)], True)
    with pytest.raises(CodecError, match="one frame"):
        aggregator.add([np.zeros(48, np.float32)] * 2, True)
    aggregator.add([np.ones(48, np.float32)], True)  # a P round
    with pytest.raises(CodecError, match="takes P"):
        aggregator.add([np.ones(640, np.float32)], False)  # a dense push in it
    bad = np.ones(48, np.float32)
    bad[5] = np.nan
    with pytest.raises(CodecError, match="NaN"):
        aggregator.add([bad], False)
    assert aggregator.finish() is not None
    with pytest.raises(CodecError, match="takes Q"):  # the Q round must follow
        aggregator.add([np.ones(48, np.float32)], True)


def test_an_encoder_refuses_replies_out_of_turn():
    _, keys, _ = _chunk_encoders({"type": "powersgd"}, (16, 40), [(0, 640)])
    chunk = keys[0].chunks[0]
    with pytest.raises(CodecError, match="outside"):
        chunk.next_round([np.zeros(64, np.float32)])
    keys[0].begin(np.ones(640, np.float32))
    chunk.encode(np.ones(640, np.float32))
    with pytest.raises(CodecError, match="must hold 64 float32"):
        chunk.next_round([np.zeros(63, np.float32)])
    with pytest.raises(CodecError, match="outside"):
        chunk.end_step([np.zeros(160, np.float32)])
    with pytest.raises(CodecError, match="once per step"):
        Encoder.next_round(chunk, [])


@pytest.mark.parametrize(
    "shape, bounds, rank",
    [
        ((48, 64), [(0, 1536), (1536, 3072)], 2),
        ((40, 30), [(0, 660), (660, 1200)], 5),  # rows not a multiple of 4, rank above 4
        ((21, 20), [(0, 420)], 1),
    ],
)
def test_numba_kernels_match_the_numpy_reference_push_after_push(shape, bounds, rank, monkeypatch):
    spec = {"type": "powersgd", "rank": rank, "warmup_steps": 1, "seed": 9}
    numel = math.prod(shape)
    rng = np.random.default_rng(rank)
    grads = [rng.standard_normal(numel).astype(np.float32) for _ in range(4)]
    grads[2][::3] = 0
    grads[3][:5] = np.float32(1e-41)  # subnormal
    runs = []
    for kernels in ("numpy", "numba"):
        _, keys, aggregators = _chunk_encoders(spec, shape, bounds, 2, kernels, monkeypatch)
        assert keys[0].chunks[0].implementation == kernels
        trace = []
        for step, grad in enumerate(grads):
            result, sent = _step(keys, aggregators, bounds, [grad, grads[step - 1]])
            states = [
                np.ascontiguousarray(s[name]).tobytes()
                for key in keys
                for chunk in key.chunks
                for s in [chunk.state()]
                for name in sorted(s)
            ]
            trace.append((sent, states, result.tobytes()))
        runs.append(trace)
    assert runs[0] == runs[1]


def test_play_rounds_drives_a_one_worker_server():
    _, keys, aggregators = _chunk_encoders({"type": "powersgd"}, (16, 40), [(0, 640)])
    grad = np.ones(640, np.float32)
    keys[0].begin(grad)
    first = [host_bytes(f) for f in keys[0].chunks[0].encode(grad)]
    later = play_rounds(keys[0].chunks[0], aggregators[0], first)
    assert [len(f) for f in later] == [4 * 40 * 4]


# parameters, values, state --------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, match",
    [
        ({"rank": 0}, "rank must be >= 1"),
        ({"rank": 2.5}, "rank must be an integer"),
        ({"rank": True}, "rank must be an integer"),
        ({"rank": "4"}, "rank must be an integer"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
        ({"seed": -1}, "seed must be in"),
        ({"seed": 2**63}, "seed must be in"),
        ({"ratio": 0.1}, "unknown parameter"),
    ],
)
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(CodecError, match=match):
        codec_from_spec({"type": "powersgd", **params})


def test_defaults_and_dtypes():
    codec = codec_from_spec({"type": "powersgd"})
    assert codec.params() == {"rank": 4, "warmup_steps": 0, "seed": 0}
    assert codec.round_trips == 2
    with pytest.raises(CodecError, match="float32"):
        codec.check_dtype("float16")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_and_nothing_changes(bad):
    _, keys, _ = _chunk_encoders({"type": "powersgd"}, (16, 40), [(0, 640)])
    grad = np.ones(640, np.float32)
    grad[100] = bad
    before = keys[0].chunks[0].state()
    with pytest.raises(CodecError, match="NaN or infinite"):
        keys[0].begin(grad)
    with pytest.raises(CodecError, match="NaN or infinite"):
        keys[0].chunks[0].encode(grad)
    after = keys[0].chunks[0].state()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_a_checkpointed_encoder_continues_bit_for_bit():
    spec = {"type": "powersgd", "rank": 2, "seed": 4}
    shape, bounds = (24, 30), [(0, 360), (360, 720)]
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(720).astype(np.float32) for _ in range(4)]
    _, keys, aggregators = _chunk_encoders(spec, shape, bounds)
    for grad in grads[:2]:
        _step(keys, aggregators, bounds, [grad])
    saved = [chunk.state() for chunk in keys[0].chunks]
    assert saved[0]["pushes"] == 2 and saved[0]["factor"].shape == (60,)
    _, restored, _ = _chunk_encoders(spec, shape, bounds)
    for chunk, state in zip(restored[0].chunks, saved, strict=True):
        chunk.load_state(state)
    codec = codec_from_spec(spec)
    twins = [codec.make_chunk_aggregator(b - a, "float32", shape=shape, start=a) for a, b in bounds]
    for grad in grads[2:]:
        result, sent = _step(keys, aggregators, bounds, [grad])
        twin_result, twin_sent = _step(restored, twins, bounds, [grad])
        assert sent == twin_sent and np.array_equal(result, twin_result)
    chunk = restored[0].chunks[0]
    with pytest.raises(CodecError, match="factor is float32"):
        chunk.load_state({**saved[0], "factor": np.zeros(61, np.float32)})
    with pytest.raises(CodecError, match="pushes"):
        chunk.load_state({**saved[0], "pushes": np.array(-1)})
    with pytest.raises(CodecError, match="keeps state"):
        chunk.load_state({"error": saved[0]["error"]})


def test_warm_start_factor_is_the_servers_q_sum():
    shape, bounds = (16, 40), [(0, 640)]
    _, keys, aggregators = _chunk_encoders({"type": "powersgd", "rank": 2}, shape, bounds, 2)
    chunk = keys[0].chunks[0]
    assert isinstance(chunk, PowerSGDEncoder)
    rng = np.random.default_rng(8)
    _, sent = _step(keys, aggregators, bounds, [_f32(rng, 640), _f32(rng, 640)])
    _, _, q0, q1 = (np.frombuffer(frames[0], np.float32) for frames in sent)
    q_sum = (q0.astype(np.float64) + q1).astype(np.float32)
    assert np.array_equal(chunk.factor, q_sum)
    assert np.array_equal(keys[1].chunks[0].factor, q_sum)
