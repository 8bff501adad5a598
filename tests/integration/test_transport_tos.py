"""The worker's connections carry the configured IP TOS byte (pushes pass bulk replies)."""

from __future__ import annotations

import os
import socket
import time

import pytest
import zmq

from kvstore.config import DEFAULT_PUSH_TOS
from kvstore.worker.transport import Transport

pytestmark = pytest.mark.integration


def tos_of_connections_to(port: int) -> list[int]:
    """IP_TOS of every TCP socket of this process whose peer is 127.0.0.1:``port``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family == socket.AF_INET and sock.type == socket.SOCK_STREAM:
                if sock.getpeername() == ("127.0.0.1", port):
                    found.append(sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS))
        except OSError:
            pass  # not connected
        finally:
            sock.close()  # closes the duplicate only
    return found


@pytest.mark.parametrize("tos", [DEFAULT_PUSH_TOS, 0, 0xB8])
def test_worker_connections_are_marked(tos):
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    transport = Transport([f"tcp://127.0.0.1:{port}"], b"tos-test", context, tos=tos)
    try:
        deadline = time.monotonic() + 60  # a hang guard: the connections take milliseconds
        while len(found := tos_of_connections_to(port)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert found == [tos, tos]  # the data lane and the control lane
    finally:
        transport.close()
        router.close(0)
        context.term()
