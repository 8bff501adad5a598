"""The ``topk2bit`` codec against real servers: two workers' pushes summed over several servers
and chunks, pulls that stay dense, hostile payloads refused, and a server optimizer on top."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import connect, run_ranks

from kvstore.codecs import get_codec
from kvstore.codecs.sparse.topk2bit import decode_reference
from kvstore.wire import Op

pytestmark = pytest.mark.integration

BIG = 3001  # split over both servers (bigarray_bound below), several chunks each
SMALL = 40  # whole on one server
SPLIT = {"bigarray_bound": 1000, "partition_bytes": 4096}
STEPS = 3
SPEC = {"type": "topk2bit", "ratio": 0.02}


def _gradients(rank, step):
    rng = np.random.default_rng(100 * rank + step)
    return [rng.normal(0, 1, n).astype(np.float32) for n in (BIG, SMALL)]


def _decoded(encoder, grad, bounds):
    """One push of ``encoder``: the dense values its chunks decode to."""
    encoder.begin(grad)
    out = np.zeros(grad.size, np.float32)
    for chunk, (start, _) in zip(encoder.chunks, bounds, strict=True):
        idx, codes, lo_hi = (np.asarray(f) for f in chunk.encode(None))
        indices = start + idx.astype(np.int64)
        out[indices] = decode_reference(codes, idx.size, *lo_hi)
    return out


def _what_rank_sent(rank, bounds):
    """Each step's dense decoded push of ``rank``, from a replica of its encoders cut at the
    client's own chunk bounds (the 2-bit range is per chunk, so the cut matters)."""
    codec = get_codec("topk2bit", ratio=SPEC["ratio"])
    replicas = [
        codec.make_key_encoder(key, n, "float32", bounds[key])
        for key, n in (("big", BIG), (7, SMALL))
    ]
    steps = []
    for step in range(STEPS):
        pairs = zip(replicas, _gradients(rank, step), (bounds["big"], bounds[7]), strict=True)
        steps.append([_decoded(replica, grad, cut) for replica, grad, cut in pairs])
    return steps


def _bounds(kv, key):
    return [(c.start, c.stop) for c in kv._shared.keys[key].chunks]


def test_pulls_are_the_sum_of_what_the_workers_sent(two_servers_two_workers):
    def worker(rank):
        with connect(two_servers_two_workers, rank, 2, **SPLIT) as kv:
            kv.set_gradient_compression(SPEC)
            kv.init(["big", 7], [np.zeros(BIG, np.float32), np.zeros(SMALL, np.float32)])
            bounds = {key: _bounds(kv, key) for key in ("big", 7)}
            assert len(bounds["big"]) > 2  # the key is cut into chunks
            pulled = []
            for step in range(STEPS):
                outs = [np.empty(BIG, np.float32), np.empty(SMALL, np.float32)]
                kv.push(["big", 7], _gradients(rank, step))
                kv.pull(["big", 7], out=outs)
                pulled.append(outs)
            return pulled, bounds, kv.stats()

    results = run_ranks(2, worker)
    bounds = results[0][1]
    sent = [_what_rank_sent(rank, bounds) for rank in range(2)]
    for step in range(STEPS):
        for key in range(2):
            # two addends: the server's float32 sum is the same in either order
            expected = sent[0][step][key] + sent[1][step][key]
            assert np.count_nonzero(expected) > 0
            for pulled, _, _ in results:
                assert pulled[step][key].tobytes() == expected.tobytes()
    for _, _, stats in results:
        # not relayed: every pull is the dense value; every push is far below it
        assert stats.pulled_bytes == STEPS * 4 * (BIG + SMALL)
        assert stats.pushed_bytes < STEPS * 4 * (BIG + SMALL) / 10


def _payload(indices, codes, lo_hi):
    return [
        np.array(indices, np.uint32).tobytes(),
        np.array(codes, np.uint8).tobytes(),
        np.array(lo_hi, np.float32).tobytes(),
    ]


INIT = {"k": "s", "c": 0, "o": 0, "n": 10, "dt": "float32", "sh": [10], "cd": "topk2bit", "cp": {}}


def test_malformed_pushes_get_errors_and_the_server_keeps_serving(client):
    assert client.hello().op is Op.REPLY
    assert client.request("INIT", INIT, [np.zeros(10, np.float32)]).op is Op.REPLY
    push = {"k": "s", "c": 0, "n": 10}
    for payloads, text in [
        (_payload([1], [0], [1, 2])[:2], "needs 3 payload frames"),
        (_payload([1, 2, 3], [0, 0], [1, 2]), "3 indices need 1 code bytes, got 2"),
        (_payload([1], [0], [2, 1]), "needs 0 <= lo <= hi"),
        (_payload([1], [0], [np.nan, 1]), "not finite"),
        (_payload([1], [0b100], [1, 2]), "unused bits"),
        (_payload([4, 2], [0], [1, 2]), "strictly ascending"),
        (_payload([9, 10], [0], [1, 2]), "out of range"),
    ]:
        reply = client.request("PUSH", push, payloads)
        assert reply.op is Op.ERROR and reply.body.code == "codec", reply.fields
        assert text in reply.body.message
    # 2: magnitude bit, positive -> high; 9: negative, low. lo 1, hi 3: low 1.5, high 2.5
    assert client.request("PUSH", push, _payload([2, 9], [0b1001], [1, 3])).op is Op.REPLY
    reply = client.request("PULL", {"k": "s", "c": 0, "af": 1})
    expected = np.zeros(10, np.float32)
    expected[[2, 9]] = [2.5, -1.5]
    assert np.frombuffer(reply.payloads[0], np.float32).tolist() == expected.tolist()


def test_compressed_pulls_give_every_worker_the_same_bits(two_servers_two_workers):
    """Pushes and pulls both in ``topk2bit``, with a server optimizer (DiLoCo's setting): the
    workers hold identical weights after every step, for a fraction of the dense bytes."""
    steps = 6

    def worker(rank):
        with connect(two_servers_two_workers, rank, 2, **SPLIT) as kv:
            kv.set_gradient_compression(SPEC)
            kv.set_pull_compression({"type": "topk2bit", "ratio": 0.05})
            kv.set_optimizer("sgd", learning_rate=0.5, momentum=0.9, nesterov=True)
            kv.init(
                ["big", 7], [np.linspace(-1, 1, BIG, dtype=np.float32), np.ones(SMALL, np.float32)]
            )
            seen = []
            for step in range(steps):
                outs = [np.empty(BIG, np.float32), np.empty(SMALL, np.float32)]
                kv.push(["big", 7], _gradients(rank, step % STEPS))
                kv.pull(["big", 7], out=outs)
                seen.append(outs)
            return seen, kv.stats().pulled_bytes

    (first, first_bytes), (second, second_bytes) = run_ranks(2, worker)
    for mine, theirs in zip(first, second, strict=True):
        assert [a.tobytes() for a in mine] == [b.tobytes() for b in theirs]
    assert not np.array_equal(first[-1][0], np.linspace(-1, 1, BIG, dtype=np.float32))
    dense = steps * 4 * (BIG + SMALL)
    assert first_bytes == second_bytes < dense / 3
