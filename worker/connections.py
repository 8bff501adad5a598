"""A worker's connections to the servers: two DEALER sockets per server, and their monitors.

Two lanes per server (see :mod:`kvstore.wire`): pushes and inits go on the *data* connection,
pulls and the other small requests on the *control* connection, so a pull request never waits
behind megabytes of pushes in one TCP stream, and a full-duplex link carries pushes and pull
replies at the same time instead of one after the other.

The monitor of a ``tcp://`` connection says when it connected (then, with a send queue in time,
the kernel's unsent bytes on a data connection to another host are limited: see
:func:`_limit_unsent`), when its CURVE handshake failed (nothing will ever get through, so the
server is lost to this worker) and when it disconnected after having connected (the server
stopped or died). The transport's I/O thread reads the monitors (:meth:`Connections.on_monitor`)
and owns the sockets; it is told of a lost server through the ``server_lost`` callback.
"""

from __future__ import annotations

import collections
import ipaddress
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstore import auth
from kvstore.config import CurveKeys
from kvstore.wire import LANE_CONTROL, LANE_DATA
from kvstore.worker.push_lead import PushLead
from kvstore.worker.send_queue import SendQueue

NOTSENT_LOWAT = 128 * 1024
"""Unsent bytes the kernel may hold per data connection to another host (with a send queue in
time): about 1 ms at 1 Gbit/s, enough to keep the link busy between the I/O thread's turns."""


class Lane:
    """One connection to one server: its socket, send queue and data in flight."""

    def __init__(self, server: int, lane: int, sock: zmq.Socket, windowed: bool) -> None:
        self.server = server
        self.lane = lane
        self.sock = sock
        self.windowed = windowed
        self.queue = SendQueue()  # of (frames, request, bulk bytes)
        self.in_flight: collections.deque[tuple[Any, int]] = collections.deque()
        self.lead = PushLead()  # (read only with a lead limit)


def head_order(lane: Lane) -> tuple[int, int]:
    """Sort key of the next message of a lane with one queued (smaller goes first)."""
    return lane.queue.heads[0].order


class Connections:
    """Every server's data and control lanes, connected at once, and what their monitors say.

    Args:
        context: the ZeroMQ context of the sockets.
        servers: server addresses in rank order.
        identity: this worker's routing id; each lane's socket uses it with a suffix.
        tos: IP TOS byte of the packets this worker sends (0: unmarked).
        curve: the job's CURVE credentials (None: plain connections).
        limit_unsent: limit the kernel's unsent bytes per data connection to another host.
        lost: the servers declared lost, with why (the transport's, read here).
        server_lost: declares a server lost, with the reason (I/O thread).
    """

    def __init__(
        self,
        context: zmq.Context,
        servers: Sequence[str],
        identity: bytes,
        *,
        tos: int,
        curve: CurveKeys | None,
        limit_unsent: bool,
        lost: Mapping[int, str],
        server_lost: Callable[[int, str], None],
    ) -> None:
        self.servers = tuple(servers)
        self._curve = curve
        self._limit_unsent = limit_unsent
        self._lost = lost
        self._server_lost = server_lost
        self.refused: set[int] = set()  # lost servers that refused the handshake (credentials)
        self._vague_failures: dict[tuple[int, int], int] = {}  # handshakes failed without detail
        self._connected: set[tuple[int, int]] = set()
        self.pairs: list[tuple[Lane, Lane]] = []
        self.by_socket: dict[zmq.Socket, Lane] = {}
        self.monitors: dict[zmq.Socket, Lane] = {}
        for rank, address in enumerate(self.servers):
            pair = []
            for lane, suffix in ((LANE_DATA, b"/d"), (LANE_CONTROL, b"/c")):
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.ROUTING_ID, identity + suffix)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                sock.setsockopt(zmq.LINGER, 0)
                if tos:
                    sock.setsockopt(zmq.TOS, tos)  # before connect: applies to the connection
                if curve is not None and not address.startswith("inproc://"):
                    auth.secure_client(sock, curve)  # (in-process: no handshake to secure)
                entry = Lane(rank, lane, sock, windowed=lane == LANE_DATA)
                if address.startswith("tcp://"):
                    events = (
                        zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | auth.HANDSHAKE_FAILED_EVENTS
                    )
                    self.monitors[sock.get_monitor_socket(events)] = entry
                sock.connect(address)
                self.by_socket[sock] = entry
                pair.append(entry)
            self.pairs.append((pair[0], pair[1]))
        self.all = [lane for pair in self.pairs for lane in pair]

    def close(self) -> None:
        """Close the monitors and the sockets (after the I/O thread ended)."""
        for monitor in self.monitors:
            monitor.close(0)
        for sock in self.by_socket:
            sock.close(0)

    def on_monitor(self, monitor: zmq.Socket) -> None:
        """Read every event waiting on ``monitor`` (I/O thread)."""
        lane = self.monitors[monitor]
        rank = lane.server
        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connected.add((rank, lane.lane))
                if self._limit_unsent and lane.lane == LANE_DATA:  # a send queue in time
                    _limit_unsent(event["value"])
            elif event["event"] & auth.HANDSHAKE_FAILED_EVENTS:
                self._on_handshake_failed(rank, lane, event["event"], event["value"])
            elif event["event"] == zmq.EVENT_DISCONNECTED and (rank, lane.lane) in self._connected:
                self._server_lost(
                    rank,
                    f"server {rank} ({self.servers[rank]}) closed the connection "
                    f"(it stopped or died)",
                )

    def _on_handshake_failed(self, rank: int, lane: Lane, event: int, value: int) -> None:
        """A connection to server ``rank`` failed its handshake: wrong CURVE keys, or keys on
        one side only. Nothing will ever get through (libzmq retries, to the same end), so every
        request to the server fails now, and every later one at once."""
        self._connected.discard((rank, lane.lane))  # its disconnection is not a server's loss
        if rank in self._lost:
            return
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # Also what a server that dies during a handshake causes, once (its port refuses
            # the retry); wrong keys fail every retry, 0.1 s apart.
            failures = self._vague_failures.get((rank, lane.lane), 0) + 1
            self._vague_failures[(rank, lane.lane)] = failures
            if failures < 2:
                return
        where = f"server {rank} ({self.servers[rank]})"
        curve = self._curve
        reason = auth.describe_handshake_failure(
            event, value, where, curve is not None, curve.origins if curve is not None else None
        )
        self.refused.add(rank)  # first: its requests fail with AuthenticationError
        self._server_lost(rank, reason)


def _crosses_a_link(peer: str, own: str) -> bool:
    """Whether a connection from address ``own`` to ``peer`` leaves the host."""
    return peer != own and not ipaddress.ip_address(peer).is_loopback


def _limit_unsent(fd: int) -> None:
    """Let the kernel hold at most :data:`NOTSENT_LOWAT` unsent bytes on TCP connection ``fd``
    if it goes to another host.

    ZeroMQ then writes a message into the connection only as the link takes it, and the
    transport's window, not the kernel's send buffer (megabytes, per connection), decides which
    server's pushes go next. Connections within a host (loopback, or a server on the worker's
    own address) share no link and are left alone: there the limit only costs wake-ups.
    ``fd`` is ZeroMQ's, reported by its monitor; it is borrowed, never closed. Anything
    unexpected (the connection closed meanwhile, no such option on this system) leaves the
    connection as it was; should ZeroMQ have closed it and the number been reused by another
    TCP connection to another host before the event is read, that one gets the limit, which
    only delays its writes into the kernel.
    """
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if option is None:
        return
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        if not _crosses_a_link(sock.getpeername()[0], sock.getsockname()[0]):
            return
        sock.setsockopt(socket.IPPROTO_TCP, option, NOTSENT_LOWAT)
    except (OSError, ValueError):
        pass
    finally:
        sock.detach()
