"""A server answers every bad message with an error and keeps serving everyone else."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from kvtest import RawClient

import kvstore
from kvstore import wire
from kvstore.server.work import INLINE_ELEMS
from kvstore.wire import Op

pytestmark = pytest.mark.integration

V = wire.PROTOCOL_VERSION

INIT = {"k": "w", "c": 0, "o": 0, "n": 4, "dt": "float32", "sh": [4], "cd": "none", "cp": {}}


def assert_error(reply, code, text=""):
    assert reply.op is Op.ERROR, reply
    assert reply.body.code == code, reply.fields
    assert text in reply.body.message, reply.body.message


def assert_server_still_serves(address):
    with kvstore.create("dist_sync", servers=[address], rank=0, num_workers=1, timeout=20) as kv:
        kv.init("probe", np.ones(3, np.float32))
        kv.push("probe", np.full(3, 2, np.float32))
        out = np.zeros(3, np.float32)
        kv.pull("probe", out=out)
        assert out.tolist() == [2, 2, 2]


def test_garbage_and_malformed_frames_get_error_replies(client, one_server):
    client.send_frames([b"\xc1\xc1 not msgpack"])
    assert_error(client.receive(), "bad_message", "not valid msgpack")
    client.send_frames([msgpack.packb({"v": 99, "op": 3, "id": 5, "nb": []})])
    reply = client.receive()
    assert_error(reply, "bad_message", "protocol version 99")
    assert reply.rid == 5  # the error reaches the request that caused it
    client.send_frames(
        [msgpack.packb({"v": V, "op": 4, "id": 6, "k": 1, "c": 0, "af": 0, "nb": [10]})]
    )
    assert_error(client.receive(), "bad_message", "declares 1 payload frames but 0 arrived")
    client.send_frames([msgpack.packb({"v": V, "op": 16, "id": 7, "nb": []})])
    assert_error(client.receive(), "bad_message", "REPLY is not a request")
    assert_server_still_serves(one_server)


def test_requests_before_hello_are_refused(client, one_server):
    assert_error(client.request("PULL", {"k": 1, "c": 0, "af": 0}), "not_connected", "HELLO")
    assert_server_still_serves(one_server)


def test_handshake_mismatches(one_server):
    for fields, code, text in [
        ({"nw": 3}, "cluster_mismatch", "serves 1 worker(s)"),
        ({"ns": 2}, "cluster_mismatch", "--num-servers 1"),
        ({"si": 1}, "wrong_server", "rank order"),
    ]:
        c = RawClient(one_server)
        base = {"r": 0, "nw": 1, "ns": 1, "si": 0, "m": "dist_sync", "ln": 0}
        assert_error(c.request("HELLO", {**base, **fields}), code, text)
        c.close()
    assert_server_still_serves(one_server)


def test_state_checks_before_any_change(client, one_server):
    assert client.hello().op is Op.REPLY
    assert_error(
        client.request("PUSH", {"k": "nope", "c": 0, "n": 4}, [b"\0" * 16]),
        "not_initialized",
        "call kv.init first",
    )
    assert_error(client.request("INIT", INIT, [b"\0" * 12]), "bad_value", "expected 16")
    assert_error(
        client.request("INIT", {**INIT, "cd": "zip"}, [b"\0" * 16]), "codec", "unknown codec"
    )
    assert_error(
        client.request("INIT", {**INIT, "cd": "2bit", "dt": "float64"}, [b"\0" * 32]),
        "codec",
        "float32",
    )
    assert_error(client.request("INIT", {**INIT, "n": 9}, [b"\0" * 36]), "bad_value", "do not fit")
    assert client.request("INIT", INIT, [np.arange(4, dtype=np.float32)]).op is Op.REPLY
    assert_error(client.request("INIT", INIT, [b"\0" * 16]), "duplicate_init")
    assert_error(client.request("PUSH", {"k": "w", "c": 0, "n": 4}, [b"\0" * 15]), "codec", "bytes")
    assert_error(client.request("PUSH", {"k": "w", "c": 0, "n": 3}, [b"\0" * 12]), "bad_value")
    assert_error(client.request("SET_OPTIMIZER", {"opt": "sgd", "hp": {"lr": -1}}), "optimizer")
    reply = client.request("PULL", {"k": "w", "c": 0, "af": 0})
    assert np.frombuffer(reply.payloads[0], np.float32).tolist() == [0, 1, 2, 3]  # unchanged


def test_async_push_without_optimizer_fails_cleanly_and_the_server_lives(one_server):
    c = RawClient(one_server)
    assert c.hello(mode="dist_async").op is Op.REPLY
    assert c.request("INIT", INIT, [np.zeros(4, np.float32)]).op is Op.REPLY
    reply = c.request("PUSH", {"k": "w", "c": 0, "n": 4}, [np.ones(4, np.float32)])
    assert_error(reply, "no_optimizer", "set_optimizer")
    c.request("BYE")
    c.close()
    assert_server_still_serves(one_server)


@pytest.mark.parametrize("n", [4, INLINE_ELEMS + 16], ids=["inline", "thread-pool"])
def test_a_second_push_in_a_round_waits_for_the_next_round(servers_factory, n):
    """Short chunks are summed on the event-loop thread, long ones on the thread pool; a
    deferred push joins the next round either way."""
    (address,) = servers_factory(1, 2)
    a, b = RawClient(address), RawClient(address)
    try:
        assert a.hello(rank=0, num_workers=2).op is Op.REPLY
        assert b.hello(rank=1, num_workers=2).op is Op.REPLY
        init = {**INIT, "n": n, "sh": [n]}
        a.send("INIT", init, [np.zeros(n, np.float32)])
        b.send("INIT", init)
        assert a.receive().op is Op.REPLY and b.receive().op is Op.REPLY
        push = {"k": "w", "c": 0, "n": n}
        a.send("PUSH", push, [np.full(n, 1, np.float32)])  # round 1
        a.send("PUSH", push, [np.full(n, 10, np.float32)])  # round 2: deferred
        pull_rid = a.send("PULL", {"k": "w", "c": 0, "af": 2})  # follows both of a's pushes
        b.send("PUSH", push, [np.full(n, 100, np.float32)])  # completes round 1
        assert a.receive().op is Op.REPLY  # round 1 ack
        assert b.receive().op is Op.REPLY
        b_pull = b.request("PULL", {"k": "w", "c": 0, "af": 1})
        assert np.array_equal(np.frombuffer(b_pull.payloads[0], np.float32), np.full(n, 101))
        b.send("PUSH", push, [np.full(n, 1000, np.float32)])  # completes round 2
        # a's pull is answered in the round that applied a's second push: that value reply
        # acknowledges the push (it is listed in "ak", no separate ack); b gets its own ack.
        a_pull = a.receive()
        assert a_pull.rid == pull_rid
        assert a_pull.body.acks == [pull_rid - 1]
        assert np.array_equal(np.frombuffer(a_pull.payloads[0], np.float32), np.full(n, 1010))
        assert b.receive().op is Op.REPLY
        assert not a.socket.poll(200)  # nothing else for a
    finally:
        a.close()
        b.close()


def test_duplicate_rank_and_mode_mismatch(servers_factory):
    (address,) = servers_factory(1, 2)
    a, b, c = RawClient(address), RawClient(address), RawClient(address)
    try:
        assert a.hello(rank=0, num_workers=2).op is Op.REPLY
        assert_error(b.hello(rank=0, num_workers=2), "duplicate_rank", "KVSTORE_RANK")
        assert_error(c.hello(rank=1, num_workers=2, mode="dist_async"), "mode_mismatch")
    finally:
        for x in (a, b, c):
            x.close()
