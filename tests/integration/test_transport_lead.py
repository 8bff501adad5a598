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
from kvstore.wire import Op, PushFields
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


HANG_GUARD_S = 60.0
"""How long a push that must come may take: far above the milliseconds it takes, even on a
loaded machine, so only a push that never comes fails the test."""

QUIET_S = 0.5
"""How long a push that must not come is watched for. A shorter look only weakens the check (a
push sent late would be missed), it cannot fail a correct transport; the patience is set far
above it where that matters."""


def receive_pushes(sock: zmq.Socket, count: int) -> list[tuple[bytes, wire.Message]]:
    """The next ``count`` PUSHes to arrive, with the identity of their connection."""
    got = []
    deadline = time.monotonic() + HANG_GUARD_S
    while len(got) < count:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000) + 1), f"only {len(got)} of {count} came"
        identity, *frames = sock.recv_multipart()
        message = wire.decode(frames)
        if message.op is Op.PUSH:
            got.append((identity, message))
    return got


def assert_no_push_comes(sock: zmq.Socket) -> None:
    """Nothing but non-PUSH messages arrives for :data:`QUIET_S`."""
    deadline = time.monotonic() + QUIET_S
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            return
        _identity, *frames = sock.recv_multipart()
        message = wire.decode(frames)
        assert message.op is not Op.PUSH, (
            f"push {message.body.key}/{message.body.chunk} was not held back"
        )


def answer(sock: zmq.Socket, identity: bytes, message: wire.Message) -> None:
    sock.send_multipart([identity, *wire.encode(Op.REPLY, message.rid)])


def submit_bulk_pushes(transport: Transport, count: int) -> list:
    payload = np.ones(BULK_ELEMENTS, np.float32)
    return [
        transport.submit(0, PushFields(key="big", chunk=c, numel=BULK_ELEMENTS), [payload])
        for c in range(count)
    ]


def test_lead_limit_holds_pushes_until_answered(router, monkeypatch):
    # A patience far beyond the test: whatever comes, came because of an answer.
    monkeypatch.setattr(transport_module, "LEAD_PATIENCE_S", 3600.0)
    sock, address = router
    transport = Transport([address], b"lead-test", lead_chunks=3)
    try:
        requests = submit_bulk_pushes(transport, 8)
        first = receive_pushes(sock, 3)
        assert [m.body.chunk for _, m in first] == [0, 1, 2]
        assert_no_push_comes(sock)  # three unanswered, then held back

        answer(sock, *first[0])
        requests[0].wait(timeout=HANG_GUARD_S)
        second = receive_pushes(sock, 1)
        assert [m.body.chunk for _, m in second] == [3]  # one answer lets one more go
        assert_no_push_comes(sock)

        # Answered one at a time, the rest leave in order.
        unanswered = first[1:] + second
        sent = [m.body.chunk for _, m in first + second]
        while unanswered:
            answer(sock, *unanswered.pop(0))
            if len(sent) < 8:
                unanswered += receive_pushes(sock, 1)
                sent.append(unanswered[-1][1].body.chunk)
        assert sent == list(range(8))
        for request in requests:
            request.wait(timeout=HANG_GUARD_S)
    finally:
        transport.close()


def test_lead_limit_lapses_without_answers(router):
    # No answers for LEAD_PATIENCE_S (the real one): the limit lapses and all leave, in order.
    sock, address = router
    transport = Transport([address], b"lead-test-lapse", lead_chunks=3)
    try:
        requests = submit_bulk_pushes(transport, 8)
        got = receive_pushes(sock, 8)
        assert [m.body.chunk for _, m in got] == list(range(8))
        for identity, message in got:
            answer(sock, identity, message)
        for request in requests:
            request.wait(timeout=HANG_GUARD_S)
    finally:
        transport.close()


def test_small_pushes_and_other_servers_are_not_held_back(router, monkeypatch):
    monkeypatch.setattr(transport_module, "LEAD_PATIENCE_S", 3600.0)  # held back means held
    sock, address = router
    transport = Transport([address], b"lead-test-small", lead_chunks=1)
    try:
        big = np.ones(BULK_ELEMENTS, np.float32)
        small = np.ones(16, np.float32)
        transport.submit(0, PushFields(key="big", chunk=0, numel=BULK_ELEMENTS), [big])
        transport.submit(0, PushFields(key="big", chunk=1, numel=BULK_ELEMENTS), [big])
        for c in range(5):
            transport.submit(0, PushFields(key="small", chunk=c, numel=16), [small])
        got = receive_pushes(sock, 6)
        assert_no_push_comes(sock)
        # The second bulk push waits for an answer; express-sized pushes never do.
        assert sorted((m.body.key, m.body.chunk) for _, m in got) == [("big", 0)] + [
            ("small", c) for c in range(5)
        ]
    finally:
        transport.close()
