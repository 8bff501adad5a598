"""Zero-copy sends that cost no Python work when ZeroMQ is done with the memory.

pyzmq sends a buffer without copying by giving libzmq a free function that, once libzmq no
longer reads the memory, posts the buffer's id to pyzmq's garbage-collector thread; that thread
takes the GIL, drops the reference and sets the message tracker's event. Each zero-copy send
therefore costs, besides the send itself, a ``threading.Event`` and a tracker when tracked, a
locked dictionary insert, and a wake-up of the collector thread that competes for the GIL with
the threads doing the real work. Profiled with ``py-spy`` on loopback (2 workers, one
10M-element key in 256 KiB chunks), the collector thread alone was about a quarter of a
worker's Python samples and a sixth of the server's.

:class:`ZeroCopySender` keeps the zero-copy send and replaces the rest: the free function is a
compiled C callback (numba ``cfunc``) that only marks the message's *slot*, an ``int64`` in a
process-lifetime array, as released. The sending thread holds the buffer in that slot until it
sees the mark, and a :class:`SendTicket` says whether all of a message's buffers were released,
which is what pyzmq's ``MessageTracker.done`` says. No thread wakes up and nothing takes the GIL
when a send finishes.

The sender calls libzmq through ``ctypes`` (``zmq_msg_init_data`` and ``zmq_msg_send``) on the
socket's own handle, in the same library pyzmq loaded. Where that library or numba is not
available, the sender falls back to pyzmq's own zero-copy sends (same results, more CPU). The
free function is compiled after numba's one start-up (:mod:`kvstore.codecs.numba_started`), when
the sender is made.

Frames below :data:`COPY_THRESHOLD` bytes, ``bytes`` headers for example, are copied by pyzmq as
usual (copying them costs less than tracking them), and ``zmq.Frame`` objects (received
payloads relayed on) are sent by reference through pyzmq, which involves no collector either.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

logger = logging.getLogger(__name__)

COPY_THRESHOLD = zmq.COPY_THRESHOLD
"""Frames smaller than this many bytes are copied (pyzmq's own threshold, 64 KiB)."""

SLAB_SLOTS = 1024
"""Slots per slab; a sender takes another slab when all of its slots hold messages in flight."""

REAP_AFTER = 32
"""A send first lets go of released buffers once this many are held (tickets do not need it:
they read the slots; it only bounds the memory that released buffers keep alive)."""

_SNDMORE = int(zmq.SNDMORE)

_FREE = 0
_IN_FLIGHT = 1
_RELEASED = 2  # written by the free function, on a libzmq I/O thread


class _Native:
    """libzmq's message functions and the compiled free function; None when unavailable."""

    def __init__(self, lib: ctypes.CDLL, free_fn_address: int) -> None:
        self.msg_init_data = lib.zmq_msg_init_data
        self.msg_init_data.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self.msg_init_data.restype = ctypes.c_int
        self.msg_send = lib.zmq_msg_send
        self.msg_send.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self.msg_send.restype = ctypes.c_int
        self.msg_close = lib.zmq_msg_close
        self.msg_close.argtypes = [ctypes.c_void_p]
        self.msg_close.restype = ctypes.c_int
        self.errno = lib.zmq_errno
        self.errno.restype = ctypes.c_int
        self.free_fn = free_fn_address


def _libzmq_candidates() -> list[str]:
    """Paths of the libzmq pyzmq uses: a loaded ``libzmq`` library, else pyzmq's extension
    itself (a build with libzmq linked in statically)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "libzmq" in path.rsplit("/", 1)[-1] and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    extension = getattr(getattr(zmq.backend, "cython", None), "_zmq", None)
    if extension is not None and getattr(extension, "__file__", None):
        paths.append(extension.__file__)
    return paths


def _load_native() -> _Native | None:
    if not hasattr(zmq.Socket, "underlying"):
        return None
    lib = None
    wanted = zmq.zmq_version_info()
    for path in _libzmq_candidates():
        try:
            candidate = ctypes.CDLL(path)
            version = [ctypes.c_int(), ctypes.c_int(), ctypes.c_int()]
            candidate.zmq_version(*(ctypes.byref(v) for v in version))
            for name in ("zmq_msg_init_data", "zmq_msg_send", "zmq_msg_close", "zmq_errno"):
                getattr(candidate, name)  # AttributeError when not exported
        except (OSError, AttributeError):
            continue
        if tuple(v.value for v in version) == tuple(wanted):
            lib = candidate
            break
    if lib is None:
        return None
    try:
        import numba  # noqa: PLC0415  (compiled on first use, cached on disk)

        import kvstore.codecs.numba_started  # noqa: F401, PLC0415  (before any compile)

        @numba.cfunc("void(voidptr, voidptr)", cache=True)  # a cfunc is always nopython
        def release(data, hint):  # pragma: no cover  (runs on a libzmq I/O thread)
            slot = numba.carray(hint, 1, numba.int64)
            slot[0] = _RELEASED

        address = release.address
    except Exception as exc:  # numba missing or unable to compile: pyzmq's path still works
        logger.debug("zero-copy free function unavailable: %r", exc)
        return None
    if address is None:  # (numba gives no address only for a cfunc it failed to compile)
        return None
    return _Native(lib, address)


_native_lock = threading.Lock()
_native: _Native | None = None
_native_loaded = False


def native_sends_available() -> bool:
    """Whether sends bypass pyzmq's collector on this system (loads the library once)."""
    return _get_native() is not None


def _get_native() -> _Native | None:
    global _native, _native_loaded
    if not _native_loaded:
        with _native_lock:
            if not _native_loaded:
                _native = _load_native()
                _native_loaded = True
                logger.debug("native zero-copy sends: %s", _native is not None)
    return _native


class _Slab:
    """Slots of messages in flight: their state (written by the free function) and the buffers
    they read. Slabs live as long as the process: libzmq may release a message after the socket,
    even the sender, is gone, and its free function then writes the slab."""

    def __init__(self, size: int) -> None:
        self.state = np.zeros(size, np.int64)
        self.base = self.state.ctypes.data
        self.held: list[Any] = [None] * size
        self.generation = [0] * size


_slabs_lock = threading.Lock()
_all_slabs: list[_Slab] = []  # never shrinks: a sender dropped without close() keeps its slabs
_idle_slabs: list[_Slab] = []  # slabs of closed senders with nothing in flight
_orphaned_slabs: list[_Slab] = []  # slabs of closed senders that libzmq may still release


def _take_slab() -> _Slab:
    with _slabs_lock:
        for slab in list(_orphaned_slabs):
            if not np.any(slab.state == _IN_FLIGHT):  # libzmq released the rest since
                _release(slab)
                _orphaned_slabs.remove(slab)
                _idle_slabs.append(slab)
        if _idle_slabs:
            return _idle_slabs.pop()
        slab = _Slab(SLAB_SLOTS)
        _all_slabs.append(slab)
        return slab


def _release(slab: _Slab) -> list[int]:
    """Free the slots of ``slab`` that libzmq released, dropping their buffers; returns them.

    A freed slot starts a new generation, so tickets of its old message read as done."""
    released = np.flatnonzero(slab.state == _RELEASED)
    if not len(released):
        return []
    slab.state[released] = _FREE  # the free function writes only slots in flight
    slots = released.tolist()
    for slot in slots:
        slab.held[slot] = None
        slab.generation[slot] += 1
    return slots


class SendTicket:
    """Says when libzmq no longer reads any buffer of one message (``done``)."""

    __slots__ = ("_parts",)

    def __init__(self, parts: list[tuple[_Slab, int, int]]) -> None:
        self._parts = parts  # (slab, slot, generation) per zero-copy buffer

    @property
    def done(self) -> bool:
        for slab, slot, generation in self._parts:
            # A reused slot (new generation) was released before it was reused.
            if slab.generation[slot] == generation and slab.state[slot] != _RELEASED:
                return False
        return True


_DONE = SendTicket([])


class ZeroCopySender:
    """Sends multipart messages on ZeroMQ sockets, large buffers without copying.

    One sender per sending thread (it is not thread-safe); the caller keeps each buffer
    unchanged until the ticket says done, as with pyzmq's zero-copy sends. The sender keeps the
    buffer alive until then itself.

    Args:
        native: use the compiled free function (default: when available); False always uses
            pyzmq's zero-copy path.
    """

    def __init__(self, native: bool | None = None) -> None:
        # Loaded here, before the thread that sends exists, not at the first large buffer:
        # loading it starts numba (a few hundred ms of CPU, seconds on a loaded machine), and
        # a server's event loop or a worker's I/O thread that stalled that long at its first
        # large send missed heartbeats (a 1.5 s heartbeat timeout tripped under load).
        self._native = _get_native() if native is not False else None
        if native and self._native is None:
            raise RuntimeError("native zero-copy sends are not available on this system")
        self._slabs: list[_Slab] = []
        self._free: list[tuple[_Slab, int]] = []
        self._in_flight = 0
        # One message struct, reused: zmq_msg_send takes the content and leaves it empty.
        self._msg = (ctypes.c_uint64 * 8)()  # zmq_msg_t: 64 bytes, 8-byte aligned
        self._msg_address = ctypes.addressof(self._msg)

    @property
    def native(self) -> bool:
        """Whether sends use the compiled free function (else pyzmq's collector)."""
        return self._native is not None

    @property
    def in_flight(self) -> int:
        """Buffers the sender holds: sent, and not yet seen released by :meth:`reap`."""
        return self._in_flight

    def send_multipart(
        self, sock: zmq.Socket, frames: Sequence[Any], flags: int = 0, track: bool = False
    ) -> SendTicket | _TrackedTicket | None:
        """Send ``frames`` as one message; returns a ticket (``.done``) when ``track``.

        Raises ``zmq.ZMQError`` like ``sock.send_multipart`` (a frame that could not be sent is
        released at once).
        """
        native = self._native
        if native is None:
            return _send_with_pyzmq(sock, frames, flags, track)
        if self._in_flight >= REAP_AFTER:
            self.reap()
        parts: list[tuple[_Slab, int, int]] = []
        last = len(frames) - 1
        flags = int(flags)  # ORing pyzmq's enum flags costs a Python-level call per frame
        for i, frame in enumerate(frames):
            frame_flags = flags | _SNDMORE if i < last else flags
            array = _large_array(frame)
            if array is None:
                sock.send(frame, frame_flags, copy=False)
                continue
            parts.append(self._send_array(sock, array, frame, frame_flags))
        if not track:
            return None
        return SendTicket(parts) if parts else _DONE

    def _send_array(
        self, sock: zmq.Socket, array: np.ndarray, owner: Any, flags: int
    ) -> tuple[_Slab, int, int]:
        native = self._native
        assert native is not None
        if not self._free:
            self._grow()
        slab, slot = self._free.pop()
        slab.state[slot] = _IN_FLIGHT
        slab.held[slot] = owner
        self._in_flight += 1
        msg = self._msg_address
        address = array.__array_interface__["data"][0]
        if native.msg_init_data(msg, address, array.nbytes, native.free_fn, slab.base + 8 * slot):
            slab.state[slot] = _RELEASED
            raise zmq.ZMQError(native.errno())
        handle = sock.underlying
        while native.msg_send(msg, handle, flags) < 0:
            error = native.errno()
            if error == errno.EINTR:
                continue  # a signal interrupted a blocking send: the message is still ours
            native.msg_close(msg)  # not sent: closing it releases the slot
            raise zmq.Again(error) if error == errno.EAGAIN else zmq.ZMQError(error)
        return slab, slot, slab.generation[slot]

    def _grow(self) -> None:
        self.reap()
        if self._free:
            return
        slab = _take_slab()
        self._slabs.append(slab)
        self._free.extend((slab, slot) for slot in range(len(slab.state) - 1, -1, -1))

    def reap(self) -> None:
        """Let go of the buffers libzmq released, freeing their slots."""
        for slab in self._slabs:
            slots = _release(slab)
            self._free.extend((slab, slot) for slot in slots)
            self._in_flight -= len(slots)

    def close(self) -> None:
        """Give the slabs back for other senders (call after closing the sockets; after the
        context was terminated libzmq has released every message). A slab with a message
        still in flight keeps its buffers until libzmq released them all: it is reused only
        then."""
        self.reap()
        with _slabs_lock:
            for slab in self._slabs:
                if np.any(slab.state == _IN_FLIGHT):
                    _orphaned_slabs.append(slab)
                else:
                    _idle_slabs.append(slab)
        self._slabs, self._free, self._in_flight = [], [], 0


class _TrackedTicket:
    """A ticket over pyzmq's message trackers (the fallback path)."""

    __slots__ = ("_trackers",)

    def __init__(self, trackers: list[Any]) -> None:
        self._trackers = trackers

    @property
    def done(self) -> bool:
        return all(tracker.done for tracker in self._trackers)


def _send_with_pyzmq(
    sock: zmq.Socket, frames: Sequence[Any], flags: int, track: bool
) -> _TrackedTicket | None:
    """pyzmq's zero-copy sends; a received ``zmq.Frame`` goes by reference and needs no tracker
    (pyzmq refuses to track one that was not created tracked)."""
    trackers = []
    last = len(frames) - 1
    flags = int(flags)
    for i, frame in enumerate(frames):
        frame_flags = flags | _SNDMORE if i < last else flags
        tracked = track and not isinstance(frame, zmq.Frame)
        tracker = sock.send(frame, frame_flags, copy=False, track=tracked)
        if tracked:
            trackers.append(tracker)
    return _TrackedTicket(trackers) if track else None


def _large_array(frame: Any) -> np.ndarray | None:
    """``frame`` as a contiguous array to send without a copy, or None to let pyzmq send it
    (small frames are copied, ``zmq.Frame`` objects go by reference, anything else pyzmq
    refuses is refused as before)."""
    kind = type(frame)  # exact types first: the common kinds cost no isinstance call
    if kind is bytes:
        return np.frombuffer(frame, np.uint8) if len(frame) >= COPY_THRESHOLD else None
    if kind is np.ndarray or isinstance(frame, np.ndarray):
        if frame.nbytes < COPY_THRESHOLD or not frame.flags.c_contiguous:
            return None
        return frame
    if kind is zmq.Frame or isinstance(frame, (zmq.Frame, str)):
        return None
    try:
        view = memoryview(frame)
    except TypeError:
        return None
    if view.nbytes < COPY_THRESHOLD or not view.c_contiguous:
        return None
    return np.frombuffer(view.cast("B"), np.uint8)


__all__ = ["COPY_THRESHOLD", "SendTicket", "ZeroCopySender", "native_sends_available"]
