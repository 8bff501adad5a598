"""What the admission gate lets the server's peers make it hold, and the bound on the server's
memory that follows (docs/operations.md, "Limits"); :mod:`kvstore.server.gate` applies them."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore import wire
from kvstore.errors import ConfigError

FRAMES_AHEAD = 64
"""Frames per connection the gate lets ahead of the server (a request has at most a header and
a few payload frames: this is a few dozen requests)."""

SLACK_FRAMES = 4
SLACK_BYTES = 64 * 1024
"""What a message without CURVE may carry beyond what its header declares (or, if its header
cannot be read, at all after it): room for the frames of a malformed request, which the server
then answers with an ``ERROR`` reply, instead of a closed connection."""

READ_BYTES = 64 * 1024
"""The most the gate reads from a connection at once, unless it reads inside a frame it
admitted (:data:`BODY_READ_BYTES`)."""

BODY_READ_BYTES = 1024 * 1024
"""The most the gate reads at once of an admitted frame's body, never past its end: all of it
is relayed at once (nothing can wait for room), and megabyte reads cost the relay a fraction of
what 64 KiB reads cost per byte."""

REPLY_BACKLOG = 256 * 1024
"""Bytes of replies a peer may leave unread before the gate stops reading its requests."""

REPLY_READ_BYTES = 256 * 1024
"""The most the event loop reads of replies at once (uvloop's and asyncio's read size)."""

CONNECTION_OVERHEAD = 64 * 1024
"""What a connection costs the server besides the buffers above: libzmq's session and engine,
the gate's bookkeeping and the event loop's transports (32 KiB measured per connection with 800
idle connections; twice that, for the allocator)."""

PER_CONNECTION_BYTES = (
    2 * READ_BYTES + wire.MAX_HEADER_BYTES + REPLY_BACKLOG + REPLY_READ_BYTES + CONNECTION_OVERHEAD
)
"""The most a connection makes the gate and libzmq keep besides its frames: a read waiting for
room, a read before the relay's connection is up, a header being read, the reply backlog with
one more read of replies, and the connection's fixed cost."""


@dataclass(frozen=True)
class GateLimits:
    """What the gate lets the server's peers make it hold.

    Attributes:
        max_connections: connections at once; more are closed as they arrive.
        total_bytes: frames not yet taken by the server, over all connections.
        connection_bytes: frames not yet taken by the server, per connection; at least the
            largest message the header checks let through, so that any such message can finish.
        frame_bytes: the largest frame (the server's ``ZMQ_MAXMSGSIZE``: the message limit, plus
            CURVE's overhead on a connection with keys); None: no limit.
    """

    max_connections: int
    total_bytes: int
    connection_bytes: int
    frame_bytes: int | None

    @classmethod
    def for_server(
        cls, max_message: int | None, max_connections: int, total_bytes: int
    ) -> GateLimits:
        """The limits of a server whose largest frame is ``max_message`` bytes (None: no
        limit), with its settings for connections and the total."""
        if max_message is None:
            return cls(max_connections, total_bytes, total_bytes, None)
        largest = largest_message(max_message)
        if total_bytes < largest:
            raise ConfigError(
                f"KVSTORE_RECEIVE_BUFFER_BYTES={total_bytes} cannot hold the largest message "
                f"that frames of {max_message} bytes make ({largest} bytes: a header and "
                f"{wire.MAX_PAYLOAD_FRAMES} payload frames); raise it, or lower "
                "KVSTORE_MAX_MESSAGE_BYTES or KVSTORE_PARTITION_BYTES"
            )
        return cls(max_connections, total_bytes, largest, max_message)


def largest_message(max_message: int) -> int:
    """The most a message that passes the header checks can take: a header, the most payload
    frames a request declares, each of at most ``max_message`` bytes, and the slack."""
    return wire.MAX_HEADER_BYTES + wire.MAX_PAYLOAD_FRAMES * max_message + SLACK_BYTES


def memory_bound(limits: GateLimits, encrypted: bool) -> int:
    """The most that the server's peers can make it hold for their messages, over its memory
    when idle: every frame not yet taken (:attr:`GateLimits.total_bytes`), what each of
    :attr:`GateLimits.max_connections` connections costs (:data:`PER_CONNECTION_BYTES`), the
    message the server is handling (its room is free once the server took it: at most
    :attr:`GateLimits.connection_bytes`) and, on a server with keys (``encrypted``), the frame
    that libzmq's I/O thread is decrypting into a copy of itself."""
    bound = limits.total_bytes + limits.max_connections * PER_CONNECTION_BYTES
    bound += limits.connection_bytes
    if encrypted and limits.frame_bytes is not None:
        bound += limits.frame_bytes
    return bound
