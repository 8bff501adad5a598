"""Published values: the arrays that pull replies send without copying.

A reply hands the array's memory to ZeroMQ, which may still be reading it after the handler
returned. So a published array is never written again: an update writes a *spare* array and
then publishes it, and the old one becomes a spare once every send that used it has finished
(the sends' tickets say when: :class:`~kvstore.zerocopy.SendTicket`). In steady state a chunk
alternates between two arrays, so pulls always see a whole update (never a torn one) and no
update waits for a slow reader.

All methods run on the server's event-loop thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _send_finished(send: Any) -> bool:
    """True once ZeroMQ no longer reads the memory of a tracked send.

    ``send`` is a :class:`~kvstore.zerocopy.SendTicket` or a pyzmq ``MessageTracker`` (both say
    so with ``done``), or None for a send that never happened.
    """
    return send is None or bool(send.done)


class PublishedValue:
    """The current value of a chunk as pulls see it, plus spare arrays for the next update."""

    def __init__(self, initial: np.ndarray) -> None:
        self.current = initial
        self._sends: dict[int, list[Any]] = {}
        self._retired: list[np.ndarray] = []

    def track(self, send: Any) -> None:
        """Record a send that reads :attr:`current`."""
        self._sends.setdefault(id(self.current), []).append(send)

    def _in_flight(self, array: np.ndarray) -> bool:
        sends = self._sends.get(id(array))
        if not sends:
            return False
        pending = [s for s in sends if not _send_finished(s)]
        if pending:
            self._sends[id(array)] = pending
            return True
        del self._sends[id(array)]
        return False

    def spare(self) -> np.ndarray:
        """An array no send is reading, to write the next value into (not yet published)."""
        for i, array in enumerate(self._retired):
            if not self._in_flight(array):
                return self._retired.pop(i)
        return np.empty_like(self.current)

    def publish(self, array: np.ndarray) -> None:
        """Make ``array`` (from :meth:`spare`) the value pulls send from now on."""
        old = self.current
        self.current = array
        if old is not array:
            self._retired.append(old)
            # Keep at most one idle spare; drop the rest once no send reads them.
            kept_idle = False
            retired = []
            for array in self._retired:
                if self._in_flight(array):
                    retired.append(array)
                elif not kept_idle:
                    retired.append(array)
                    kept_idle = True
            self._retired = retired

    def give_back(self, array: np.ndarray) -> None:
        """Return an unpublished spare (an update that failed)."""
        if array is not self.current:
            self._retired.append(array)
