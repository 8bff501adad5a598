"""The admission gate: a bound on what the server's peers can make it hold.

libzmq gives a ROUTER socket a multipart message only when its last frame has arrived; until then
every frame of it waits in the connection's pipe. ``ZMQ_MAXMSGSIZE`` limits one frame,
``ZMQ_RCVHWM`` counts finished messages, and nothing limits the frames of one message or the
number of connections: a few senders of messages of many frames, each within the limit, could
make a server hold gigabytes.

So a server that listens on TCP accepts its peers' connections here, and its ZeroMQ socket
listens on the loopback only. The gate relays each connection's bytes unchanged (a CURVE
connection stays encrypted end to end: the gate holds no key) and reads only the ZMTP framing
of what a peer sends: the greeting, then each frame's flags and size. A frame passes on only
once its whole declared size fits (libzmq allocates a frame when it reads its size), within
the limits of :mod:`kvstore.server.gate_limits`:

* :attr:`GateLimits.connection_bytes` bytes and :data:`FRAMES_AHEAD` frames per connection that
  the server has not yet taken from its socket;
* :attr:`GateLimits.total_bytes` bytes for all connections together;
* :attr:`GateLimits.max_connections` connections;
* on a connection without CURVE, where the gate can read requests: what the message's header
  declares (:func:`kvstore.wire.declared_payload`), a few frames and bytes of slack aside
  (:data:`SLACK_FRAMES`, :data:`SLACK_BYTES`) so that a malformed message still gets its
  ``ERROR`` reply. A message that exceeds its declaration closes its connection at once.

A frame that does not fit waits, and its connection is not read meanwhile (TCP holds the sender
back, nothing is lost); it passes when the server has taken enough. The server says what it
took with :meth:`AdmissionGate.consumed`, naming the connection by the source address of the
gate's relay: each relayed connection comes from its own loopback address (127.64.0.0/10),
which ZeroMQ reports as every message's ``Peer-Address``. If the server has nothing left to
take while frames wait for room that unfinished messages hold, no message could ever finish:
after :data:`STALL_SECONDS` the gate closes the connection whose unfinished message holds the
most, first among those that stopped sending, and libzmq drops that message. Only a check that
runs on time, while the server's socket has no message ready, decides that: on a busy machine
the event loop can be away for longer than that, and when it comes back it runs its due timers
before it reads any socket, so that the server's last "nothing to take" is stale then.

Replies pass the other way with ordinary flow control: a peer with more than
:data:`REPLY_BACKLOG` bytes of replies unread is not read, so it cannot make the server produce
more, until it reads them.

What the gate itself keeps per connection is fixed: at most one read (:data:`READ_BYTES`)
waiting for room (a longer read takes only an admitted frame's body), one header
(:data:`~kvstore.wire.MAX_HEADER_BYTES`) being read, the reply backlog and one read of replies.
docs/operations.md ("Limits") gives the resulting bound on the server's memory
(:func:`kvstore.server.gate_limits.memory_bound`). Where the gate listens and the addresses it
relays from are :mod:`kvstore.server.gate_sockets`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import cast

from kvstore import wire
from kvstore.auth import CURVE_MESSAGE_OVERHEAD
from kvstore.server.gate_limits import (
    BODY_READ_BYTES,
    FRAMES_AHEAD,
    READ_BYTES,
    REPLY_BACKLOG,
    REPLY_READ_BYTES,
    SLACK_BYTES,
    SLACK_FRAMES,
    GateLimits,
)
from kvstore.server.gate_sockets import (
    listening_socket,
    peer_text,
    raise_file_limit,
    relay_address,
)

logger = logging.getLogger("kvstore.server")

HANDSHAKE_COMMANDS = 2
"""Commands a peer sends before its first message (CURVE: HELLO and INITIATE; NULL: READY).
libzmq consumes them; they pass without taking room, up to :data:`MAX_HANDSHAKE_COMMAND` bytes
each. Any later command takes room as a frame does."""

MAX_HANDSHAKE_COMMAND = 64 * 1024

STALL_SECONDS = 1.0
"""How long the server must have had nothing to take, while frames wait for room, before the
gate closes a connection holding an unfinished message."""

CLOSE_GRACE_SECONDS = 2.0
"""How long a closed connection's room stays counted: messages it finished may still wait in
the server's socket, and the server's :meth:`AdmissionGate.consumed` names them by its address."""

GREETING_BYTES = 64
GREETING_SIGNATURE_BYTES = 11
"""A ZMTP 3 greeting's signature and major version, which each side sends first."""
_MORE, _LONG, _COMMAND = 1, 2, 4
_RESERVED = 0xF8


class _Refused(Exception):
    """A peer sent what the gate does not relay; the text says what, for the log."""


Warn = Callable[..., object]


class AdmissionGate:
    """Accepts the server's TCP connections and relays them to its ZeroMQ socket within
    :class:`GateLimits` (see the module's docstring).

    Runs on the server's event loop: :meth:`consumed` and :meth:`idle`, which the server calls
    as it takes messages from its socket, need no locks.
    """

    def __init__(
        self,
        limits: GateLimits,
        target_port: int,
        warn: Warn,
        on_unencrypted: Callable[[str], None] | None = None,
        message_ready: Callable[[], bool] = lambda: False,
    ) -> None:
        """``target_port``: where the server's socket listens on 127.0.0.1; ``warn(logger,
        about, message, *texts)`` logs a rate-limited warning about a peer;
        ``on_unencrypted(peer)``, given for a server with CURVE keys, is told of each peer
        whose greeting offers no encryption (libzmq refuses it after the greeting; the gate
        still relays it, so that the peer learns why); ``message_ready()``: whether the
        server's socket has a message it has not taken yet."""
        self.limits = limits
        self._on_unencrypted = on_unencrypted
        self._target_port = target_port
        self._warn = warn
        self._links: dict[str, _Link] = {}
        self._next_address = 0
        self.held = 0
        """Bytes of frames relayed and not yet taken by the server, over all connections."""
        self._waiting: dict[_Link, None] = {}  # links with a frame waiting for room, in order
        self._admit_scheduled = False
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stall_due = 0.0  # (the loop's time) when the stall timer should fire
        self._message_ready = message_ready
        self._last_taken = time.monotonic()
        self._server_idle = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: asyncio.Server | None = None
        self._read_buffer = bytearray(max(READ_BYTES, BODY_READ_BYTES))
        self._reply_buffer = bytearray(REPLY_READ_BYTES)
        self.closed_connections = 0
        """Connections the gate closed for what they sent or held (for tests and metrics)."""

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; returns the bound port."""
        self._loop = asyncio.get_running_loop()
        raise_file_limit(self.limits.max_connections)
        listening = listening_socket(host, port)
        try:
            self._listener = await self._loop.create_server(
                lambda: _ClientSide(self), sock=listening, backlog=1024
            )
        except BaseException:
            listening.close()
            raise
        bound: int = listening.getsockname()[1]
        return bound

    def close(self) -> None:
        """Stop listening and close every connection."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        for link in list(self._links.values()):
            link.abort()
            link.release()
        self._links.clear()
        self._waiting.clear()

    # what the server reports --------------------------------------------------------------

    def consumed(self, address: str | None, nbytes: int, nframes: int) -> None:
        """The server took a message of ``nframes`` frames and ``nbytes`` bytes (its frames
        after the routing id) that came from the relay address ``address``."""
        self._last_taken = time.monotonic()
        self._server_idle = False
        link = self._links.get(address) if address is not None else None
        if link is None:
            return
        taken = min(nbytes, link.held)
        link.held -= taken
        self.held -= taken
        link.frames = max(0, link.frames - nframes)
        if self._waiting and not self._admit_scheduled and self._loop is not None:
            self._admit_scheduled = True
            self._loop.call_soon(self._admit_waiting)

    def idle(self) -> None:
        """The server found its socket empty."""
        self._server_idle = True

    def public_peer(self, address: str) -> str | None:
        """The peer (``host:port``) whose connection the gate relays from ``address``."""
        link = self._links.get(address)
        return link.peer if link is not None else None

    @property
    def connections(self) -> int:
        return len(self._links)

    @property
    def waiting_connections(self) -> int:
        """Connections with a frame that waits for room."""
        return len(self._waiting)

    # connections ---------------------------------------------------------------------------

    def _accept(self, side: _ClientSide, transport: asyncio.Transport) -> None:
        peer = peer_text(transport.get_extra_info("peername"))
        if len(self._links) >= self.limits.max_connections and not self._make_room(peer):
            self._warn(
                logger,
                "connections",
                "refused a connection from %s: the server has %s connections "
                "(KVSTORE_MAX_CONNECTIONS)",
                peer,
                str(self.limits.max_connections),
            )
            transport.abort()
            return
        address = self._allocate_address()
        link = _Link(self, transport, address, peer)
        side.link = link
        self._links[address] = link
        transport.set_write_buffer_limits(high=REPLY_BACKLOG)
        transport.pause_reading()  # until the relay's own connection is up
        assert self._loop is not None
        self._loop.create_task(self._connect(link))

    def _make_room(self, peer: str) -> bool:
        """Free a connection slot for a new peer, if one is held by a connection that holds no
        room: a closed one not yet forgotten, else the oldest that has not finished its
        handshake (so that connections opened and left half-way, which cost a stranger nothing,
        cannot keep new peers out). False if every slot holds a connection in use."""
        for link in self._links.values():
            if link.client_closed and link.held == 0:
                self._forget(link)
                return True
        for link in self._links.values():  # (oldest first)
            if not link.messages_started and not link.client_closed:
                self._warn(
                    logger,
                    link.peer_host,
                    "closed the connection from %s to make room for %s: it had not finished its "
                    "handshake and the server has %s connections (KVSTORE_MAX_CONNECTIONS)",
                    link.peer,
                    peer,
                    str(self.limits.max_connections),
                )
                self.closed_connections += 1
                link.abort()
                self._forget(link)
                return True
        return False

    def _allocate_address(self) -> str:
        while True:
            address = relay_address(self._next_address)
            self._next_address += 1
            if address not in self._links:
                return address

    async def _connect(self, link: _Link) -> None:
        assert self._loop is not None
        try:
            await self._loop.create_connection(
                lambda: _ServerSide(link),
                "127.0.0.1",
                self._target_port,
                local_addr=(link.address, 0),
            )
        except OSError as exc:
            logger.warning("cannot relay a connection from %s: %s", link.peer, exc)
            link.abort()
            self._forget(link)
            return
        if link.early and link.server is not None:
            link.server.write(bytes(link.early))
            link.early = bytearray()
        if link.client_closed:  # the peer left while the relay connected
            link.close_server_side()
            return
        link.update_reading()

    def _forget(self, link: _Link) -> None:
        """Stop counting ``link``: its room is free again."""
        if self._links.get(link.address) is link:
            del self._links[link.address]
        self._waiting.pop(link, None)
        link.release()

    def _closed(self, link: _Link) -> None:
        """Both sides of ``link`` are closed: forget it once what it finished was taken."""
        self._waiting.pop(link, None)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_later(CLOSE_GRACE_SECONDS, self._forget, link)
        else:
            self._forget(link)

    def _refuse(self, link: _Link, why: str) -> None:
        self.closed_connections += 1
        self._warn(logger, link.peer_host, "closed the connection from %s: %s", link.peer, why)
        link.abort_client()
        link.close_server_side()  # what it finished still reaches the server
        self._waiting.pop(link, None)

    # room ----------------------------------------------------------------------------------

    def fits(self, link: _Link, cost: int) -> bool:
        limits = self.limits
        return (
            link.held + cost <= limits.connection_bytes
            and link.frames < FRAMES_AHEAD
            and self.held + cost <= limits.total_bytes
        )

    def take(self, link: _Link, cost: int) -> None:
        link.held += cost
        link.frames += 1
        self.held += cost

    def wait(self, link: _Link) -> None:
        self._waiting[link] = None
        if self._stall_timer is None:
            self._arm_stall_check()

    def _admit_waiting(self) -> None:
        self._admit_scheduled = False
        for link in list(self._waiting):
            if link.retry():
                self._waiting.pop(link, None)

    def _check_stall(self) -> None:
        """Close the connection that blocks everyone if nothing can finish (see the module's
        docstring)."""
        self._stall_timer = None
        if not self._waiting:
            return
        assert self._loop is not None
        now = time.monotonic()
        if self._loop.time() - self._stall_due > STALL_SECONDS / 4 or self._message_ready():
            # The loop was away (busy, or this process was not running), or the server has a
            # message to take that its loop has not seen yet: nothing says that nothing can
            # finish. Judge again, a whole STALL_SECONDS on, once the loop read its sockets.
            self._last_taken = now
        if self._server_idle and now - self._last_taken >= STALL_SECONDS:
            holders = [link for link in self._links.values() if link.held > 0 and link.open]
            if holders:
                victim = max(holders, key=lambda link: (link not in self._waiting, link.held))
                self.closed_connections += 1
                self._warn(
                    logger,
                    victim.peer_host,
                    "closed the connection from %s: its unfinished message held %s bytes while "
                    "other frames waited for room (KVSTORE_RECEIVE_BUFFER_BYTES %s, %s per "
                    "connection) and the server had nothing left to take",
                    victim.peer,
                    str(victim.held),
                    str(self.limits.total_bytes),
                    str(self.limits.connection_bytes),
                )
                victim.abort()
                self._forget(victim)  # libzmq drops an unfinished message with its connection
                self._last_taken = now
                self._admit_waiting()
        if self._waiting:
            self._arm_stall_check()

    def _arm_stall_check(self) -> None:
        if self._loop is not None:
            self._stall_due = self._loop.time() + STALL_SECONDS / 2
            self._stall_timer = self._loop.call_at(self._stall_due, self._check_stall)


class _Link:
    """One peer's connection and its relay: the ZMTP framing read so far and the room held."""

    def __init__(self, gate: AdmissionGate, client: asyncio.Transport, address: str, peer: str):
        self.gate = gate
        self.client = client
        self.server: asyncio.Transport | None = None
        self.address = address
        self.peer = peer
        self.peer_host = peer.rsplit(":", 1)[0]
        self.held = 0
        self.frames = 0
        self.client_closed = False
        self.server_closed = False
        self.replies_paused = False
        self.released = False
        # framing
        self.greeting: bytearray | None = bytearray()
        self.curve = False
        self.head = bytearray()  # the current frame's flags and size bytes, while incomplete
        self.remaining = 0  # body bytes of the current frame still to come
        self.frame_flags = 0
        self.frame_cost = 0
        self.commands = 0
        self.messages_started = False
        # a message's structure (connections without CURVE)
        self.message_frames = 0  # frames of the current message so far
        self.header: bytearray | None = None  # the header frame's bytes, while it arrives
        self.frames_left = 0
        self.bytes_left = 0
        # a frame waiting for room: its size and cost, and the bytes not yet relayed
        self.waiting_cost: int | None = None
        self.pending = b""
        self.pending_head = 0  # leading bytes of ``pending`` that are the waiting frame's head
        self.early = bytearray()  # bytes to relay once the relay's connection is up
        self.greeting_replied = 0  # bytes of the server's greeting passed to the peer
        self.held_replies = bytearray()  # the rest of it, until the peer's greeting is whole

    @property
    def open(self) -> bool:
        return not self.client_closed

    # reading from the peer -------------------------------------------------------------------

    def received(self, data: bytes) -> None:
        """Relay ``data`` from the peer, up to a frame that must wait for room."""
        if self.waiting_cost is not None:  # (a read that was under way when reading paused)
            self.pending += data
            return
        try:
            end = self._parse(data, 0)
        except _Refused as exc:
            self.gate._refuse(self, str(exc))
            return
        self._relay(data, end)

    def _relay(self, data: bytes, end: int) -> None:
        if end:
            chunk = data[:end] if end < len(data) else data
            server = self.server
            if server is not None:
                server.write(chunk)
            else:  # (uvloop may read once before the pause of connection_made takes effect)
                self.early += chunk
        if end < len(data):
            self.pending = data[end:]
            self.gate.wait(self)
        self.update_reading()

    def retry(self) -> bool:
        """Try again to admit the waiting frame; True once nothing waits."""
        cost = self.waiting_cost
        if cost is None or self.client_closed:
            return True
        if not self.gate.fits(self, cost):
            return False
        self.gate.take(self, cost)
        self.waiting_cost = None
        self._start_body()
        data, head = self.pending, self.pending_head
        self.pending, self.pending_head = b"", 0
        try:
            end = self._parse(data, head)
        except _Refused as exc:
            self.gate._refuse(self, str(exc))
            return True
        self._relay(data, end)
        return self.waiting_cost is None

    def update_reading(self) -> None:
        """Read the peer only once the relay's connection is up, while nothing waits for room
        and its replies are read."""
        if self.client_closed:
            return
        if self.server is not None and self.waiting_cost is None and not self.replies_paused:
            self.client.resume_reading()
        else:
            self.client.pause_reading()

    def _parse(self, data: bytes, pos: int) -> int:
        """Read the framing of ``data[pos:]``; returns how far ``data`` may be relayed (all of
        it, unless a frame must wait for room: then up to that frame's head)."""
        n = len(data)
        while pos < n:
            remaining = self.remaining
            if remaining:
                take = min(remaining, n - pos)
                if self.header is not None:
                    self.header += data[pos : pos + take]
                pos += take
                self.remaining = remaining - take
                if not self.remaining:
                    self._end_frame()
                continue
            if self.greeting is not None:
                take = min(GREETING_BYTES - len(self.greeting), n - pos)
                self.greeting += data[pos : pos + take]
                pos += take
                if len(self.greeting) == GREETING_BYTES:
                    self._read_greeting()
                continue
            head_start = pos - len(self.head)  # (negative: the head began in earlier data)
            if not self.head:
                flags = data[pos]
                if flags & _RESERVED:
                    raise _Refused(f"a frame with reserved flag bits set ({flags:#04x})")
                self.head.append(flags)
                pos += 1
            need = (9 if self.head[0] & _LONG else 2) - len(self.head)
            take = min(need, n - pos)
            self.head += data[pos : pos + take]
            pos += take
            if take < need:
                continue
            flags = self.head[0]
            size = int.from_bytes(self.head[1:], "big")
            self.head.clear()
            self.frame_flags = flags
            cost = self._check_frame(flags, size)
            self.remaining = size
            if cost is None:  # a handshake command: libzmq takes it, no room needed
                self.frame_cost = 0
                self._start_body()
                continue
            self.frame_cost = cost
            if not self.gate.fits(self, cost):
                self.waiting_cost = cost
                start = max(head_start, 0)
                self.pending_head = pos - start
                return start
            self.gate.take(self, cost)
            self._start_body()
        return n

    def _read_greeting(self) -> None:
        greeting = self.greeting
        assert greeting is not None
        if greeting[0] != 0xFF or greeting[9] != 0x7F:
            raise _Refused("a greeting that is not ZMTP 3's")
        if greeting[10] < 3:
            raise _Refused(f"ZMTP version {greeting[10]} (pskv speaks 3)")
        self.curve = bytes(greeting[12:32]).rstrip(b"\0") == b"CURVE"
        self.greeting = None
        if self.held_replies:
            self.client.write(bytes(self.held_replies))
            self.held_replies = bytearray()
        report = self.gate._on_unencrypted
        if report is not None and not self.curve:
            report(self.peer)

    def _check_frame(self, flags: int, size: int) -> int | None:
        """Check a frame's head against the limits; return the room it takes (None: a
        handshake command, which takes none)."""
        command = bool(flags & _COMMAND)
        if command and not self.messages_started and self.commands < HANDSHAKE_COMMANDS:
            if size > MAX_HANDSHAKE_COMMAND:
                raise _Refused(f"a handshake command of {size} bytes")
            self.commands += 1
            return None
        self.messages_started = True
        limit = self.gate.limits.frame_bytes
        if limit is not None and size > limit:
            raise _Refused(f"a frame of {size} bytes, over the limit of {limit}")
        if self.curve:
            return max(0, size - CURVE_MESSAGE_OVERHEAD)
        if command:  # no request is a command; libzmq consumes it, so its room is never freed
            return size
        if self.message_frames == 0:  # a request's header
            self.header = bytearray() if size <= wire.MAX_HEADER_BYTES else None
            self.frames_left, self.bytes_left = SLACK_FRAMES, SLACK_BYTES
        else:
            self.frames_left -= 1
            if self.frames_left < 0:
                raise _Refused(
                    f"a message of more than {self.message_frames} frames, more than its header "
                    f"declares and {SLACK_FRAMES} of slack"
                )
            if size > self.bytes_left:
                raise _Refused(
                    f"a frame of {size} bytes in a message that may carry {self.bytes_left} more "
                    f"bytes at most: what its header declares and {SLACK_BYTES} of slack"
                )
            self.bytes_left -= size
        return size

    def _start_body(self) -> None:
        if not self.remaining:
            self._end_frame()

    def _end_frame(self) -> None:
        flags = self.frame_flags
        if self.curve or flags & _COMMAND:
            return
        if self.message_frames == 0 and self.header is not None:
            declared = wire.declared_payload(bytes(self.header), self.gate.limits.frame_bytes)
            if declared is not None:
                frames, nbytes = declared
                self.frames_left = frames + SLACK_FRAMES
                self.bytes_left = nbytes + SLACK_BYTES
        self.header = None
        if flags & _MORE:
            self.message_frames += 1
        else:
            self.message_frames = 0

    # replies ----------------------------------------------------------------------------------

    def reply(self, data: bytes) -> None:
        """Relay ``data`` from the server to the peer."""
        if self.client_closed:
            return
        if self.greeting is not None:
            # The peer's greeting is not complete: pass the server's signature and version,
            # which the peer waits for before it sends the rest of its greeting, and hold the
            # rest back until the peer's greeting is whole. Otherwise a peer that gets the
            # server's whole greeting in one read may find the mechanisms disagree and close
            # before its own greeting left, and the server could not say why it failed.
            passed = self.greeting_replied
            free = max(0, GREETING_SIGNATURE_BYTES - passed)
            if free:
                self.client.write(data[:free])
                self.greeting_replied = passed + min(free, len(data))
            self.held_replies += data[free:]
            return
        self.client.write(data)

    def pause_replies(self) -> None:
        self.replies_paused = True
        if self.server is not None:
            self.server.pause_reading()
        self.update_reading()

    def resume_replies(self) -> None:
        self.replies_paused = False
        if self.server is not None and not self.server_closed:
            self.server.resume_reading()
        self.update_reading()

    # closing ---------------------------------------------------------------------------------

    def client_lost(self) -> None:
        self.client_closed = True
        self.gate._waiting.pop(self, None)
        self.close_server_side()
        self._maybe_closed()

    def server_lost(self) -> None:
        self.server_closed = True
        if not self.client_closed:
            self.client.close()  # after the replies it still has to send
        self._maybe_closed()

    def close_server_side(self) -> None:
        if self.server is not None and not self.server_closed:
            self.server.close()  # after what was relayed: finished messages still arrive

    def abort_client(self) -> None:
        if not self.client_closed:
            self.client_closed = True
            self.client.abort()

    def abort(self) -> None:
        self.abort_client()
        if self.server is not None and not self.server_closed:
            self.server_closed = True
            self.server.abort()

    def _maybe_closed(self) -> None:
        if self.client_closed and (self.server is None or self.server_closed):
            self.gate._closed(self)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gate.held -= self.held
            self.held = 0
            self.frames = 0
            self.pending = b""


class _ClientSide(asyncio.BufferedProtocol):
    """The peer's connection."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.link: _Link | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not subclasses of asyncio.Transport, but have its methods)
        self.gate._accept(self, cast(asyncio.Transport, transport))

    def get_buffer(self, sizehint: int) -> memoryview:
        link = self.link
        size = READ_BYTES
        if (
            link is not None
            and link.server is not None
            and link.waiting_cost is None
            and link.remaining > READ_BYTES
        ):
            size = min(link.remaining, BODY_READ_BYTES)  # the admitted frame's body only
        elif link is None or link.server is None:
            size = GREETING_BYTES  # the relay is not connected yet: keep what comes small
        return memoryview(self.gate._read_buffer)[:size]

    def buffer_updated(self, nbytes: int) -> None:
        if self.link is not None and not self.link.client_closed:
            # A copy: a transport keeps what the kernel did not take as it was given (uvloop
            # does not copy it), and the buffer is read into again.
            self.link.received(bytes(memoryview(self.gate._read_buffer)[:nbytes]))

    def eof_received(self) -> bool:
        return False  # close: the relay's side closes after what it was sent

    def pause_writing(self) -> None:
        if self.link is not None:
            self.link.pause_replies()

    def resume_writing(self) -> None:
        if self.link is not None:
            self.link.resume_replies()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.link is not None:
            self.link.client_lost()


class _ServerSide(asyncio.BufferedProtocol):
    """The relay's connection to the server's socket."""

    def __init__(self, link: _Link) -> None:
        self.link = link

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.link.server = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.link.gate._reply_buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self.link.reply(bytes(memoryview(self.link.gate._reply_buffer)[:nbytes]))  # (see above)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.server_lost()
