"""How many bytes of pushes a worker hands to ZeroMQ before their connections took them.

A worker's pushes go out in the order the client submitted them (it interleaves the servers'
chunks), but once handed to ZeroMQ each server's connection drains on its own, and TCP shares
the worker's uplink among its connections unevenly. What one connection gets ahead by is what
another server's rounds wait for at the end of a step, so the window over all connections must
be small; it must also be large enough that no connection runs dry between two turns of the
I/O thread. A fixed size cannot be both on every network, so the window is a time's worth of
the send rate, measured while the window was full (only then does the rate say what the
connections take rather than what the caller submits).
"""

from __future__ import annotations

MIN_WINDOW_BYTES = 1024 * 1024
"""The smallest window a measured rate sets (a message bigger than the window still goes alone)."""

RATE_SAMPLE_S = 0.01
"""A rate sample spans at least this much time during which the window was full."""

REFILL_FRACTION = 0.25
"""While the window is full, the I/O thread looks again after this fraction of the time the
connections take to drain a whole window at the measured rate (see
:meth:`SendWindow.refill_wait_seconds`)."""

MIN_REFILL_WAIT_S = 0.001
MAX_REFILL_WAIT_S = 0.02
"""Bounds of that wait: 1 ms before a rate is known (and on fast links), at most 20 ms, so a
rate measured while a link was slow does not leave a recovered one waiting long."""


class SendWindow:
    """The data lanes' window: ``max_bytes``, or ``queue_seconds`` of the measured send rate.

    The rate is measured in both cases: it also says how long the I/O thread may wait while the
    window is full (:meth:`refill_wait_seconds`).

    Args:
        max_bytes: the window before any rate is known, and its largest size.
        queue_seconds: the window is this much of the send rate, within
            ``[MIN_WINDOW_BYTES, max_bytes]``; 0 keeps it at ``max_bytes``.

    Attributes:
        bytes: the current window.
        rate: the measured send rate in bytes per second (None until measured): each sample
            is averaged with the previous value, so the window follows a changing link within
            a few samples without jumping on one odd interval.
    """

    def __init__(self, max_bytes: int, queue_seconds: float = 0.0) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if not queue_seconds >= 0:
            raise ValueError(f"queue_seconds must be >= 0, got {queue_seconds}")
        self.max_bytes = max_bytes
        self.queue_seconds = queue_seconds
        self.bytes = max_bytes
        self.rate: float | None = None
        self._last: float | None = None
        self._sample_bytes = 0
        self._sample_seconds = 0.0

    def observe(self, written: int, now: float, was_full: bool) -> None:
        """Account ``written`` bytes the connections took since the previous call (at ``now``,
        monotonic seconds); ``was_full`` says the window held a message back since then."""
        last, self._last = self._last, now
        if not was_full or last is None:
            return
        self._sample_bytes += written
        self._sample_seconds += now - last
        if self._sample_seconds < RATE_SAMPLE_S:
            return
        sample = self._sample_bytes / self._sample_seconds
        self.rate = sample if self.rate is None else (self.rate + sample) / 2
        self._sample_bytes, self._sample_seconds = 0, 0.0
        if self.queue_seconds:
            wanted = int(self.rate * self.queue_seconds)
            self.bytes = min(self.max_bytes, max(MIN_WINDOW_BYTES, wanted))

    def refill_wait_seconds(self) -> float:
        """How long the I/O thread may sleep while the window holds a message back.

        A send's ticket (:class:`~kvstore.zerocopy.SendTicket`) has no file descriptor to wait
        on, so the thread has to look again by itself whether the connections took enough.
        Looking every millisecond costs a turn of the thread's loop each time (on a 1 Gbit/s
        link, eight turns for each 1 MiB message the connections take). A quarter of the
        window's drain time at the measured rate (:data:`REFILL_FRACTION`) still hands over the
        next message while at least three quarters of a window are queued, so the connections
        never run dry waiting for it.
        """
        if not self.rate:
            return MIN_REFILL_WAIT_S
        wait = REFILL_FRACTION * self.bytes / self.rate
        return min(MAX_REFILL_WAIT_S, max(MIN_REFILL_WAIT_S, wait))
