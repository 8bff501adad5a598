"""The identity codec ``"none"``: values travel uncompressed, in their own dtype.

Payload: one frame holding the chunk's ``numel`` elements, native (little-endian) byte order.
The server sums in :func:`~kvstore.codecs.base.accumulator_dtype` (fp16 values are summed in fp32,
int32 in int64).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.codecs.base import (
    Aggregator,
    Codec,
    Encoder,
    Payloads,
    PushQuality,
    frame_array,
    squared_norm,
)
from kvstore.codecs.xp import array_module, device_to_host, pinned_empty


class _HostIdentityEncoder(Encoder):
    """Copies the values into an owned buffer, so the caller's memory is free on return."""

    def __init__(self, numel: int, dtype: str, pinned: bool = False) -> None:
        super().__init__(numel, dtype)
        self._buffer = pinned_empty(numel, dtype) if pinned else np.empty(numel, dtype=dtype)

    def encode(self, values: Any) -> list[Any]:
        if isinstance(values, np.ndarray):
            np.copyto(self._buffer, values, casting="no")
        else:  # a CuPy array: device-to-host copy into pinned memory
            device_to_host(values, self._buffer)
        return [self._buffer]

    def borrow(self, values: Any) -> list[Any] | None:
        # The payload of a dense push is the values themselves: host memory is sent as it is.
        return [values] if isinstance(values, np.ndarray) else None

    def quality(self, values: Any) -> PushQuality:
        # Everything is sent exactly: no residual, and the nonzero values are the density.
        nonzero = int(array_module(values).count_nonzero(values))
        return PushQuality(squared_norm(values), 0.0, nonzero)


class _IdentityAggregator(Aggregator):
    """Sums dense pushes; the first push of a round is held (a view of its frame) and summed
    with the second in one pass, instead of being copied first and then added to."""

    def __init__(self, numel: int, dtype: str) -> None:
        super().__init__(numel, dtype)
        self._held: np.ndarray | None = None

    def add(self, payloads: Payloads, first: bool) -> None:
        values = frame_array(payloads[0], np.dtype(self.dtype), self.numel)
        if first:
            self._held = values
        elif self._held is not None:
            # dtype: sum in the accumulator dtype (fp16 pushes are added in fp32)
            np.add(self._held, values, out=self.result, dtype=self.result.dtype)
            self._held = None
        else:
            np.add(self.result, values, out=self.result)

    def finish(self) -> None:
        if self._held is not None:  # a round of one push: the sum is that push
            np.copyto(self.result, self._held)
            self._held = None
        return None


class IdentityCodec(Codec):
    """No compression: the dense value is sent as is."""

    name = "none"
    dtypes = frozenset({"float16", "float32", "float64", "int32", "int64"})

    def payload_nbytes(self, numel: int, dtype: str) -> tuple[int, ...]:
        return (numel * np.dtype(dtype).itemsize,)

    def make_encoder(self, numel: int, dtype: str, device: Any = None) -> Encoder:
        self.check_dtype(dtype)
        return _HostIdentityEncoder(numel, dtype, pinned=device is not None)

    def make_aggregator(self, numel: int, dtype: str) -> Aggregator:
        self.check_dtype(dtype)
        return _IdentityAggregator(numel, dtype)
