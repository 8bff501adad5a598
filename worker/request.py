"""A worker's requests in flight, and the deadline of the calls that wait for them.

The transport (:mod:`kvstore.worker.transport`) makes a :class:`Request` for every message it
queues and completes it, on its I/O thread, with the server's reply or an error; callers on any
thread wait for it with :meth:`Request.wait`, or for several at once with :func:`wait_all`,
all within one :class:`Deadline` per blocking call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.errors import KVStoreError, KVStoreTimeoutError
from kvstore.wire import Message, Op

logger = logging.getLogger(__name__)

_CALLBACK_LOCK = threading.Lock()
"""Hands a request's completion callback between the caller and the I/O thread (held for a
few bytecodes, so one lock for all requests)."""


class Deadline:
    """The end of one blocking call: ``KVSTORE_TIMEOUT`` bounds a whole call (a pull of many
    keys, a close), not each wait within it, so all of a call's waits share one of these.

    Args:
        timeout: seconds from now; None: no end.
    """

    __slots__ = ("timeout", "end")

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left (0 once past the end), or None without an end."""
        return None if self.end is None else max(0.0, self.end - time.monotonic())


class Request:
    """A request in flight; :meth:`wait` blocks until its reply.

    Attributes:
        rid: request id.
        server: server rank it went to.
        op: the operation.
        what: a short description for error messages (``"PULL of key 'w' chunk 0"``).
        nbytes: bytes of all frames sent.
    """

    __slots__ = (
        "rid",
        "server",
        "shard",
        "resend",
        "op",
        "what",
        "nbytes",
        "_done",
        "_gate",
        "_reply",
        "_error",
        "_done_cb",
        "_completing",
    )

    def __init__(self, rid: int, server: int, op: Op, what: str, nbytes: int) -> None:
        self.rid = rid
        self.server = server
        # With replication: the server whose shard the request is for (``server`` is the
        # replica it goes to), and what sending it again to another replica takes.
        self.shard = server
        self.resend: tuple[Any, ...] | None = None
        self.op = op
        self.what = what
        self.nbytes = nbytes
        # Completion is a flag plus a lock held until then: cheaper than an Event per request.
        self._done = False
        self._gate = threading.Lock()
        self._gate.acquire()
        self._reply: Message | None = None
        self._error: BaseException | None = None
        self._done_cb: Callable[[Request], None] | None = None
        self._completing = False  # the reply is in; a callback added now runs at once

    def done(self) -> bool:
        return self._done

    def failed(self) -> bool:
        return self._done and self._error is not None

    def wait(self, timeout: float | Deadline | None = None) -> Message:
        """The reply message; raises the server's error, or on timeout/connection loss.

        ``timeout``: seconds, or the :class:`Deadline` of the call this wait is part of.
        """
        if not self._done:
            seconds = timeout.remaining() if isinstance(timeout, Deadline) else timeout
            if self._gate.acquire(timeout=-1 if seconds is None else seconds):
                self._gate.release()  # let other waiters through too
        if not self._done:
            limit = timeout.timeout if isinstance(timeout, Deadline) else timeout
            raise KVStoreTimeoutError(
                f"{self.what} to server {self.server} got no reply within {limit} s "
                f"(KVSTORE_TIMEOUT, for the whole call); is another worker stuck?"
            )
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        return self._reply

    def release_payloads(self) -> None:
        """Forget the reply's payload frames (their values were copied out), keeping its fields.

        A request can outlive its reply's use by a whole step (the client keeps each chunk's
        last push until the next one); holding a pushpull's megabytes of ZeroMQ receive buffers
        that long makes the allocator map fresh pages for the next replies instead of reusing
        these, and every page of a large reply then costs a page fault.
        """
        reply = self._reply
        if reply is not None and reply.payloads:  # (never the shared, empty _ACKNOWLEDGED)
            reply.payloads = []  # a received reply belongs to this request alone

    def add_done_callback(self, callback: Callable[[Request], None]) -> None:
        """Run ``callback(self)`` when the request completes: on the I/O thread as it does,
        or here and now if its reply is already in. At most one callback per request."""
        with _CALLBACK_LOCK:
            if not self._completing:
                self._done_cb = callback
                return
        callback(self)

    def _complete(self, reply: Message | None, error: BaseException | None) -> None:
        if self._completing:  # (set before _done)
            return
        self._reply, self._error = reply, error
        # The lock orders this against add_done_callback: a callback is either seen here or
        # run by whoever adds it, never lost between the two threads.
        with _CALLBACK_LOCK:
            self._completing = True
            callback = self._done_cb
        if callback is not None:
            # Before waking anyone: whoever waits on this request sees the callback's work done.
            try:
                callback(self)
            except Exception:
                logger.exception("completion callback of %s failed", self.what)
            # The client keeps a chunk's last push until its next one: dropping the callback
            # lets go of what it holds (the pull's target) as soon as it has run.
            self._done_cb = None
        self._done = True
        self._gate.release()


def wait_all(requests: Sequence[Request], timeout: float | Deadline | None) -> list[Message]:
    """Wait for every request (sharing one deadline: ``timeout`` seconds from now, or the
    call's :class:`Deadline`); raise the first error after all ended."""
    deadline = timeout if isinstance(timeout, Deadline) else Deadline(timeout)
    replies: list[Message] = []
    first_error: BaseException | None = None
    for request in requests:
        try:
            replies.append(request.wait(deadline))
        except KVStoreError as exc:
            if first_error is None:
                first_error = exc
    if first_error is not None:
        raise first_error
    return replies
