"""``powersgd`` against real servers, two workers: two round trips per step through the client's
ordinary ``push`` / ``pull``, a key split over two servers in chunks of whole rows, a 1-D key
beside it, a server optimizer, warm-up, ``pushpull``, the wire protocol of a round seen from a
raw client, and a small model that trains."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import connect, run_ranks

from kvstore.codecs import powersgd
from kvstore.errors import CodecError

pytestmark = pytest.mark.integration

SHAPE = (64, 48)  # split over both servers (bigarray_bound below), chunks of 6 rows
NUMEL = 64 * 48
SPLIT = {"bigarray_bound": 1000, "partition_bytes": 4096}
RANK = 2
STEPS = 3
TOLERANCE = [1e-5, 1e-3, 1e-3]
"""Per step, of the largest sum: the first step is exact to float32 rounding; later steps add
back the previous steps' rounding errors (error feedback), which one power step amplifies for
exactly low-rank data (no tail to hide them), still far below the gradients."""


def _low_rank_gradients(rank, step):
    """``U @ A``: the same ``U`` (64 x 2) on every worker and step, ``A`` its own."""
    u = np.random.default_rng(0).standard_normal((SHAPE[0], RANK)).astype(np.float32)
    a = np.random.default_rng(10 * rank + step + 1).standard_normal((RANK, SHAPE[1]))
    return (u @ a.astype(np.float32)).astype(np.float32)


def _vector(rank, step):
    return np.full(40, rank + 1 + 0.5 * step, np.float32)


WIDE = (40, 1100)  # rows longer than a partition (1024 elements): chunks cut at 16, sent dense


def _wide(rank, step):
    return np.random.default_rng(50 + 10 * rank + step).standard_normal(WIDE).astype(np.float32)


def test_low_rank_gradients_come_back_exact_through_split_chunks(two_servers_two_workers):
    def worker(rank):
        with connect(two_servers_two_workers, rank, 2, **SPLIT) as kv:
            kv.set_gradient_compression({"type": "powersgd", "rank": RANK})
            keys = ["w", 7, "wide"]
            kv.init(keys, [np.zeros(SHAPE, np.float32), np.zeros(40, np.float32), _wide(0, 0)])
            chunks = kv._shared.keys["w"].chunks
            assert {c.server for c in chunks} == {0, 1} and len(chunks) > 4
            assert all(c.start % 48 == 0 and c.numel % 48 == 0 for c in chunks)  # whole rows
            assert any(c.numel % 1100 for c in kv._shared.keys["wide"].chunks)
            pulled = []
            for step in range(STEPS):
                grads = [_low_rank_gradients(rank, step), _vector(rank, step), _wide(rank, step)]
                kv.push(keys, grads)
                outs = [
                    np.zeros(SHAPE, np.float32),
                    np.zeros(40, np.float32),
                    np.zeros(WIDE, np.float32),
                ]
                kv.pull(keys, outs)
                pulled.append(outs)
            return pulled, kv.stats()

    results = run_ranks(2, worker)
    for step in range(STEPS):
        want = _low_rank_gradients(0, step) + _low_rank_gradients(1, step)
        out, vector, wide = results[0][0][step]
        assert np.abs(out - want).max() <= TOLERANCE[step] * np.abs(want).max(), step
        assert np.array_equal(out, results[1][0][step][0])  # every worker reads the same bits
        assert np.array_equal(vector, _vector(0, step) + _vector(1, step))  # 1-D: dense
        assert np.array_equal(wide, _wide(0, step) + _wide(1, step))  # no whole rows: dense


def test_with_a_server_optimizer(two_servers_two_workers):
    start = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)

    def worker(rank):
        with connect(two_servers_two_workers, rank, 2, **SPLIT) as kv:
            kv.set_gradient_compression({"type": "powersgd", "rank": RANK})
            kv.set_optimizer("sgd", learning_rate=0.5)
            kv.init("w", start)
            kv.push("w", _low_rank_gradients(rank, 0))
            out = np.zeros(SHAPE, np.float32)
            kv.pull("w", out)
            return out

    results = run_ranks(2, worker)
    want = start - 0.5 * (_low_rank_gradients(0, 0) + _low_rank_gradients(1, 0))
    assert np.allclose(results[0], want, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(results[0], results[1])


def test_warmup_pushes_are_dense_and_pushpull_works(two_servers_two_workers):
    rng = np.random.default_rng(5)
    grads = rng.standard_normal((2, 3, *SHAPE)).astype(np.float32)

    def worker(rank):
        with connect(two_servers_two_workers, rank, 2, **SPLIT) as kv:
            kv.set_gradient_compression({"type": "powersgd", "rank": RANK, "warmup_steps": 2})
            kv.init("w", np.zeros(SHAPE, np.float32))
            pulled, sent = [], []
            for step in range(3):
                before = kv.stats().pushed_bytes
                out = np.zeros(SHAPE, np.float32)
                kv.pushpull("w", grads[rank, step], out)
                pulled.append(out)
                sent.append(kv.stats().pushed_bytes - before)
            return pulled, sent

    results = run_ranks(2, worker)
    for step in range(2):  # warm-up: the exact float32 sum
        assert np.array_equal(results[0][0][step], grads[0, step] + grads[1, step])
    pulled, sent = results[0]
    assert sent[0] > 4 * NUMEL and sent[2] < sent[0] / 2  # dense, then factors
    assert np.array_equal(pulled[2], results[1][0][2])
    # a rank-2 approximation of full-rank gradients: close to their projection, not equal
    want = grads[0, 2] + grads[1, 2]
    assert 0 < np.linalg.norm(pulled[2] - want) < np.linalg.norm(want)


def test_a_loaded_checkpoint_continues_bit_for_bit(two_servers_two_workers, tmp_path):
    rng = np.random.default_rng(6)
    grads = rng.standard_normal((2, 3, *SHAPE)).astype(np.float32)

    def worker(rank):
        with connect(two_servers_two_workers, rank, 2, **SPLIT) as kv:
            kv.set_gradient_compression({"type": "powersgd", "rank": RANK, "seed": 1})
            kv.set_optimizer("sgd", learning_rate=0.1, momentum=0.5)
            kv.init("w", np.ones(SHAPE, np.float32))
            out = np.zeros(SHAPE, np.float32)
            kv.push("w", grads[rank, 0])
            kv.pull("w", out)
            kv.save_checkpoint(tmp_path / "ckpt")  # errors, factors, push counts, weights
            runs = []
            for _ in range(2):
                for step in (1, 2):
                    kv.push("w", grads[rank, step])
                    kv.pull("w", out)
                runs.append(out.copy())
                kv.load_checkpoint(tmp_path / "ckpt")
            return runs

    for first, second in run_ranks(2, worker):
        assert np.array_equal(first, second)


def test_dist_async_refuses_it(two_servers_two_workers):
    with connect(two_servers_two_workers, 0, 2, mode="dist_async") as kv:
        with pytest.raises(CodecError, match="only dist_sync"):
            kv.set_gradient_compression({"type": "powersgd"})
        with pytest.raises(CodecError, match="only dist_sync"):
            kv.init("w", np.zeros(SHAPE, np.float32), compression={"type": "powersgd"})


def test_the_rounds_on_the_wire(client):
    """A raw worker: P gets the orthonormal P_hat back, Q is acknowledged with Q_sum, a push of
    the wrong size is refused with a codec error, and the server keeps serving."""
    assert client.hello(rank=0, num_workers=1).op.name == "REPLY"
    rows, cols = 16, 40
    init = {"k": "pw", "c": 0, "o": 0, "n": rows * cols, "dt": "float32", "sh": [rows, cols]}
    init.update(cd="powersgd", cp={"rank": 4, "warmup_steps": 0, "seed": 0})
    assert client.request("INIT", init, [np.zeros(rows * cols, np.float32)]).op.name == "REPLY"
    push = {"k": "pw", "c": 0, "n": rows * cols}
    refused = client.request("PUSH", push, [np.zeros(7, np.float32)])
    assert refused.op.name == "ERROR" and refused.body.code == "codec"
    p = np.random.default_rng(1).standard_normal((rows, 4)).astype(np.float32)
    reply = client.request("PUSH", push, [p])
    p_hat = np.frombuffer(reply.payloads[0], np.float32).reshape(rows, 4)
    assert np.allclose(p_hat.T @ p_hat, np.eye(4), atol=1e-5)
    q = np.random.default_rng(2).standard_normal((cols, 4)).astype(np.float32)
    reply = client.request("PUSH", push, [q])
    assert np.frombuffer(reply.payloads[0], np.float32).tobytes() == q.tobytes()  # Q_sum
    value = client.request("PULL", {"k": "pw", "c": 0, "af": 2}).payloads[0]
    want = powersgd.approximation_reference(p_hat, q).ravel()
    assert np.frombuffer(value, np.float32).tobytes() == want.tobytes()


# a small model --------------------------------------------------------------------------------

D, H, OUT, N = 32, 64, 16, 256  # w1 (64 x 32) and w2 (16 x 64) are compressed, biases dense


def _data(rank):
    teacher = np.random.default_rng(100)
    a = (teacher.standard_normal((D, 8)) / np.sqrt(D)).astype(np.float32)
    b = teacher.standard_normal((8, OUT)).astype(np.float32)
    x = np.random.default_rng(rank).standard_normal((N, D)).astype(np.float32)
    return x, (np.tanh(x @ a) @ b).astype(np.float32)


def _initial_weights():
    rng = np.random.default_rng(7)
    return {
        "w1": (rng.standard_normal((H, D)) / np.sqrt(D)).astype(np.float32),
        "b1": np.zeros(H, np.float32),
        "w2": (rng.standard_normal((OUT, H)) / np.sqrt(H)).astype(np.float32),
        "b2": np.zeros(OUT, np.float32),
    }


def _loss_and_gradients(p, x, y):
    hidden = np.tanh(x @ p["w1"].T + p["b1"])
    out = hidden @ p["w2"].T + p["b2"]
    delta = (out - y) / len(x)
    back = (delta @ p["w2"]) * (1 - hidden * hidden)
    grads = {"w1": back.T @ x, "b1": back.sum(0), "w2": delta.T @ hidden, "b2": delta.sum(0)}
    loss = 0.5 * float(np.sum((out - y) ** 2)) / len(x)
    return loss, {k: v.astype(np.float32) for k, v in grads.items()}


def _train(addresses, compression, steps=60):
    def worker(rank):
        x, y = _data(rank)
        with connect(addresses, rank, 2) as kv:
            kv.set_gradient_compression(compression)
            kv.set_optimizer("sgd", learning_rate=0.05)
            weights = _initial_weights()
            keys = sorted(weights)
            kv.init(keys, [weights[k] for k in keys])
            losses = []
            for _ in range(steps):
                loss, grads = _loss_and_gradients(weights, x, y)
                losses.append(loss)
                kv.push(keys, [grads[k] for k in keys])
                kv.pull(keys, [weights[k] for k in keys])
            return losses

    return run_ranks(2, worker)[0]


def test_a_small_model_trains_at_rank_4_about_as_well_as_dense(two_servers_two_workers):
    dense = _train(two_servers_two_workers, {"type": "none"})
    compressed = _train(two_servers_two_workers, {"type": "powersgd", "rank": 4})
    assert compressed[0] == dense[0]
    assert dense[-1] < 0.1 * dense[0]
    assert compressed[-1] < 1.25 * dense[-1]
