"""The sparse codecs against real servers: sums, relayed pulls, bad payloads, DGC's optimizer
rule and checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import RawClient, connect, run_ranks

import kvstore
from kvstore.codecs import get_codec
from kvstore.wire import Op

pytestmark = pytest.mark.integration

BIG = 3001  # split over both servers (bigarray_bound below), several chunks each
SMALL = 40  # whole on one server
SPLIT = {"bigarray_bound": 1000, "partition_bytes": 4096}
STEPS = 3


def _codec(spec):
    return get_codec(spec["type"], **{k: v for k, v in spec.items() if k != "type"})


def _gradients(rank, step):
    rng = np.random.default_rng(100 * rank + step)
    return [rng.normal(0, 1, n).astype(np.float32) for n in (BIG, SMALL)]


def _what_rank_sent(spec, rank):
    """Each step's dense decoded push of ``rank``, from a replica of its encoders (the
    selection spans the key, so a one-chunk replica sends the same)."""
    replicas = [
        _codec(spec).make_key_encoder(key, n, "float32", [(0, n)])
        for key, n in (("big", BIG), (7, SMALL))
    ]
    steps = []
    for step in range(STEPS):
        dense = []
        for replica, grad in zip(replicas, _gradients(rank, step), strict=True):
            replica.begin(grad)
            idx, val = replica.chunks[0].encode(grad)
            out = np.zeros(grad.size, np.float32)
            out[idx.astype(np.int64)] = val
            dense.append(out)
        steps.append(dense)
    return steps


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "threshold", "threshold": 1.5},
        {"type": "topk", "ratio": 0.02},
        {"type": "randomk", "ratio": 0.05, "seed": 1},
        {"type": "dgc", "ratio": 0.02, "warmup_steps": 2, "nesterov": True, "clip_norm": 30.0},
    ],
    ids=["threshold", "topk", "randomk", "dgc"],
)
def test_pulls_are_the_sum_of_what_the_workers_sent(spec, two_servers_two_workers):
    def worker(rank):
        with connect(two_servers_two_workers, rank, 2, **SPLIT) as kv:
            kv.set_gradient_compression(spec)
            kv.init(["big", 7], [np.zeros(BIG, np.float32), np.zeros(SMALL, np.float32)])
            assert len(kv._shared.keys["big"].chunks) > 2  # the key is cut into chunks
            pulled = []
            for step in range(STEPS):
                outs = [np.empty(BIG, np.float32), np.empty(SMALL, np.float32)]
                kv.push(["big", 7], _gradients(rank, step))
                kv.pull(["big", 7], out=outs)
                pulled.append(outs)
            return pulled, kv.stats().pulled_bytes

    results = run_ranks(2, worker)
    sent = [_what_rank_sent(spec, rank) for rank in range(2)]
    for step in range(STEPS):
        for key in range(2):
            # two addends: the server's float32 sum is the same in either order
            expected = sent[0][step][key] + sent[1][step][key]
            for pulled, _ in results:
                assert pulled[step][key].tobytes() == expected.tobytes()
    if spec["type"] != "threshold":  # sparse rounds come back as relays: fewer bytes
        for _, nbytes in results:
            assert nbytes < STEPS * 4 * (BIG + SMALL) / 2


def test_relayed_pulls_equal_the_servers_sum_bit_for_bit(servers_factory):
    """Three workers (so the order of the float32 additions matters); ranks 0 and 1 take
    relays and sum them themselves, rank 2 pulls the server's dense sum."""
    addresses = servers_factory(2, 3)

    def worker(rank):
        with connect(addresses, rank, 3, pull_relay=rank < 2, **SPLIT) as kv:
            kv.set_gradient_compression({"type": "topk", "ratio": 0.05})
            kv.init("big", np.zeros(BIG, np.float32))
            seen = []
            out = np.empty(BIG, np.float32)
            for step in range(STEPS):
                grad = _gradients(rank, step)[0] * np.float32(0.1 + rank)
                if step % 2:
                    kv.pushpull("big", grad, out=out)
                else:
                    kv.push("big", grad)
                    kv.pull("big", out=out)
                seen.append(out.copy())
            return seen, kv.stats().pulled_bytes

    results = run_ranks(3, worker)
    for seen, _ in results[:2]:
        assert [s.tobytes() for s in seen] == [s.tobytes() for s in results[2][0]]
    assert results[2][1] == STEPS * 4 * BIG
    assert results[0][1] < results[2][1] / 2


INIT = {"k": "s", "c": 0, "o": 0, "n": 10, "dt": "float32", "sh": [10], "cd": "topk", "cp": {}}


def _pair(indices, values):
    return [np.array(indices, np.uint32).tobytes(), np.array(values, np.float32).tobytes()]


def test_malformed_sparse_pushes_get_errors_and_the_server_keeps_serving(client):
    assert client.hello().op is Op.REPLY
    assert client.request("INIT", INIT, [np.zeros(10, np.float32)]).op is Op.REPLY
    push = {"k": "s", "c": 0, "n": 10}
    for payloads, text in [
        ([b"\0" * 8], "needs 2 payload frames"),
        (_pair([1, 2, 3], [1, 2]), "3 indices but 2 values"),
        (_pair([4, 2], [1, 2]), "strictly ascending"),
        (_pair([3, 3], [1, 2]), "strictly ascending"),
        (_pair([9, 10], [1, 2]), "out of range"),
        ([b"\0" * 5, b"\0" * 4], "not whole"),
    ]:
        reply = client.request("PUSH", push, payloads)
        assert reply.op is Op.ERROR and reply.body.code == "codec", reply.fields
        assert text in reply.body.message
    assert client.request("PUSH", push, _pair([2, 9], [1.5, -2])).op is Op.REPLY
    reply = client.request("PULL", {"k": "s", "c": 0, "af": 1})
    expected = np.zeros(10, np.float32)
    expected[[2, 9]] = [1.5, -2]
    assert np.frombuffer(reply.payloads[0], np.float32).tolist() == expected.tolist()


def test_dgc_and_server_momentum_are_refused_in_either_order():
    with kvstore.create("local", timeout=20) as kv:
        kv.set_gradient_compression({"type": "dgc"})
        with pytest.raises(kvstore.OptimizerError, match="'dgc'.*'sgd' with momentum=0.9"):
            kv.set_optimizer("sgd", momentum=0.9)
        with pytest.raises(kvstore.OptimizerError, match="double momentum"):
            kv.set_optimizer("adam")
    with kvstore.create("local", timeout=20) as kv:
        kv.set_optimizer("sgd", learning_rate=0.5, momentum=0.5)
        with pytest.raises(kvstore.CodecError, match="double momentum"):
            kv.set_gradient_compression({"type": "dgc"})
        kv.set_optimizer("sgd", learning_rate=0.5)  # without momentum DGC is fine
        kv.set_gradient_compression({"type": "dgc", "ratio": 0.5, "momentum": 0.5})
        kv.init("w", np.ones(4, np.float32))
        kv.push("w", np.array([4, -1, 0.5, 2], np.float32))
        out = np.empty(4, np.float32)
        kv.pull("w", out=out)
        assert out.tolist() == [1 - 0.5 * 4, 1, 1, 1 - 0.5 * 2]  # k = 2, plain SGD


def test_the_server_refuses_the_combination_from_raw_clients(one_server):
    dgc = {**INIT, "k": "d", "cd": "dgc"}
    momentum = {"opt": "sgd", "hp": {"momentum": 0.9}}
    c = RawClient(one_server)
    try:
        assert c.hello().op is Op.REPLY
        assert c.request("INIT", dgc, [np.zeros(10, np.float32)]).op is Op.REPLY
        reply = c.request("SET_OPTIMIZER", momentum)
        assert reply.op is Op.ERROR and reply.body.code == "optimizer"
        assert "double momentum" in reply.body.message
        assert c.request("BYE").op is Op.REPLY
    finally:
        c.close()
    c = RawClient(one_server)
    try:
        assert c.hello().op is Op.REPLY
        assert c.request("SET_OPTIMIZER", momentum).op is Op.REPLY
        reply = c.request("INIT", dgc, [np.zeros(10, np.float32)])
        assert reply.op is Op.ERROR and reply.body.code == "codec"
        assert "double momentum" in reply.body.message
        assert c.request("BYE").op is Op.REPLY
    finally:
        c.close()


@pytest.mark.parametrize(
    "spec",
    [{"type": "randomk", "ratio": 0.1, "seed": 5}, {"type": "dgc", "ratio": 0.05, "sample": 0.5}],
    ids=["randomk", "dgc"],
)
def test_local_checkpoints_resume_bit_identically_with_other_chunks(spec, tmp_path):
    def job(partition_bytes):
        kv = kvstore.create("local", timeout=20, partition_bytes=partition_bytes)
        kv.set_gradient_compression(spec)
        kv.init("w", np.zeros(5000, np.float32))
        return kv

    def step(kv, seed):
        kv.push("w", np.random.default_rng(seed).normal(size=5000).astype(np.float32))
        out = np.empty(5000, np.float32)
        kv.pull("w", out=out)
        return out

    with job(4096) as kv:
        expected = [step(kv, seed) for seed in range(4)]
    with job(4096) as kv:
        for seed in range(2):
            step(kv, seed)
        assert len(kv._shared.keys["w"].chunks) > 1
        kv.save_checkpoint(tmp_path / "ckpt")
    with job(8192) as kv:  # other chunks: the saved state is cut anew, the step count kept
        kv.load_checkpoint(tmp_path / "ckpt")
        got = [step(kv, seed) for seed in range(2, 4)]
    assert [g.tobytes() for g in got] == [e.tobytes() for e in expected[2:]]
