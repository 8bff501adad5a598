"""The worker transport's lead limit, against a real ROUTER socket standing in for a server.

A data lane sends at most ``lead_chunks`` bulk pushes that the server has not answered; an
answer lets the next one go; and when nothing is answered for ``LEAD_PATIENCE_S`` the limit
lapses, so workers that push in different orders never deadlock.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from kvstore import wire
from kvstore.wire import Op
from kvstore.worker import transport as transport_module
from kvstore.worker.transport import Transport

pytestmark = pytest.mark.integration

BULK_ELEMENTS = 64 * 1024  # 256 KiB: above the express size, so windowed and lead-limited


@pytest.fixture
def router():
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(0)
    context.term()


def receive_pushes(sock: zmq.Socket, seconds: float) -> list[tuple[bytes, wire.Message]]:
    """Every PUSH that arrives within ``seconds``, with the identity of its connection."""
    got = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            break
        identity, *frames = sock.recv_multipart()
        message = wire.decode(frames)
        if message.op is Op.PUSH:
            got.append((identity, message))
    return got


def answer(sock: zmq.Socket, identity: bytes, message: wire.Message) -> None:
    sock.send_multipart([identity, *wire.encode(Op.REPLY, message.rid)])


def test_lead_limit_holds_pushes_until_answered_and_lapses_without_answers(router):
    sock, address = router
    transport = Transport([address], b"lead-test", lead_chunks=3)
    try:
        payload = np.ones(BULK_ELEMENTS, np.float32)
        requests = [
            transport.submit(0, Op.PUSH, {"k": "big", "c": c, "n": BULK_ELEMENTS}, [payload])
            for c in range(8)
        ]
        first = receive_pushes(sock, 0.3)
        assert [m["c"] for _, m in first] == [0, 1, 2]  # three unanswered, then held back

        answer(sock, *first[0])
        requests[0].wait(timeout=5)
        second = receive_pushes(sock, 0.3)
        assert [m["c"] for _, m in second] == [3]  # one answer lets one more go

        # No answers for LEAD_PATIENCE_S: the limit lapses and the rest leave in order.
        rest = receive_pushes(sock, transport_module.LEAD_PATIENCE_S + 2.0)
        assert [m["c"] for _, m in rest] == [4, 5, 6, 7]
        for identity, message in first[1:] + second + rest:
            answer(sock, identity, message)
        for request in requests:
            request.wait(timeout=5)
    finally:
        transport.close()


def test_small_pushes_and_other_servers_are_not_held_back(router):
    sock, address = router
    transport = Transport([address], b"lead-test-small", lead_chunks=1)
    try:
        big = np.ones(BULK_ELEMENTS, np.float32)
        small = np.ones(16, np.float32)
        transport.submit(0, Op.PUSH, {"k": "big", "c": 0, "n": BULK_ELEMENTS}, [big])
        transport.submit(0, Op.PUSH, {"k": "big", "c": 1, "n": BULK_ELEMENTS}, [big])
        for c in range(5):
            transport.submit(0, Op.PUSH, {"k": "small", "c": c, "n": 16}, [small])
        got = receive_pushes(sock, 0.3)
        # The second bulk push waits for an answer; express-sized pushes never do.
        assert sorted((m["k"], m["c"]) for _, m in got) == [("big", 0)] + [
            ("small", c) for c in range(5)
        ]
    finally:
        transport.close()
