"""A server's bounds: a message size limit derived from the partition size, oversized frames
and headers, and an error reply for every malformed message (the cases that used to get none).
"""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
import zmq
from kvtest import RawClient, connect
from zmq.utils.monitor import recv_monitor_message

from kvstore import wire
from kvstore.config import ServerConfig
from kvstore.errors import ConfigError
from kvstore.server.server import RECV_QUEUE, ShardServer
from kvstore.topology import max_payload_bytes
from kvstore.wire import Op

pytestmark = pytest.mark.integration

SMALL_PARTITION = 65536
SMALL_LIMIT = max_payload_bytes(SMALL_PARTITION)  # what a server with that partition accepts
HELLO = {"r": 0, "nw": 1, "ns": 1, "si": 0, "m": "dist_sync", "ln": 0}
INIT = {"k": "w", "c": 0, "o": 0, "n": 4, "dt": "float32", "sh": [4], "cd": "none", "cp": {}}


def assert_error(reply, code, text=""):
    assert reply.op is Op.ERROR, reply
    assert reply.body.code == code, reply.fields
    assert text in reply.body.message, reply.body.message


def assert_served(address, partition_bytes=None):
    with connect([address], partition_bytes=partition_bytes, timeout=20) as kv:
        value = np.arange(40_000, dtype=np.float64)  # several chunks of a small partition
        kv.init("probe", np.zeros_like(value))
        kv.push("probe", value)
        out = np.empty_like(value)
        kv.pull("probe", out=out)
        assert np.array_equal(out, value)


@pytest.fixture
def small_server(servers_factory):
    """A server whose workers use 64 KiB partitions, so its message limit is about 64 KiB."""
    return servers_factory(1, 1, env={"KVSTORE_PARTITION_BYTES": str(SMALL_PARTITION)})[0]


@pytest.mark.parametrize("odd", [["float32"], {"a": 1}])
def test_arrays_and_maps_for_dtype_and_mode_get_error_replies(client, one_server, odd):
    """They raised TypeError in decode: logged as an unexpected error, never answered."""
    header = {"v": wire.PROTOCOL_VERSION, "op": int(Op.HELLO), "id": 31, **HELLO, "m": odd}
    client.send_frames([msgpack.packb({**header, "nb": []})])
    reply = client.receive()
    assert reply.rid == 31
    assert_error(reply, "bad_message", "mode")
    client.hello()
    header = {"v": wire.PROTOCOL_VERSION, "op": int(Op.INIT), "id": 32, **INIT, "dt": odd}
    client.send_frames([msgpack.packb({**header, "nb": []})])
    reply = client.receive()
    assert reply.rid == 32
    assert_error(reply, "bad_message", "dtype")
    client.send("BYE")
    client.receive()
    assert_served(one_server)


def test_error_texts_over_4096_characters_are_sent_truncated(client, one_server):
    """An error quoting a 4,096-character name was longer than an ERROR reply may be: the server
    failed to build the reply and the worker waited forever."""
    client.hello()
    reply = client.request("SET_OPTIMIZER", {"opt": "x" * wire.MAX_TEXT, "hp": {}})
    assert_error(reply, "optimizer", "xxxx")
    assert len(reply.body.message) <= wire.MAX_TEXT and reply.body.message.endswith("(truncated)")
    reply = client.request("INIT", {**INIT, "cd": "y" * wire.MAX_TEXT})
    assert_error(reply, "codec", "yyyy")
    assert reply.body.message.endswith("(truncated)")
    client.send("BYE")
    client.receive()
    assert_served(one_server)


def test_an_oversized_header_is_answered_with_its_request_id(client, one_server):
    header = {"v": wire.PROTOCOL_VERSION, "op": int(Op.PULL), "id": 77, "pad": "x" * (1 << 20)}
    client.send_frames([msgpack.packb(header)])
    reply = client.receive()
    assert reply.rid == 77
    assert_error(reply, "bad_message", f"exceeds the {wire.MAX_HEADER_BYTES} limit")
    assert_served(one_server)


def test_a_frame_over_the_limit_drops_only_its_connection(small_server):
    """ZeroMQ refuses the frame by its declared size, before allocating it, and closes that
    connection; the server serves everyone else, and the same peer once it reconnects."""
    stranger = RawClient(small_server)
    try:
        assert_error(stranger.request("BARRIER"), "not_connected")  # connected
        monitor = stranger.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        stranger.send("PUSH", {"k": 1, "c": 0, "n": 1}, [np.zeros(SMALL_LIMIT + 1, np.uint8)])
        assert monitor.poll(10_000), "the server kept a connection that sent a frame too large"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        stranger.socket.disable_monitor()
        monitor.close(0)
        assert_served(small_server, partition_bytes=SMALL_PARTITION)
        # A frame of exactly the limit is accepted (and refused by the server, not by ZeroMQ).
        reply = stranger.request(
            "PUSH", {"k": 1, "c": 0, "n": 1}, [np.zeros(SMALL_LIMIT, np.uint8)]
        )
        assert_error(reply, "not_connected")
    finally:
        stranger.close()


def test_a_worker_whose_chunks_could_exceed_the_limit_is_refused_at_connect(small_server):
    with pytest.raises(ConfigError) as caught:
        connect([small_server], partition_bytes=SMALL_PARTITION * 4)
    text = str(caught.value)
    assert "KVSTORE_PARTITION_BYTES=262144" in text and "KVSTORE_MAX_MESSAGE_BYTES" in text
    assert_served(small_server, partition_bytes=SMALL_PARTITION)


def test_the_limit_follows_the_servers_settings(servers_factory):
    big = 1 << 20
    derived = servers_factory(1, 1, env={"KVSTORE_PARTITION_BYTES": str(big)})[0]
    assert_served(derived, partition_bytes=big)
    explicit = servers_factory(
        1, 1, env={"KVSTORE_PARTITION_BYTES": "65536", "KVSTORE_MAX_MESSAGE_BYTES": str(2 * big)}
    )[0]
    assert_served(explicit, partition_bytes=big)


def test_an_init_of_a_chunk_over_the_limit_is_refused_before_any_state(small_server):
    client = RawClient(small_server)
    try:
        client.hello(rank=0)
        count = SMALL_LIMIT // 4 + 1
        reply = client.request("INIT", {**INIT, "n": count, "sh": [count]})
        assert_error(reply, "message_limit", "KVSTORE_MAX_MESSAGE_BYTES")
        client.send("BYE")
        client.receive()
    finally:
        client.close()
    assert_served(small_server, partition_bytes=SMALL_PARTITION)


@pytest.mark.parametrize(
    "config, maxmsgsize",
    [
        ({}, max_payload_bytes(4 << 20)),
        ({"partition_bytes": SMALL_PARTITION}, SMALL_LIMIT),
        ({"partition_bytes": 4096}, wire.MAX_HEADER_BYTES),  # a header may always take 64 KiB
        ({"max_message_bytes": 1 << 20}, 1 << 20),
        ({"bind": "inproc://kvstore-limits-test"}, -1),  # in-process: no stranger, no limit
    ],
)
def test_the_servers_socket_bounds(config, maxmsgsize):
    async def options():
        server = ShardServer(ServerConfig(threads=1, **config))
        await server.start()
        try:
            sock = server._socket
            return sock.getsockopt(zmq.RCVHWM), sock.getsockopt(zmq.MAXMSGSIZE)
        finally:
            await server.stop()

    assert asyncio.run(options()) == (RECV_QUEUE, maxmsgsize)
