"""Heartbeat bookkeeping shared by servers and workers: who has been silent for too long.

Workers ping every server every :func:`~kvstore.config.heartbeat_interval` on their control
connection (:data:`kvstore.wire.Op.PING`) and servers answer; besides, *any* message counts as
a sign of life, so a busy peer is never declared lost. The owner of a :class:`Liveness` stores
``heard[peer] = now`` itself whenever a message from ``peer`` arrives (one dict store: the cost
on the hot path), and calls :meth:`Liveness.overdue` about every ``period`` seconds.

A process that could not listen cannot tell whether its peers spoke: when the checks were late
(this process was stopped with SIGSTOP, or its thread did not run), every peer counts as heard
at the late check, so a stall of our own is never mistaken for the peers' silence (their
messages are still queued, unread). The peers that stalled meanwhile are found one timeout
later.

This module depends on nothing else in the package.
"""

from __future__ import annotations

import math
from collections.abc import Hashable


class Liveness:
    """Last-heard times of peers and which of them are overdue.

    Args:
        timeout: a peer unheard of for longer than this many seconds is overdue.
        period: how often the owner calls :meth:`overdue`; a call more than
            ``2 * period + STALL_SLACK`` seconds after the previous one means the owner itself
            stalled.

    Attributes:
        heard: peer -> ``time.monotonic()`` of its last message; the owner writes it, and
            deletes the peers it no longer watches.
    """

    STALL_SLACK = 0.25
    """Seconds a check may be late, beyond two periods, before it counts as a stall."""

    def __init__(self, timeout: float, period: float) -> None:
        if not timeout > 0 or not period > 0:
            raise ValueError(f"timeout and period must be > 0, got {timeout} and {period}")
        self.timeout = timeout
        self.period = period
        self.heard: dict[Hashable, float] = {}
        self._last_check: float | None = None
        self._floor = -math.inf  # everyone counts as heard at this time (the last stall's end)

    def overdue(self, now: float) -> list[Hashable]:
        """The peers whose last message is older than the timeout at ``now``, oldest first."""
        last, self._last_check = self._last_check, now
        if last is not None and now - last > 2 * self.period + self.STALL_SLACK:
            self._floor = now
        limit = now - self.timeout
        floor = self._floor
        late = [(t, p) for p, t in self.heard.items() if t < limit and floor < limit]
        return [p for _, p in sorted(late, key=lambda item: item[0])]

    def silence(self, peer: Hashable, now: float) -> float:
        """Seconds since ``peer`` was last heard from (or since our last stall, if later)."""
        return now - max(self.heard.get(peer, now), self._floor)
