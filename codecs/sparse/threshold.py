"""The ``threshold`` codec: send every element whose error-feedback residual reached a threshold.

Per push, with float32 residual ``r`` (one per key per worker, zero at start) and threshold
``t > 0`` (used as float32)::

    r += g
    S  = every i with abs(r[i]) >= t          (ascending)
    send (S, r[S]);  r[S] = 0

How many elements a push sends depends on the data: none, or all of them. The payload,
validation, server scatter-add and relay are the family's (:mod:`kvstore.codecs.sparse`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.codecs.base import positive_float32
from kvstore.codecs.sparse import THRESHOLD, Selection, SparseCodec
from kvstore.errors import CodecError


def encode_reference(
    residual: np.ndarray, grad: np.ndarray, threshold: float
) -> tuple[np.ndarray, np.ndarray]:
    """The numpy reference: update ``residual`` in place; return (ascending int64 indices,
    float32 values) of the elements sent."""
    t = np.float32(threshold)
    residual += grad
    indices = np.flatnonzero(np.abs(residual) >= t)
    values = residual[indices]
    residual[indices] = 0
    return indices, values


class ThresholdCodec(SparseCodec):
    """Send ``(i, r[i])`` for every residual entry with ``abs(r[i]) >= threshold``.

    Args:
        threshold: required, finite and > 0 (used as float32); absolute, so it must match the
            gradients' scale.
    """

    name = "threshold"
    param_defaults = {"threshold": None}
    example_params = ({"threshold": 1.5},)

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        if self._params["threshold"] is None:
            raise CodecError("codec 'threshold' needs a threshold (a finite number > 0)")
        self.threshold = positive_float32(self.name, "threshold", self._params["threshold"])
        self._params["threshold"] = self.threshold

    def selection(self, numel: int, step: int, key_hash: int) -> Selection:
        return Selection(THRESHOLD, threshold=self.threshold)

    def reference(self, state, grad, selection):
        return encode_reference(state["residual"], grad, selection.threshold)
