"""Published values are never written while a send may read them."""

from __future__ import annotations

import numpy as np

from kvstore.server.published import PublishedValue


class FakeTracker:
    """Says ``done`` like a SendTicket or a zmq MessageTracker."""

    def __init__(self) -> None:
        self.done = False


def test_spare_is_never_the_published_array_and_waits_for_sends():
    value = PublishedValue(np.zeros(4, np.float32))
    first = value.current
    spare = value.spare()
    assert spare is not first
    tracker = FakeTracker()
    value.track(tracker)  # a reply is still sending `first`
    value.publish(spare)
    nxt = value.spare()
    assert nxt is not first and nxt is not spare  # `first` is busy: a fresh array
    tracker.done = True
    value.publish(nxt)
    reused = value.spare()
    assert reused is first or reused is spare


def test_idle_spares_are_bounded():
    value = PublishedValue(np.zeros(4, np.float32))
    for _ in range(10):
        value.publish(value.spare())
    assert len(value._retired) <= 1
