"""The one reply sender of a shard server: acks, errors and value replies, on the ROUTER socket.

Replies are sent directly from the loop thread, without per-message futures, and never block
(``NOBLOCK``; the socket's send queue is unbounded). A reply to a worker that is gone is dropped
(``ROUTER_MANDATORY`` makes it raise instead of vanish) and logged at debug level.

A value reply (a pull's, a pushpull's) carries the chunk's published value, and takes one of
three forms:

* dense (the main path): the published array itself, sent without a copy and tracked until
  ZeroMQ no longer reads it (:mod:`kvstore.server.published`,
  :class:`~kvstore.zerocopy.ZeroCopySender`);
* relayed (:meth:`Replies._send_relayed`): when the value is a round's sum without an
  optimizer and the worker offered to sum it itself, that round's pushes instead (fewer bytes
  for compressed pushes; see :mod:`kvstore.codecs.base`);
* compressed (:meth:`Replies._send_compressed`): for keys initialised with pull compression,
  nothing, the delta to the value the worker holds, or that value whole
  (:mod:`kvstore.codecs.pulled`).

A value reply may also acknowledge pushes of the same worker (``ak``), which then get no reply
of their own: see :mod:`kvstore.server.rounds`.

The warnings about what peers send (bad messages, refused requests) go through
:meth:`Replies.warn`: every text in them is escaped and cut (:func:`kvstore.safe_text.printable`)
and they are rate-limited per peer and for all peers together
(:class:`kvstore.safe_text.WarningThrottle`), since a stranger chooses both its routing id and
how often it sends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import zmq

from kvstore import wire
from kvstore.errors import ErrorCode
from kvstore.metrics import frames_nbytes
from kvstore.safe_text import WarningThrottle, printable
from kvstore.server.chunk import ChunkState, PendingReply
from kvstore.server.job import ServerState
from kvstore.wire import Op, ReplyFields
from kvstore.zerocopy import ZeroCopySender

logger = logging.getLogger(__name__)


def peer(identity: bytes) -> str:
    """A worker connection's routing id, as logs and error texts show it: escaped and cut
    (:func:`kvstore.safe_text.printable`), since the peer chooses it."""
    return printable(identity)


class Replies:
    """Sends the server's replies.

    Args:
        state: the server's shared state (its metrics count every reply; its job's mode and
            lost workers shape some replies).
        after_send: called after every send: a send can consume the socket's edge-triggered
            readiness, so the server must look for input again.

    Attributes:
        socket: the ROUTER socket while the server serves; None before and after (nothing is
            sent then).
        warnings: the rate limits of :meth:`warn`.
    """

    def __init__(self, state: ServerState, after_send: Callable[[], None]) -> None:
        self._state = state
        self._after_send = after_send
        self._sender = ZeroCopySender(native=None if state.config.native_sends else False)
        # (used on the loop thread only)
        self.socket: zmq.Socket | None = None
        self.warnings = WarningThrottle()

    def warn(
        self,
        log: logging.Logger,
        about: Hashable,
        message: str,
        *texts: object,
        level: int = logging.WARNING,
        exc_info: bool = False,
    ) -> bool:
        """Log ``message`` (``%s`` placeholders only) about a peer's request, each of ``texts``
        shown through :func:`~kvstore.safe_text.printable` (a routing id passed as bytes shows
        as :func:`peer` does), unless :attr:`warnings`' limits for ``about`` (the peer's
        routing id, or what else the warnings are counted by) are reached; the line says how
        many were left out before it. Returns whether it was logged."""
        if not log.isEnabledFor(level):
            return False
        verdict = self.warnings.allow(about)
        if verdict.allowed:
            shown = [printable(text) for text in texts]
            log.log(level, message + "%s", *shown, verdict.note(), exc_info=exc_info)
        return verdict.allowed

    def close(self) -> None:
        """Release the zero-copy sender (the server stopped)."""
        self._sender.close()

    def send(self, identity: bytes, frames: list[Any], op: Op | None, track: bool = False) -> Any:
        """Send a reply to a request of ``op`` (None: one that failed validation) now; returns
        its ticket (:class:`~kvstore.zerocopy.SendTicket` or alike, with ``done``) when ``track``
        (None if not sent)."""
        sock = self.socket
        if sock is None:
            return None
        try:
            ticket = self._sender.send_multipart(
                sock, [identity, *frames], flags=zmq.NOBLOCK, track=track
            )
            metrics = self._state.metrics
            if metrics is not None:
                metrics.sent(op, frames_nbytes(frames))
        except zmq.ZMQError as exc:  # the worker is gone (ROUTER_MANDATORY) or we are closing
            logger.debug("reply to %s not delivered: %s", peer(identity), exc)
            ticket = None
        self._after_send()
        return ticket

    def ack(self, reply: PendingReply) -> None:
        """Answer ``reply`` with an empty reply."""
        self.send(reply.identity, wire.reply(reply.rid), reply.op)

    def answer(self, reply: PendingReply, chunk: ChunkState) -> None:
        """Answer a finished request on ``chunk``: with its value if it asked for it, else an
        ack."""
        if reply.want_value:
            self.value(reply, chunk)
        else:
            self.ack(reply)

    def error(
        self,
        identity: bytes,
        rid: int,
        op: Op | None,
        code: ErrorCode,
        message: str,
        lost_rank: int | None = None,
    ) -> None:
        """Refuse request ``rid`` of ``op`` (None: it failed validation); ``lost_rank``: the
        worker a ``WORKER_LOST`` error names."""
        metrics = self._state.metrics
        if metrics is not None:
            metrics.error(code)
        self.send(identity, wire.error(rid, code, message, lost_rank), op)

    def worker_lost(self, reply: PendingReply, rank: int, what: str) -> None:
        """Answer a pending request with WORKER_LOST naming ``rank``."""
        self.error(
            reply.identity,
            reply.rid,
            reply.op,
            ErrorCode.WORKER_LOST,
            self._state.job.lost_message(rank, what),
            rank,
        )

    def value(self, reply: PendingReply, chunk: ChunkState, acks: Sequence[int] = ()) -> None:
        """Answer ``reply`` with ``chunk``'s published value, acknowledging the pushes
        ``acks`` of the same worker."""
        assert chunk.value is not None
        answer = ReplyFields(acks=list(acks) if acks else None)
        if chunk.pull_codec is not None and reply.pull_version is not None:
            self._send_compressed(reply, chunk, answer)
            return
        relay = chunk.relay
        if relay is not None and 0 < len(relay) <= reply.relay_max:
            self._send_relayed(reply, relay, answer)
            return
        current = chunk.value.current
        send = self.send(
            reply.identity, wire.reply(reply.rid, answer, [current]), reply.op, track=True
        )
        if send is not None:
            chunk.value.track(send)

    def _send_relayed(self, reply: PendingReply, relay: list[Any], answer: ReplyFields) -> None:
        """Answer a relayed pull: the round's pushes instead of their sum. The frames are
        immutable ZeroMQ messages, so nothing needs tracking."""
        answer.relayed = len(relay)
        frames = [frame for payloads in relay for frame in payloads]
        self.send(reply.identity, wire.reply(reply.rid, answer, frames), reply.op)

    def _send_compressed(self, reply: PendingReply, chunk: ChunkState, answer: ReplyFields) -> None:
        """Answer a compressed pull (see :mod:`kvstore.codecs.pulled`): nothing, the delta to
        the current ``w_pub`` or ``w_pub`` whole, by the version the worker holds."""
        assert chunk.value is not None and reply.pull_version is not None
        weights = chunk.pulled_weights(reply.rank)
        held = reply.pull_version
        if self._state.job.mode == "dist_async" and held == weights.version:
            weights.advance(chunk.value.current)  # this worker's own w_pub moves on now
        kind, frames = weights.reply(held)
        answer.pull_kind = kind
        answer.version = weights.version
        answer.base_version = weights.version - 1
        self.send(reply.identity, wire.reply(reply.rid, answer, frames), reply.op)


__all__ = ["Replies", "peer"]
