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


def test_express_messages_overtake_bulk_but_not_their_own_key():
    q = SendQueue()
    q.push("push c0", 0, order_key="c0")
    q.push("push c1", 0, order_key="c1")
    q.push("push c2", 9, order_key="c2")
    q.push("pull c1", 0, order_key="c1", express=True)  # must stay behind "push c1"
    q.push("pull c3", -5, order_key="c3", express=True)  # nothing of c3 queued: goes first
    q.push("barrier", 0, express=True)
    assert q.peek() == "barrier"
    assert drain(q) == ["barrier", "pull c3", "push c2", "push c0", "push c1", "pull c1"]


def test_a_pull_leaves_right_after_its_push_ahead_of_other_pushes():
    q = SendQueue()
    for c in range(4):
        q.push(f"push c{c}", 0, order_key=f"c{c}")
    for c in range(4):
        q.push(f"pull c{c}", 0, order_key=f"c{c}", express=True)
    assert drain(q) == [
        "push c0", "pull c0", "push c1", "pull c1", "push c2", "pull c2", "push c3", "pull c3"
    ]  # fmt: skip
