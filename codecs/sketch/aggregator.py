"""The server side of the ``sketch`` codec: sum the sketches, recover the round's k-sparse update.

One aggregator per chunk; see :mod:`kvstore.codecs.sketch` for the arithmetic. Without
``exact`` it keeps FetchSGD's momentum and error sketches between rounds (its
:attr:`~SketchAggregator.state_names`, which checkpoints save); with ``exact`` it keeps nothing
between steps but the step's candidates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.codecs.base import Aggregator, Payloads, frame_array, frame_nbytes
from kvstore.codecs.finite import count_nonfinite
from kvstore.codecs.sketch import kernels
from kvstore.codecs.sparse import INDEX_DTYPE, zero_fill
from kvstore.codecs.sparse.topk import top_k_reference
from kvstore.errors import CodecError

if TYPE_CHECKING:
    from kvstore.codecs.sketch import ChunkPlan, SketchCodec


class SketchAggregator(Aggregator):
    """A chunk's rounds of sketches (or of dense values, for a chunk sent dense).

    Attributes:
        plan: the chunk's sizes.
        step_size: ``eta``, the server SGD's ``learning_rate * rescale_grad`` that the error
            accumulation is scaled by (1 without an optimizer); the server sets it before
            every :meth:`finish` (:attr:`kvstore.codecs.base.Codec.applies_step_size`).
        momentum, error: FetchSGD's ``S_u`` and ``S_e`` (float32 ``(rows, columns)``, or the
            chunk's length when it is sent dense); absent with ``exact``.
    """

    def __init__(self, codec: SketchCodec, plan: ChunkPlan, keys: np.ndarray) -> None:
        super().__init__(plan.numel, "float32")
        self.plan = plan
        self.step_size = 1.0
        self._keys = keys
        self._rho = codec.momentum
        self._exact = codec.exact
        self._shape = (plan.numel,) if plan.dense else (plan.rows, plan.columns)
        self._sum = np.zeros(self._shape, dtype=np.float32)
        self._candidates: np.ndarray | None = None  # the exact round's, between its two trips
        self._picked = np.zeros(0, dtype=np.float32)
        self._taken = np.zeros(0, dtype=INDEX_DTYPE)
        self._relay: list[Any] | None = None
        self._estimated: np.ndarray | None = None  # the estimates' buffer, reused every round
        if not codec.exact:
            self.state_names = ("error", "momentum")
            self.momentum = np.zeros(self._shape, dtype=np.float32)
            self.error = np.zeros(self._shape, dtype=np.float32)

    # a round ------------------------------------------------------------------------------------

    def add(self, payloads: Payloads, first: bool) -> None:
        second = self._candidates is not None
        expected = self._candidates.size if self._candidates is not None else self.plan.pushed
        what = "exact values of the candidates" if second else "sketch"
        where = f"codec 'sketch': a push of a {self.numel}-element chunk"
        if len(payloads) != 1:
            raise CodecError(f"{where} ({what}) needs 1 payload frame, got {len(payloads)}")
        nbytes = frame_nbytes(payloads[0])
        if nbytes != 4 * expected:
            raise CodecError(
                f"{where} ({what}) needs {4 * expected} bytes ({expected} float32), got {nbytes}"
                f" (do the workers agree on the codec and the key's size?)"
            )
        values = frame_array(payloads[0], np.float32)
        bad = count_nonfinite(values)
        if bad:
            raise CodecError(f"{where} ({what}) holds {bad} NaN or infinite values")
        if second:
            if first:
                self._picked = values.copy()
            else:
                self._picked += values
            return
        values = values.reshape(self._shape)
        if first:
            np.copyto(self._sum, values)
        else:
            self._sum += values

    def finish(self) -> list[Any] | None:
        if self._exact:
            return self._finish_exact()
        rho, eta = self._rho, np.float32(self.step_size)
        self.momentum *= rho
        self.momentum += self._sum
        scaled = np.multiply(self.momentum, eta, out=self._sum)  # (the sum is spent)
        self.error += scaled
        est = self.error if self.plan.dense else self._estimates(self.error)
        taken = top_k_reference(np.abs(est), self.plan.k)
        self._publish(taken, est[taken])
        if self.plan.dense:
            self.error[taken] = 0
            self.momentum[taken] = 0
        else:
            kernels.zero_buckets(self.error, self._keys, self.plan.start, taken)
            kernels.zero_buckets(self.momentum, self._keys, self.plan.start, taken)
        return None

    def _finish_exact(self) -> list[Any] | None:
        if self._candidates is None:  # the first trip: ask for the candidates' values
            est = self._sum if self.plan.dense else self._estimates(self._sum)
            candidates = top_k_reference(np.abs(est), self.plan.candidates)
            self._candidates = candidates.astype(INDEX_DTYPE)
            return [self._candidates]
        candidates, self._candidates = self._candidates, None
        chosen = top_k_reference(np.abs(self._picked), self.plan.k)
        self._publish(candidates[chosen].astype(np.int64), self._picked[chosen])
        return None

    def abandon(self) -> None:
        """A failed round (with ``exact``, maybe between its two trips) starts over: the next
        push is a first trip's sketch again."""
        self._candidates = None

    def reply_frames(self) -> list[Any] | None:
        """With ``exact``: the indices of the update, where the workers zero ``u`` and ``v``."""
        return [self._taken] if self._exact else None

    def relay_frames(self) -> list[Any] | None:
        """The round's update as one sparse push (``(indices, values)``), which a relayed pull
        sends instead of the dense value."""
        return self._relay

    # helpers --------------------------------------------------------------------------------------

    def _estimates(self, table: np.ndarray) -> np.ndarray:
        if self._estimated is None:
            self._estimated = np.empty(self.numel, dtype=np.float32)
        return kernels.estimates(table, self._keys, self.plan.start, self.numel, self._estimated)

    def _publish(self, taken: np.ndarray, values: np.ndarray) -> None:
        """Make ``result`` the k-sparse update (every element written, as the server needs)."""
        zero_fill(self.result)
        self.result[taken] = values
        # fresh arrays: a relay of this round may still be sent while the next one runs
        self._taken = taken.astype(INDEX_DTYPE)
        self._relay = [self._taken, np.array(values, dtype=np.float32)]
