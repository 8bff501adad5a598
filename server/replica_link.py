"""A server's connection to another server of its job: the link a shard's primary forwards its
rounds over to a backup (:mod:`kvstore.server.replication`), and the one a joining server asks
a replica for a shard's state over.

One ZeroMQ DEALER socket, driven by the server's event loop like its own socket: its descriptor
is watched (``add_reader``) and drained after every send (ZeroMQ's descriptor is
edge-triggered). Each request gets a future that its reply completes. A monitor of the socket
reports the connection's end: a peer that died (its process gone, so its TCP connection
closed) fails every request waiting on it at once, with :class:`LinkLost`, and so does a peer
silent for ``timeout`` seconds (a stopped process keeps its connections open).

With the job's CURVE keys the link authenticates with the server key pair, which only the
job's servers hold (:func:`kvstore.auth.secure_server_peer`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstore import auth, wire
from kvstore.config import CurveKeys
from kvstore.errors import ProtocolError
from kvstore.wire import Message

logger = logging.getLogger(__name__)

_ENDED = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
"""Monitor events that end a link: the peer went away, or will never be talked to."""


class LinkLost(Exception):
    """The peer of a :class:`ReplicaLink` is gone (its connection closed, or it was silent for
    the link's timeout); every request on the link fails with this."""


class ReplicaLink:
    """Requests from this server to the server at ``address``, answered on the event loop.

    Args:
        context: the server's ZeroMQ context.
        address: the peer's address, as workers reach it.
        peer: the peer's server rank (for messages).
        curve: the job's server credentials (None: a plain connection).
        timeout: seconds a request may wait for its reply before the peer counts as lost
            (0: only a closed connection ends it).
        on_lost: called once, on the loop, when the link is lost.
    """

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        peer: int,
        curve: CurveKeys | None,
        timeout: float,
        on_lost: Callable[[ReplicaLink, str], None],
    ) -> None:
        self.address = address
        self.peer = peer
        self.lost: str | None = None
        self._timeout = timeout
        self._on_lost = on_lost
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Message]] = {}
        self._connected = False
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # a round's state is never dropped
        if curve is not None:
            auth.secure_server_peer(sock, curve)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | _ENDED)
        sock.connect(address)
        self._sock: zmq.Socket | None = sock
        self._loop = asyncio.get_running_loop()
        self._fds = (
            sock.getsockopt(zmq.FD),
            self._monitor.getsockopt(zmq.FD),
        )
        self._loop.add_reader(self._fds[0], self._drain)
        self._loop.add_reader(self._fds[1], self._watch)
        self._loop.call_soon(self._watch)  # (events before the reader was added)

    async def request(self, body: wire.Fields, payloads: Sequence[Any], what: str) -> Message:
        """Send a request and return its reply; raises :class:`LinkLost`, or the peer's
        refusal as :class:`RefusedByPeer`."""
        if self.lost is not None or self._sock is None:
            raise LinkLost(self.lost or "closed")
        rid = next(self._ids)
        frames = wire.request(rid, body, payloads)
        future: asyncio.Future[Message] = self._loop.create_future()
        self._waiting[rid] = future
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:
            self._waiting.pop(rid, None)
            self.lose(f"sending {what} to server {self.peer} failed: {exc}")
            raise LinkLost(self.lost or "") from exc
        self._loop.call_soon(self._drain)
        try:
            if self._timeout > 0:
                reply = await asyncio.wait_for(future, self._timeout)
            else:
                reply = await future
        except TimeoutError:
            self.lose(f"server {self.peer} did not answer {what} within {self._timeout} s")
            raise LinkLost(self.lost or "") from None
        finally:
            self._waiting.pop(rid, None)
        if reply.op is wire.Op.ERROR:
            raise RefusedByPeer(reply.body.code, reply.body.message)
        return reply

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        self._watch()  # (a send may have taken the monitor's signal too)
        while True:
            try:
                frames = wire.recv_frames(sock)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            try:
                msg = wire.decode(frames)
            except ProtocolError as exc:
                logger.error("a malformed reply from server %d: %s", self.peer, exc)
                continue
            future = self._waiting.pop(msg.rid, None)
            if future is not None and not future.done():
                future.set_result(msg)

    def _watch(self) -> None:
        monitor = self._monitor
        while monitor is not None and not monitor.closed:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.lose(f"the connection to server {self.peer} ({self.address}) closed")
            else:
                self.lose(f"server {self.peer} ({self.address}) refused this server's keys")

    def lose(self, why: str) -> None:
        """Count the peer as lost: fail what waits on it and close the link."""
        if self.lost is not None:
            return
        self.lost = why
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(LinkLost(why))
        self._waiting.clear()
        self.close()
        self._on_lost(self, why)

    def close(self) -> None:
        """Close the socket and its monitor (pending requests are left to :meth:`lose`)."""
        if self._sock is None:
            return
        for fd in self._fds:
            self._loop.remove_reader(fd)
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._sock = None


class RefusedByPeer(Exception):
    """The peer answered a request with an ERROR (its ``code`` and ``message``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


__all__ = ["LinkLost", "RefusedByPeer", "ReplicaLink"]
