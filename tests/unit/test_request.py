"""A request's completion callback, added before or after its reply arrived."""

from __future__ import annotations

import threading

from kvstore.wire import Message, Op, ReplyFields
from kvstore.worker.request import Request


def _reply() -> Message:
    return Message(op=Op.REPLY, rid=1, body=ReplyFields(), fields={}, payloads=[])


def test_a_callback_added_before_the_reply_runs_when_it_completes():
    request = Request(1, 0, Op.PUSHPULL, "pushpull", 0)
    seen = []
    request.add_done_callback(lambda r: seen.append((r.done(), r._reply)))
    assert seen == []
    reply = _reply()
    request._complete(reply, None)
    assert seen == [(False, reply)]  # before waiters wake: they see its work done
    assert request.wait(1) is reply


def test_a_callback_added_after_the_reply_runs_at_once():
    request = Request(1, 0, Op.PUSHPULL, "pushpull", 0)
    request._complete(_reply(), None)
    seen = []
    request.add_done_callback(seen.append)
    assert seen == [request]


def test_a_callback_is_never_lost_to_a_reply_arriving_meanwhile():
    # The I/O thread completes requests while the caller adds callbacks: each runs once.
    for _ in range(200):
        requests = [Request(i, 0, Op.PUSHPULL, "pushpull", 0) for i in range(50)]
        runs = [0] * len(requests)

        def complete_all(requests=requests):
            for request in requests:
                request._complete(_reply(), None)

        io_thread = threading.Thread(target=complete_all)
        io_thread.start()
        for i, request in enumerate(requests):
            request.add_done_callback(lambda r, i=i, runs=runs: runs.__setitem__(i, runs[i] + 1))
        io_thread.join()
        assert runs == [1] * len(requests)
