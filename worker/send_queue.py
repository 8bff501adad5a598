"""The order in which one connection's queued messages leave a worker.

Express messages first: those with little or no payload (pull requests, barriers, pushes of tiny
keys), so that a pull request never waits behind megabytes of pushes of other chunks. Then
higher ``priority`` first, and submission order among equals.

A message with an ``order_key`` never leaves before an earlier message with the same key: it
waits, outside the ordering, until that one has left, and then competes with its own rank. So a
pull request leaves right after its chunk's push (the server relies on seeing a worker's push
before its pull), ahead of the other chunks' pushes still queued.

Not thread-safe by itself: the transport holds its lock around every call.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Any

_EXPRESS = 1 << 40  # above any priority a user passes


class _Entry:
    __slots__ = ("order", "key", "item", "follower")

    def __init__(self, rank: int, seq: int, key: Hashable, item: Any) -> None:
        self.order = (-rank, seq)  # smaller goes first; built once, compared on every heap move
        self.key = key
        self.item = item
        self.follower: _Entry | None = None

    def __lt__(self, other: _Entry) -> bool:
        return self.order < other.order


class SendQueue:
    """A priority queue of outgoing messages with per-key FIFO order."""

    def __init__(self) -> None:
        self.heads: list[_Entry] = []
        """A heap of the entries with no earlier entry of their key: non-empty exactly when the
        queue is, and ``heads[0].order`` is the next item's sort key (smaller goes first). A
        sender choosing among queues for every message reads both without a call per queue."""
        self._last: dict[Hashable, _Entry] = {}  # the latest queued entry of each key
        self._seq = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(
        self,
        item: Any,
        priority: int = 0,
        order_key: Hashable = None,
        express: bool = False,
        seq: int | None = None,
    ) -> None:
        """Queue ``item``; ``express`` items go before all others (order keys permitting).

        ``seq`` orders equal ranks (default: this queue's own submission counter); a caller
        that merges several queues passes one shared counter.
        """
        order = next(self._seq) if seq is None else seq
        entry = _Entry(priority + (_EXPRESS if express else 0), order, order_key, item)
        self._size += 1
        if order_key is not None:
            previous = self._last.get(order_key)
            self._last[order_key] = entry
            if previous is not None:
                previous.follower = entry  # becomes ready when `previous` leaves
                return
        heapq.heappush(self.heads, entry)

    def peek(self) -> Any:
        """The next item, without removing it; raises IndexError when empty."""
        return self.heads[0].item

    def pop(self) -> Any:
        """Remove and return the next item; raises IndexError when empty."""
        entry = heapq.heappop(self.heads)
        self._size -= 1
        if entry.follower is not None:
            heapq.heappush(self.heads, entry.follower)
        elif entry.key is not None and self._last.get(entry.key) is entry:
            del self._last[entry.key]
        return entry.item
