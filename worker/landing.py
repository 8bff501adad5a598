"""The landing of pulled values: each chunk's reply put into the caller's ``out``.

A reply carries the chunk's dense value, or (:mod:`kvstore.worker.relayed_pulls`) the round's
pushes to decode and sum, or (:mod:`kvstore.worker.compressed_pulls`) a change to the ``w_pub``
this worker holds. For host memory the copy runs on the transport's I/O thread as each reply
comes in, so the caller wakes once per key instead of once per chunk; GPU targets are filled by
the caller (:meth:`kvstore.worker.pulls.Pulls.receive`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.codecs.base import frame_array
from kvstore.errors import ProtocolError
from kvstore.topology import Chunk
from kvstore.wire import Message, buffer_nbytes
from kvstore.worker import values as vals
from kvstore.worker.compressed_pulls import land_compressed
from kvstore.worker.keys import KeyState
from kvstore.worker.relayed_pulls import land_relayed
from kvstore.worker.request import Request
from kvstore.worker.stats import TrafficStats


class Landing:
    """Puts a key's pulled chunks into ``out`` as their replies arrive.

    Attributes:
        state: the key.
        target: ``out``, as a flat array.
        on_io_thread: the replies land on the I/O thread (host ``out``); else the caller
            writes each chunk (:meth:`write`).
        all_arrived: set once every chunk's reply landed or failed (I/O thread landing).
        errors: what went wrong while landing on the I/O thread.
    """

    def __init__(self, state: KeyState, out: Any, stats: TrafficStats) -> None:
        self.state = state
        self.target = vals.FlatTarget(out)
        self.dtype = np.dtype(state.dtype)
        self.itemsize = self.dtype.itemsize
        self.on_io_thread = not self.target.on_gpu
        self.stats = stats
        self._remaining = len(state.own_chunks)
        self._lock = threading.Lock()
        self.all_arrived = threading.Event()
        if not self._remaining:  # (a worker of a host whose share has none of the key's chunks)
            self.all_arrived.set()
        self.errors: list[BaseException] = []

    def callback(self, chunk: Chunk) -> Callable[[Request], None] | None:
        """The completion callback of ``chunk``'s request (None when the caller copies)."""
        if not self.on_io_thread:
            return None

        def land(request: Request) -> None:
            try:
                if request._error is not None:
                    raise request._error
                assert request._reply is not None
                self.write(chunk, request._reply)
                request.release_payloads()
            except BaseException as exc:
                self.errors.append(exc)
            with self._lock:
                self._remaining -= 1
                if self._remaining == 0:
                    self.all_arrived.set()

        return land

    def write(self, chunk: Chunk, reply: Message) -> None:
        """Check one reply's size and put its values into ``out``.

        A dense reply is copied; a relayed one (``rl`` pushes) is decoded and summed into place;
        a compressed one is applied to the chunk's ``w_pub``, which is copied.
        """
        relayed = reply.body.relayed
        if reply.body.pull_kind is not None:
            nbytes = land_compressed(self.state, chunk, reply, self.target)
        elif relayed:
            nbytes = land_relayed(self.state, chunk, reply.payloads, relayed, self.target)
        else:
            nbytes = chunk.numel * self.itemsize
            if len(reply.payloads) != 1 or buffer_nbytes(reply.payloads[0]) != nbytes:
                raise ProtocolError(
                    f"reply for key {self.state.key!r} chunk {chunk.index} has the wrong size"
                )
            values = frame_array(reply.payloads[0], self.dtype)
            self.target.write(chunk.start, chunk.stop, values)
        self.stats.pulled_bytes += nbytes
        self.stats.pull_messages += 1
