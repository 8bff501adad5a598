"""Zero-copy sends: bytes arrive intact, tickets say when libzmq let go, buffers live until then."""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
import zmq

from kvstore import zerocopy
from kvstore.zerocopy import COPY_THRESHOLD, SLAB_SLOTS, ZeroCopySender

MODES = [pytest.param(True, id="native"), pytest.param(False, id="pyzmq")]


def _wait_done(ticket, timeout: float = 60.0) -> None:
    # a hang guard: a send takes milliseconds, even on a loaded machine
    deadline = time.monotonic() + timeout
    while not ticket.done:
        assert time.monotonic() < deadline, "the send never finished"
        time.sleep(0.001)


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def tcp_pipe(context):
    """A PUSH socket connected to a PULL socket over TCP on 127.0.0.1."""
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close(0)
    pull.close(0)


def test_native_sends_are_available_with_the_installed_pyzmq():
    # Without them every zero-copy send wakes pyzmq's collector thread: a silent CPU regression.
    assert zerocopy.native_sends_available()


@pytest.mark.parametrize("native", MODES)
def test_frames_arrive_intact_over_tcp_and_tickets_finish(tcp_pipe, native):
    push, pull = tcp_pipe
    sender = ZeroCopySender(native=native)
    rng = np.random.default_rng(0)
    big = rng.standard_normal(300_000).astype(np.float32)  # 1.2 MB
    small = np.arange(10, dtype=np.int64)
    raw = bytes(rng.integers(0, 256, COPY_THRESHOLD + 7, dtype=np.uint8))
    view = memoryview(bytearray(raw))
    relayed = zmq.Frame(raw)
    tickets = []
    for i in range(50):
        frames = [b"header %d" % i, big, small, raw, view, relayed]
        tickets.append(sender.send_multipart(push, frames, track=True))
        got = pull.recv_multipart()
        assert got[0] == b"header %d" % i
        assert got[1] == big.tobytes()
        assert got[2] == small.tobytes()
        assert got[3] == got[4] == got[5] == raw
    for ticket in tickets:
        _wait_done(ticket)
    sender.reap()
    assert sender.in_flight == 0
    sender.close()


def test_a_buffer_lives_until_libzmq_releases_it(context):
    # inproc hands the receiver the sender's memory itself: the buffer must outlive the send
    # call and the caller's last reference, until the received frame is gone too.
    push = context.socket(zmq.PUSH)
    push.connect("inproc://zerocopy-lifetime")  # no peer yet: the message waits in the pipe
    sender = ZeroCopySender(native=True)
    array = np.arange(COPY_THRESHOLD, dtype=np.float32)
    expected = array.tobytes()
    alive = weakref.ref(array)
    ticket = sender.send_multipart(push, [array], track=True)
    del array
    gc.collect()
    sender.reap()
    assert alive() is not None and not ticket.done and sender.in_flight == 1
    pull = context.socket(zmq.PULL)
    pull.bind("inproc://zerocopy-lifetime")
    frame = pull.recv(copy=False)
    assert frame.bytes == expected
    sender.reap()
    assert alive() is not None and not ticket.done  # the frame still reads that memory
    del frame
    gc.collect()
    _wait_done(ticket)
    sender.reap()
    gc.collect()
    assert alive() is None and sender.in_flight == 0
    push.close(0)
    pull.close(0)
    sender.close()


def test_a_frame_that_cannot_be_sent_raises_and_is_released(context):
    dealer = context.socket(zmq.DEALER)  # no peer: a non-blocking send has nowhere to go
    sender = ZeroCopySender(native=True)
    array = np.ones(COPY_THRESHOLD, np.uint8)
    alive = weakref.ref(array)
    with pytest.raises(zmq.Again):
        sender.send_multipart(dealer, [array], flags=zmq.NOBLOCK, track=True)
    del array
    sender.reap()
    gc.collect()
    assert alive() is None and sender.in_flight == 0
    dealer.close(0)
    sender.close()


def test_slots_are_reused_and_released_buffers_are_not_kept(tcp_pipe):
    push, pull = tcp_pipe
    sender = ZeroCopySender(native=True)
    buffers = [np.full(COPY_THRESHOLD, i, np.uint8) for i in range(4)]
    for i in range(SLAB_SLOTS + 100):
        ticket = sender.send_multipart(push, [buffers[i % 4]], track=True)
        assert pull.recv() == buffers[i % 4].tobytes()
        _wait_done(ticket)
    assert len(sender._slabs) == 1  # finished sends gave their slots back
    assert sender.in_flight <= zerocopy.REAP_AFTER
    sender.close()


def test_small_frames_and_received_frames_use_no_slot(tcp_pipe):
    push, pull = tcp_pipe
    sender = ZeroCopySender(native=True)
    ticket = sender.send_multipart(
        push, [np.zeros(16, np.float32), zmq.Frame(b"x" * (2 * COPY_THRESHOLD))], track=True
    )
    assert ticket.done and sender.in_flight == 0  # copied, or shared by libzmq's refcount
    assert len(pull.recv_multipart()) == 2
    sender.close()


def test_a_closed_senders_slab_is_reused_once_libzmq_released_its_buffers(context):
    push = context.socket(zmq.PUSH)
    push.connect("inproc://zerocopy-orphan")  # no peer yet: the message stays in flight
    sender = ZeroCopySender(native=True)
    array = np.ones(COPY_THRESHOLD, np.uint8)
    alive = weakref.ref(array)
    ticket = sender.send_multipart(push, [array], track=True)
    (slab,) = sender._slabs
    del array
    sender.close()  # in flight: the slab keeps the buffer and is not handed out
    assert slab not in zerocopy._idle_slabs and alive() is not None
    pull = context.socket(zmq.PULL)
    pull.bind("inproc://zerocopy-orphan")
    pull.recv(copy=False)  # received and dropped: libzmq releases the buffer
    gc.collect()
    _wait_done(ticket)
    other = ZeroCopySender(native=True)
    other.send_multipart(push, [np.ones(COPY_THRESHOLD, np.uint8)])
    assert other._slabs == [slab]  # recycled, and the old buffer let go
    gc.collect()
    assert alive() is None
    assert pull.recv() == b"\x01" * COPY_THRESHOLD
    push.close(0)
    pull.close(0)
    other.close()
