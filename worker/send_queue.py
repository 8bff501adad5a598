"""The order in which queued messages leave a worker: by priority, never reordered within a key.

Higher ``priority`` goes first; equal priorities go in submission order. A message with an
``order_key`` never leaves before an earlier message with the same key, whatever their
priorities: it is queued with the lower of its own priority and the lowest priority still queued
for that key. That keeps a pull behind the same key's push (the server relies on seeing a
worker's push before its pull) while other keys may overtake both.

Not thread-safe by itself: the transport holds its lock around every call.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Any


class SendQueue:
    """A priority queue of outgoing messages with per-key FIFO order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Hashable, Any]] = []
        self._seq = itertools.count()
        self._queued: dict[Hashable, list[int]] = {}  # order_key -> [count, lowest priority]

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: Any, priority: int = 0, order_key: Hashable = None) -> None:
        """Queue ``item``."""
        effective = priority
        if order_key is not None:
            entry = self._queued.get(order_key)
            if entry is None:
                self._queued[order_key] = [1, priority]
            else:
                effective = min(priority, entry[1])
                entry[0] += 1
                entry[1] = effective
        heapq.heappush(self._heap, (-effective, next(self._seq), order_key, item))

    def pop(self) -> Any:
        """The next item to send; raises IndexError when empty."""
        _, _, order_key, item = heapq.heappop(self._heap)
        if order_key is not None:
            entry = self._queued[order_key]
            entry[0] -= 1
            if entry[0] == 0:
                del self._queued[order_key]
        return item
