"""The data-lane window (fixed, or a time's worth of the measured send rate) and the kernel's
unsent-bytes limit on connections that leave the host."""

from __future__ import annotations

import os
import socket

import pytest

from kvstore.worker.connections import _crosses_a_link, _limit_unsent
from kvstore.worker.send_window import (
    MAX_REFILL_WAIT_S,
    MIN_REFILL_WAIT_S,
    MIN_WINDOW_BYTES,
    REFILL_FRACTION,
    SendWindow,
)

MB = 1_000_000


def test_a_fixed_window_never_changes_but_still_measures_the_rate():
    window = SendWindow(8 * MB)
    window.observe(0, 0.0, True)
    window.observe(100 * MB, 0.05, True)
    assert window.bytes == 8 * MB
    assert window.rate == pytest.approx(2000 * MB)


def test_while_full_the_io_thread_waits_a_quarter_of_the_windows_drain_time():
    window = SendWindow(8 * MB)
    assert window.refill_wait_seconds() == MIN_REFILL_WAIT_S  # no rate yet: look every 1 ms
    window.observe(0, 10.0, False)
    window.observe(int(2.5 * MB), 10.02, True)  # 125 MB/s: 8 MB drain in 64 ms
    # (the times given are made up: this is arithmetic on them, not a measured duration)
    wait = window.refill_wait_seconds()
    assert wait == pytest.approx(REFILL_FRACTION * 8 * MB / (125 * MB))
    assert MIN_REFILL_WAIT_S < wait <= MAX_REFILL_WAIT_S
    fast = SendWindow(8 * MB)
    fast.observe(0, 0.0, True)
    fast.observe(100 * MB, 0.01, True)  # 10 GB/s (loopback): no longer than the floor of 1 ms
    assert fast.refill_wait_seconds() == MIN_REFILL_WAIT_S
    slow = SendWindow(8 * MB)
    slow.observe(0, 0.0, True)
    slow.observe(100_000, 0.1, True)  # 1 MB/s: capped, a recovered link is not left waiting
    assert slow.refill_wait_seconds() == MAX_REFILL_WAIT_S


def test_the_window_is_queue_seconds_of_the_rate_measured_while_full():
    window = SendWindow(8 * MB, queue_seconds=0.03)
    assert window.bytes == 8 * MB  # nothing measured yet
    window.observe(0, 10.0, False)
    window.observe(int(2.5 * MB), 10.02, True)  # 125 MB/s, a 1 Gbit/s link
    assert window.rate == pytest.approx(125 * MB)
    assert window.bytes == pytest.approx(0.03 * 125 * MB, rel=1e-6)


def test_intervals_when_the_window_was_not_full_say_nothing():
    window = SendWindow(8 * MB, queue_seconds=0.03)
    window.observe(0, 0.0, False)
    window.observe(1, 5.0, False)  # the caller submitted little: not the link's rate
    assert (window.bytes, window.rate) == (8 * MB, None)


def test_short_full_intervals_add_up_to_one_sample():
    window = SendWindow(8 * MB, queue_seconds=0.03)
    window.observe(0, 0.0, False)
    window.observe(500_000, 0.004, True)
    assert window.rate is None  # 4 ms is too short a sample
    window.observe(500_000, 0.008, True)
    window.observe(0, 0.009, False)  # an interval with room in the window does not count
    window.observe(250_000, 0.011, True)
    assert window.rate == pytest.approx(1_250_000 / 0.010)


def test_samples_are_averaged_and_the_window_clamped():
    window = SendWindow(8 * MB, queue_seconds=0.03)
    window.observe(0, 0.0, False)
    window.observe(10 * MB, 0.01, True)  # 1 GB/s: 30 MB wanted, clamped to the maximum
    assert window.bytes == 8 * MB
    window.observe(0, 0.02, True)  # a stalled interval halves the rate, not zeroes it
    assert window.rate == pytest.approx(500 * MB)
    for t in range(3, 40):
        window.observe(1000, t / 100, True)  # ~100 kB/s: the window stops at the minimum
    assert window.bytes == MIN_WINDOW_BYTES


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        SendWindow(0)
    with pytest.raises(ValueError, match="queue_seconds"):
        SendWindow(1, queue_seconds=-1)


def test_only_connections_that_leave_the_host_get_the_kernel_limit():
    assert _crosses_a_link("10.0.0.2", "10.0.0.1")
    assert _crosses_a_link("fd00::2", "fd00::1")
    assert not _crosses_a_link("10.0.0.1", "10.0.0.1")  # a server on the worker's own address
    assert not _crosses_a_link("127.0.0.1", "127.0.0.1")
    assert not _crosses_a_link("::1", "::1")


def test_the_kernel_limit_leaves_loopback_and_foreign_descriptors_alone():
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as client:
            before = client.getsockopt(socket.IPPROTO_TCP, option) if option else None
            _limit_unsent(client.fileno())
            if option:
                assert client.getsockopt(socket.IPPROTO_TCP, option) == before
            client.sendall(b"still open")  # borrowed, not closed
    read_end, write_end = os.pipe()
    try:
        _limit_unsent(read_end)  # not a socket: nothing happens, nothing raised
        os.fstat(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)
