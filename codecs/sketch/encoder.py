"""The worker side of the ``sketch`` codec: one encoder per chunk (:mod:`kvstore.codecs.sketch`).

Without ``exact`` the encoder keeps nothing between pushes: it sketches the gradient into its
output table. With ``exact`` it keeps the momentum ``u`` and error ``v`` of Sketched-SGD,
sketches ``v``, answers the server's candidates with ``v``'s exact values and zeroes ``u`` and
``v`` where the round's update was taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.codecs.base import (
    Encoder,
    Payloads,
    PushQuality,
    frame_array,
    frame_nbytes,
    squared_norm,
)
from kvstore.codecs.sketch import kernels
from kvstore.codecs.sparse import INDEX_DTYPE, check_indices
from kvstore.codecs.xp import array_module, device_to_host, is_cupy_array, pinned_empty
from kvstore.errors import CodecError

if TYPE_CHECKING:
    from kvstore.codecs.sketch import ChunkPlan, SketchCodec


def _host_buffer(numel: int, device: Any) -> np.ndarray:
    return pinned_empty(numel, np.float32) if device is not None else np.empty(numel, np.float32)


class SketchEncoder(Encoder):
    """Encodes one chunk: its sketch (or its values, for a chunk sent dense).

    Attributes:
        plan: the chunk's sizes.
        momentum, error: with ``exact``, Sketched-SGD's ``u`` and ``v`` (float32, the chunk's
            length, on the values' device); absent otherwise.
    """

    def __init__(self, codec: SketchCodec, plan: ChunkPlan, keys: np.ndarray, device: Any) -> None:
        super().__init__(plan.numel, "float32")
        self.plan = plan
        self._keys = keys
        self._rho = codec.momentum
        self._exact = codec.exact
        self._device = device
        self._out = _host_buffer(plan.pushed, device)
        # the numba sketch's int64 accumulator, kept so that a push allocates nothing
        self._scratch = None if plan.dense else np.empty((plan.rows, plan.columns), np.int64)
        self._picked = np.empty(0, np.float32)
        # (a chunk sent dense takes the second trip too: only its end acknowledges the
        # update, where u and v are zeroed)
        self.round_trips = codec.round_trips
        if codec.exact:
            self.state_names = ("error", "momentum")
            xp = np if device is None else _cupy()
            self.momentum = xp.zeros(plan.numel, dtype=np.float32)
            self.error = xp.zeros(plan.numel, dtype=np.float32)

    def encode(self, values: Any) -> list[Any]:
        pushed = values
        if self._exact:
            self.momentum *= self._rho
            self.momentum += values
            self.error += self.momentum
            pushed = self.error
        if self.plan.dense:
            if is_cupy_array(pushed):
                device_to_host(pushed, self._out)
            else:
                np.copyto(self._out, pushed)
        else:
            table = self._out.reshape(self.plan.rows, self.plan.columns)
            kernels.sketch_into(pushed, self._keys, self.plan.start, table, self._scratch)
        return [self._out]

    def next_round(self, reply: Payloads) -> list[Any]:
        """The exact values of ``v`` at the server's candidates."""
        if self.round_trips < 2:
            raise CodecError("a sketch push without exact values takes one round trip")
        candidates = self._indices(reply, self.plan.candidates, "candidates")
        picked = self.error[candidates]
        self._picked = picked.get() if is_cupy_array(picked) else np.ascontiguousarray(picked)
        return [self._picked]

    def end_step(self, reply: Payloads) -> None:
        """With ``exact``: zero ``u`` and ``v`` where the round took its update."""
        if not self._exact:
            return
        taken = self._indices(reply, self.plan.k, "update's indices")
        if is_cupy_array(self.error):
            taken_on_device = array_module(self.error).asarray(taken)
            self.error[taken_on_device] = 0
            self.momentum[taken_on_device] = 0
        else:
            self.error[taken] = 0
            self.momentum[taken] = 0

    def _indices(self, reply: Payloads, most: int, what: str) -> np.ndarray:
        where = f"codec 'sketch': the server's {what} for a {self.numel}-element chunk"
        if len(reply) != 1:
            raise CodecError(f"{where} come in 1 frame, got {len(reply)}")
        nbytes = frame_nbytes(reply[0])
        if nbytes % INDEX_DTYPE.itemsize:
            raise CodecError(f"{where} are {nbytes} bytes, not whole uint32 indices")
        indices = frame_array(reply[0], INDEX_DTYPE)
        if indices.size > most:
            raise CodecError(f"{where} are {indices.size}, more than the {most} expected")
        check_indices(indices, self.numel, where, None)
        return indices.astype(np.int64)

    def quality(self, values: Any) -> PushQuality | None:
        if self._exact:
            return PushQuality(squared_norm(values), squared_norm(self.error), 0)
        return PushQuality(squared_norm(values), 0.0, 0)


def _cupy() -> Any:
    import cupy  # noqa: PLC0415  (GPU values only)

    return cupy
