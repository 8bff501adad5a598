"""A worker's heartbeats: which servers to ping when, and which were silent for too long.

The transport's I/O thread pings every server that took this worker (a ``PING`` on its control
connection, outside the send queues) as often as this worker's heartbeat timeout and the
server's own need (:mod:`kvstore.heartbeat`); any message received counts as a sign of life, so
the hot path pays one clock read per batch of replies (the transport stores it in
:attr:`Heartbeats.heard`). A server silent for longer than the timeout is lost: it stalled, or
its host or network went away. Everything here runs on the I/O thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import cast

from kvstore.config import heartbeat_interval
from kvstore.errors import KVStoreError, WorkerLostError
from kvstore.heartbeat import Liveness
from kvstore.wire import Message
from kvstore.worker.request import Request

logger = logging.getLogger(__name__)


class Heartbeats:
    """The ping schedule and the servers' liveness.

    Args:
        timeout: a server that sent nothing for this many seconds is lost; 0: never (servers
            are still pinged as often as their own timeouts need, from their HELLO replies).
        servers: server addresses in rank order (named in errors).
        lost: the servers declared lost (the transport's, read here).
        send_ping: sends a PING to a server now; returns its request, or None where it could
            not go.
        server_lost: declares a server lost, with the reason.

    Attributes:
        every: how often to ping, in seconds (None: never); the shortest interval of ours and
            the servers'.
        heard: server -> ``time.monotonic()`` of its last message, which the transport writes
            (None: servers are never declared lost here).
    """

    def __init__(
        self,
        timeout: float,
        servers: Sequence[str],
        lost: Mapping[int, str],
        send_ping: Callable[[int], Request | None],
        server_lost: Callable[[int, str], None],
    ) -> None:
        self._servers = tuple(servers)
        self._lost = lost
        self._send_ping = send_ping
        self._server_lost = server_lost
        self._liveness: Liveness | None = None
        self.heard: dict[Hashable, float] | None = None
        self.every: float | None = None
        if timeout > 0:
            self.every = heartbeat_interval(timeout)
            self._liveness = Liveness(timeout, self.every)
            self.heard = self._liveness.heard
        self._targets: set[int] = set()  # the servers that answered a HELLO
        self._due = 0.0  # when the next pings are due
        self._pings: dict[int, Request] = {}  # each server's last ping

    def beat(self) -> int:
        """Ping the servers and declare lost those silent for too long, when due.

        Returns the milliseconds until the next time this is due. Every server that answered
        a HELLO is pinged every :attr:`every` seconds on its control connection, unless its
        last ping is still unanswered; any message from a server counts as a sign of life.
        """
        every = self.every
        assert every is not None
        now = time.monotonic()
        if now < self._due:
            return int((self._due - now) * 1000) + 1
        self._due = now + every
        liveness = self._liveness
        if liveness is not None:
            for peer in liveness.overdue(now):
                server = cast(int, peer)  # (the transport records servers by rank)
                self._server_lost(
                    server,
                    f"server {server} ({self._servers[server]}) sent nothing for "
                    f"{liveness.silence(server, now):.1f} s (KVSTORE_HEARTBEAT_TIMEOUT="
                    f"{liveness.timeout:g}): it died, stalled or the network is down",
                )
        for server in list(self._targets):
            ping = self._pings.get(server)
            if (ping is None or ping._done) and server not in self._lost:
                request = self._send_ping(server)
                if request is not None:
                    self._pings[server] = request
        return int(every * 1000) + 1

    def on_hello_reply(self, server: int, msg: Message) -> None:
        """A server took this worker: ping it from now on, often enough for its heartbeat
        timeout (``hb``) as well as ours."""
        self._targets.add(server)
        server_timeout = (msg.body.heartbeat_ms or 0) / 1000
        if server_timeout > 0:
            every = heartbeat_interval(server_timeout)
            if self.every is None or every < self.every:
                self.every = every

    def forget(self, server: int) -> None:
        """Stop watching a lost server's silence (a lost server stays lost)."""
        if self._liveness is not None:
            self._liveness.heard.pop(server, None)

    def ping_refused(self, request: Request, error: KVStoreError) -> bool:
        """A server answered a PING with ``error``; returns whether it declared this worker
        lost (it stalled for longer than the timeout): its requests there will never be
        answered then, so the caller fails them, and the server is not pinged again."""
        if not isinstance(error, WorkerLostError):
            # (e.g. a ping that crossed this worker's goodbye)
            logger.debug("%s: %s", request.what, error)
            return False
        logger.error("%s: %s", request.what, error)
        self._targets.discard(request.server)  # (it will not serve this worker again)
        return True
