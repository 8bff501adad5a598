"""Pushes of codecs that take several round trips per step (PowerSGD), each tracked as one push.

PowerSGD pushes P, gets the servers' P_hat, pushes Q and gets Q_sum: a chunk's push is a chain
of plain pushes that the client tracks as one request (:class:`RoundTrips`), and each round
counts as one of the chunk's pushes, so a pull waits, on its server, for the step's last round.
Only ``dist_sync`` runs such codecs (``dist_async`` applies each push on arrival).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvstore.codecs import Encoder
from kvstore.errors import KVStoreError, ProtocolError
from kvstore.wire import Op, PushFields
from kvstore.worker.request import Request
from kvstore.worker.stats import TrafficStats
from kvstore.worker.transport import Transport


class RoundTrips:
    """One chunk's push of a codec that takes several round trips per step, as one request.

    The client keeps each chunk's last push as a request (later pushes, pulls, ``barrier``
    and ``close`` wait on it), so the step is a :class:`Request` of its own, :attr:`step`,
    that is never sent: it completes with the final round's reply, or fails with the first
    failing round's error. Every round is a plain PUSH. Its reply arrives on the transport's
    I/O thread, which runs the encoder there: an intermediate round's frames become the next
    round's payload (:meth:`Encoder.next_round`), submitted from the same thread; the final
    round's acknowledgement ends the encoder's step (:meth:`Encoder.end_step`). The chunk is
    encoded again only after :attr:`step` completed, so the encoder is never used by two
    threads at once.
    """

    def __init__(
        self,
        transport: Transport,
        stats: TrafficStats,
        encoder: Encoder,
        server: int,
        push: PushFields,
        priority: int,
        order_key: Any,
        what: str,
    ) -> None:
        self._transport = transport
        self._stats = stats
        self._encoder = encoder
        self._server = server
        self._push = push
        self._priority = priority
        self._order_key = order_key
        self._what = what
        self._rounds = encoder.round_trips
        self._round = 0
        self.step: Request = Request(0, server, Op.PUSH, what, 0)

    def start(self, payloads: list[Any]) -> Request:
        """Send the first round's ``payloads``; returns :attr:`step`."""
        first = self._submit(payloads)
        if first is not None:
            self.step.nbytes = first.nbytes
        return self.step

    def _submit(self, payloads: list[Any]) -> Request | None:
        self._round += 1
        push = self._push
        if push.sequence is not None:  # (replication: every round trip is a push of its own)
            push = dataclasses.replace(push, sequence=push.sequence + self._round - 1)
        try:
            return self._transport.submit(
                self._server,
                push,
                payloads,
                priority=self._priority,
                order_key=self._order_key,
                what=f"{self._what} (round {self._round} of {self._rounds})",
                on_done=self._on_reply,
            )
        except KVStoreError as exc:  # the store closed under us
            self.step._complete(None, exc)
            return None

    def _on_reply(self, request: Request) -> None:
        if request._error is not None:
            self.step._complete(None, request._error)
            return
        reply = request._reply
        assert reply is not None
        began = time.perf_counter()
        try:
            if self._round < self._rounds:
                payloads = self._encoder.next_round(reply.payloads)
            else:
                self._encoder.end_step(reply.payloads)
        except Exception as exc:  # (a CodecError: a reply this encoder cannot use)
            self.step._complete(
                None, ProtocolError(f"{self._what}: the reply to round {self._round}: {exc}")
            )
            return
        finally:
            self._stats.encode_seconds += time.perf_counter() - began
            request.release_payloads()
        if self._round == self._rounds:
            self.step._complete(reply, None)
            return
        sent = self._submit(payloads)
        if sent is not None:
            self._stats.pushed_bytes += sent.nbytes
            self._stats.push_messages += 1
