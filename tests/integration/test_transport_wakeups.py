"""The worker transport's I/O thread takes every reply as it arrives.

The thread sleeps on the sockets' ZMQ_FD descriptors, which only signal that a socket's command
mailbox got something; any operation on the socket, a send included, may take that signal
without the input being read. A reply whose signal went that way would wait until the thread
woke for something else: at the latest after ``IDLE_WAIT_MS``. Here that wait is ten minutes
and every reply must come within one minute (replies take milliseconds, even on a loaded
machine: only a lost signal can miss it), over bursts of requests whose replies arrive while
the thread still sends on the same sockets, against real ROUTER sockets standing in for two
servers. (Without the transport's look at a socket's input after sending on it, this test failed
in 5 runs of 5.)
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

from kvstore import wire
from kvstore.wire import Op, PullFields, PushFields
from kvstore.worker import transport as transport_module
from kvstore.worker.transport import Transport

pytestmark = pytest.mark.integration

BURSTS = 20
BURST = 64  # requests submitted at once, over two servers and both lanes of each
IDLE_WAIT_MS = 600_000  # what the test sets: a reply that waits for it is lost
REPLY_TIMEOUT_S = 60.0  # far below that idle wait: a lost signal fails the test


@pytest.fixture
def echo_servers():
    """Two ROUTER sockets that answer every request at once; yields their addresses."""
    context = zmq.Context()
    sockets = []
    for _ in range(2):
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind_to_random_port("tcp://127.0.0.1")
        sockets.append(sock)
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            for sock, _ in poller.poll(50):
                identity, *frames = sock.recv_multipart()
                message = wire.decode(frames)
                payloads = []
                if message.op is Op.PULL:  # a value, of either size, for the reply to carry
                    size = 16 if message.rid % 3 else 64 * 1024
                    payloads = [np.arange(size, dtype=np.float32)]
                sock.send_multipart([identity, *wire.reply(message.rid, None, payloads)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in sockets]
    stop.set()
    thread.join()
    for sock in sockets:
        sock.close(0)
    context.term()


def test_every_reply_is_taken_without_waiting_for_the_idle_timeout(echo_servers, monkeypatch):
    # Bursts of sends on the same sockets as the replies come in: a send processes the
    # socket's commands (at most once a millisecond), which can take a reply's signal.
    monkeypatch.setattr(transport_module, "IDLE_WAIT_MS", IDLE_WAIT_MS)
    transport = Transport(echo_servers, b"wakeup-test", lead_chunks=0)
    try:
        payload = np.ones(32 * 1024, np.float32)  # 128 KiB: a bulk push on the data lane
        for _ in range(BURSTS):
            requests = []
            for i in range(BURST):
                server = i % 2
                if i % 4 < 2:
                    push = PushFields(key="w", chunk=0, numel=payload.size)
                    requests.append(transport.submit(server, push, [payload]))
                else:
                    pull = PullFields(key="w", chunk=0, after_pushes=0)
                    requests.append(transport.submit(server, pull))
            for request in requests:
                request.wait(timeout=REPLY_TIMEOUT_S)
    finally:
        transport.close()
