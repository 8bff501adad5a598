"""The push lead: how far a worker's pushes to one server may run ahead of that server's rounds.

A synchronous round completes only when every worker's push of its chunk arrived, so a worker
whose TCP flows happen to be faster than others' gains nothing by running ahead: it only takes
link share from the workers the round waits for. Holding the lead to a few chunks per server
keeps the workers in step. The transport asks each data lane's :class:`PushLead` before it hands
a bulk push to ZeroMQ, and tells it of every bulk push it sent; control-lane messages are never
held back. A lead of 0 turns this off (no pushes are tracked then), and
:func:`kvstore.config.default_push_lead` picks the limit for a job's size.
"""

from __future__ import annotations

import collections

from kvstore.wire import Op
from kvstore.worker.request import Request

LEAD_CHUNKS = 3
"""Bulk pushes a data lane may have sent and not yet answered (see :meth:`PushLead.blocked`);
the client picks its limit with :func:`kvstore.config.default_push_lead`."""

LEAD_OPS = frozenset({Op.PUSH, Op.PUSHPULL})
"""The operations whose requests count towards the lead."""


class PushLead:
    """One data lane's bulk pushes sent and not yet answered (their round is not applied), and
    when one last was."""

    __slots__ = ("unanswered", "last_answer")

    def __init__(self) -> None:
        self.unanswered: collections.deque[Request] = collections.deque()
        self.last_answer = 0.0

    def blocked(self, limit: int, now: float, patience: float) -> bool:
        """True while ``limit`` bulk pushes sent on this lane are not yet answered.

        The limit lapses when nothing was answered for ``patience`` seconds, so workers that
        push in different orders cannot deadlock.
        """
        unanswered = self.unanswered
        if len(unanswered) < limit:
            return False
        for request in unanswered:  # (a few requests; asked for every message the lane holds)
            if request._done:
                unanswered = collections.deque(r for r in unanswered if not r._done)
                self.unanswered = unanswered
                self.last_answer = now
                break
        return len(unanswered) >= limit and now - self.last_answer < patience

    def sent(self, request: Request, now: float) -> None:
        """Count a bulk push just handed to ZeroMQ at ``now``."""
        if not self.unanswered:
            self.last_answer = now
        self.unanswered.append(request)
