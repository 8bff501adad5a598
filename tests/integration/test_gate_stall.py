"""The admission gate closes a connection whose unfinished message blocks everyone only when
nothing can finish: not because its event loop was away, and not while the server's socket has
a message ready (kvstore.server.gate, "stall").

A real gate on its own event loop relays two real TCP peers to a real listening sink. Peer A
sends the head of a large frame and stops (an unfinished message holding most of the room);
peer B's frame cannot fit and waits. That is a true stall, which the gate must end by closing A;
what differs is what comes before. Timings are never asserted: the checks say only that nothing
was closed before a whole stall period passed on time, and deadlines are hang guards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgpack
import pytest

from kvstore import wire
from kvstore.server.gate import STALL_SECONDS, AdmissionGate
from kvstore.server.gate_limits import GateLimits
from kvstore.server.gate_sockets import relay_addresses_work
from kvstore.wire import Op

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not relay_addresses_work(), reason="no 127.64.0.0/10 relay addresses"),
]

ROOM = 1 << 20
FRAME = 800_000  # two of them do not fit in ROOM
GUARD = 30.0


def _greeting() -> bytes:
    """ZMTP 3.0's greeting with the NULL mechanism, as a client."""
    return b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)


def _frame_head(size: int, more: bool, command: bool = False) -> bytes:
    flags = 0x02 | (0x01 if more else 0) | (0x04 if command else 0)
    return bytes([flags]) + size.to_bytes(8, "big")


def _unfinished_push() -> bytes:
    """A handshake, a PUSH header that declares one frame of :data:`FRAME` bytes, and the
    head of that frame with a little of its body: a message that never finishes."""
    ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    header = msgpack.packb(
        {
            "v": wire.PROTOCOL_VERSION,
            "op": int(Op.PUSH),
            "id": 1,
            "k": "w",
            "c": 0,
            "n": 4,
            "nb": [FRAME],
        }
    )
    return (
        _greeting()
        + _frame_head(len(ready), more=False, command=True)
        + ready
        + _frame_head(len(header), more=True)
        + header
        + _frame_head(FRAME, more=False)
        + bytes(1000)
    )


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GUARD
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        await asyncio.sleep(0.01)


async def _stalled_gate(
    message_ready: Callable[[], bool],
) -> tuple[AdmissionGate, list[asyncio.StreamWriter], asyncio.Server]:
    """A gate relaying to a sink that reads and drops everything, with peer A holding most of
    its room and peer B waiting for room."""

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1 << 16):
            pass
        writer.close()

    target = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = target.sockets[0].getsockname()[1]
    limits = GateLimits(8, total_bytes=ROOM, connection_bytes=ROOM, frame_bytes=None)
    gate = AdmissionGate(limits, port, lambda *args: None, message_ready=message_ready)
    gate_port = await gate.start("127.0.0.1", 0)
    peers = []
    for done, what in (
        (lambda: gate.held >= FRAME, "let peer A's frame in"),
        (lambda: gate.waiting_connections == 1, "made peer B wait"),  # (it does not fit)
    ):
        _, writer = await asyncio.open_connection("127.0.0.1", gate_port)
        writer.write(_unfinished_push())
        await writer.drain()
        peers.append(writer)
        await _until(done, what)
    assert gate.closed_connections == 0
    return gate, peers, target


async def _close(gate: AdmissionGate, peers: list[asyncio.StreamWriter], target: asyncio.Server):
    for writer in peers:
        writer.close()
    gate.close()
    target.close()
    await target.wait_closed()


def test_a_stall_seen_after_the_loop_was_away_waits_a_whole_period_on_time():
    """The loop is blocked for twice the stall period right after B starts waiting: the stall
    timer fires late, with the server's last "nothing to take" long past. The gate must not
    close A at once (the loop has not read a socket yet); it does after a period on time."""

    async def scenario() -> None:
        gate, peers, target = await _stalled_gate(lambda: False)
        try:
            time.sleep(2 * STALL_SECONDS)  # (blocks the loop, as a long handler would)
            resumed = time.monotonic()
            await asyncio.sleep(STALL_SECONDS / 2)
            if time.monotonic() - resumed < STALL_SECONDS:  # (a loaded machine may be slower)
                assert gate.closed_connections == 0, "closed on a late check"
            await _until(lambda: gate.closed_connections == 1, "closed the blocking connection")
            await _until(lambda: gate.waiting_connections == 0, "let peer B in")
        finally:
            await _close(gate, peers, target)

    asyncio.run(scenario())


def test_no_connection_is_closed_while_the_server_has_a_message_ready():
    """While the server's socket has a message its loop has not taken, nothing is stalled:
    the gate closes nothing; once it has none, the true stall is ended."""
    ready = [True]

    async def scenario() -> None:
        gate, peers, target = await _stalled_gate(lambda: ready[0])
        try:
            await asyncio.sleep(3 * STALL_SECONDS)
            assert gate.closed_connections == 0, "closed while a message was ready"
            ready[0] = False
            await _until(lambda: gate.closed_connections == 1, "closed the blocking connection")
        finally:
            await _close(gate, peers, target)

    asyncio.run(scenario())
