"""Outgoing message order: priority first, FIFO among equals, never reordered within a key."""

from __future__ import annotations

import pytest

from kvstore.worker.send_queue import SendQueue


def drain(queue: SendQueue) -> list:
    out = []
    while queue:
        out.append(queue.pop())
    return out


def test_higher_priority_first_then_submission_order():
    q = SendQueue()
    for item, priority in [("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1)]:
        q.push(item, priority)
    assert drain(q) == ["b", "d", "a", "c", "e"]


def test_a_key_never_overtakes_its_earlier_messages():
    q = SendQueue()
    q.push("push k", 0, order_key="k")
    q.push("push j", 1, order_key="j")
    q.push("pull k", 10, order_key="k")  # must stay behind "push k"
    q.push("pull j", 10, order_key="j")
    q.push("other", 3)
    assert drain(q) == ["other", "push j", "pull j", "push k", "pull k"]


def test_key_bookkeeping_resets_once_drained():
    q = SendQueue()
    q.push("low", -5, order_key="k")
    assert drain(q) == ["low"]
    q.push("high", 5, order_key="k")  # no earlier message of k is queued any more
    q.push("mid", 0)
    assert drain(q) == ["high", "mid"]
    with pytest.raises(IndexError):
        q.pop()
