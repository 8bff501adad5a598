"""2-bit threshold quantization with residuals, bit-exact with MXNet's ``2bit`` compression.

Semantics, per element, with threshold ``t > 0`` and a float32 residual ``r`` (one per key per
worker, starting at 0; all arithmetic in float32)::

    r += g
    if   r >=  t: code = 0b11; r -= t      # "+t" sent
    elif r <= -t: code = 0b10; r += t      # "-t" sent
    else:         code = 0b00              # nothing sent, r kept

Both comparisons are inclusive, and at most one quantum ``t`` leaves per element per push (a
residual of 1.3 with t = 0.5 sends +0.5 and keeps 0.8). Decoding maps ``11`` to ``+t``, ``10`` to
``-t`` and anything else (``00``; ``01`` is never produced) to 0.

Bit layout: byte ``j`` holds elements ``4j .. 4j+3``, the first in the most significant bit pair::

    byte[j] = c[4j] << 6 | c[4j+1] << 4 | c[4j+2] << 2 | c[4j+3]

The payload is ``ceil(n/16)`` 4-byte words (16 elements each), zero padded, so padding codes are
``00``. Read as a little-endian uint32, element ``k`` of a word sits at bits
``8*(k//4) + 6 - 2*(k%4)``. The element count is not in the payload; it travels in the message
header.

Worked example (t = 0.5, zero residual)::

    g        = [0.6, -0.7, 0.1, 0.5, -0.5, 0 x10, 1.0, 0.9]          (17 elements)
    bytes    = e3 80 00 03 c0 00 00 00
    residual = [0.1, -0.2, 0.1, 0, 0, 0 x10, 0.5, 0.4]

Implementations with one contract (identical bytes and residual bits on any input, tested
against a per-element oracle): :func:`encode_reference` / :func:`decode_reference` (vectorised
numpy), the compiled CPU kernels in ``_twobit_numba`` (the default; ``KVSTORE_CPU_KERNELS=numpy``
selects the reference) and the CuPy kernels in ``_twobit_cuda`` for GPU arrays.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.codecs.base import (
    Aggregator,
    Codec,
    Encoder,
    Payloads,
    PushQuality,
    frame_array,
    positive_float32,
    register_codec,
    squared_norm,
)
from kvstore.codecs.xp import is_cupy_array, pinned_empty
from kvstore.config import cpu_kernels_from_env
from kvstore.errors import CodecError

ELEMS_PER_WORD = 16


def packed_words(numel: int) -> int:
    """Number of 4-byte words that hold ``numel`` 2-bit codes."""
    return -(-numel // ELEMS_PER_WORD)


# numpy reference ---------------------------------------------------------------------------


def encode_reference(
    grad: np.ndarray, residual: np.ndarray, threshold: float, out: np.ndarray
) -> None:
    """Vectorised numpy 2-bit encode (the reference the kernels are checked against).

    Args:
        grad: float32[n].
        residual: float32[n]; updated in place.
        threshold: t > 0 (used as float32).
        out: uint32[ceil(n/16)] (any 4-byte-per-word buffer); fully overwritten.
    """
    t = np.float32(threshold)
    n = grad.shape[0]
    x = residual + grad
    pos = x >= t
    neg = x <= -t
    np.subtract(x, t, out=x, where=pos)
    np.add(x, t, out=x, where=neg)
    residual[...] = x
    codes = np.zeros(packed_words(n) * ELEMS_PER_WORD, dtype=np.uint8)
    codes[:n] = pos.view(np.uint8) * np.uint8(3) | neg.view(np.uint8) * np.uint8(2)
    quads = codes.reshape(-1, 4)
    packed = out.view(np.uint8)
    packed[...] = (quads[:, 0] << 6) | (quads[:, 1] << 4) | (quads[:, 2] << 2) | quads[:, 3]


def decode_reference(
    words: np.ndarray, n: int, threshold: float, out: np.ndarray, accumulate: bool = False
) -> None:
    """Vectorised numpy 2-bit decode into ``out`` (float32[n]); adds when ``accumulate``."""
    t = np.float32(threshold)
    packed = np.asarray(words).view(np.uint8)
    codes = np.empty(packed.shape[0] * 4, dtype=np.uint8)
    for k in range(4):
        codes[k::4] = (packed >> (6 - 2 * k)) & 3
    codes = codes[:n]
    values = np.where(codes == 3, t, np.where(codes == 2, -t, np.float32(0))).astype(np.float32)
    if accumulate:
        out += values
    else:
        out[...] = values


# kernel selection ----------------------------------------------------------------------------

EncodeFn = Callable[[np.ndarray, np.ndarray, Any, np.ndarray], None]
DecodeFn = Callable[[np.ndarray, int, Any, np.ndarray, bool], None]


def cpu_kernels(name: str | None = None) -> tuple[EncodeFn, DecodeFn]:
    """The CPU (encode, decode) pair: ``"numba"`` (compiled) or ``"numpy"`` (reference).

    ``None`` reads ``KVSTORE_CPU_KERNELS``. The compiled kernels write little-endian words, so on
    a big-endian machine the reference is used instead.
    """
    name = cpu_kernels_from_env() if name is None else name
    if name == "numba" and sys.byteorder == "little":
        from kvstore.codecs import _twobit_numba  # noqa: PLC0415  (compiles on first use)

        return _twobit_numba.encode, _twobit_numba.decode
    if name in ("numba", "numpy"):
        return encode_reference, decode_reference
    raise CodecError(f"unknown CPU kernel set {name!r}; expected 'numba' or 'numpy'")


def _check_float32(array: Any, what: str) -> None:
    if array.dtype != np.float32:
        raise CodecError(f"2bit compression needs float32 values, but {what} is {array.dtype}")


def encode(
    grad: Any, residual: Any, threshold: float, out: Any = None, *, kernels: str | None = None
) -> Any:
    """Encode ``grad`` with residual (numpy or CuPy arrays, flattened); return the packed words.

    Args:
        grad: float32 values; any shape, contiguous.
        residual: float32, same size; updated in place.
        threshold: t > 0.
        out: uint32[ceil(n/16)] to write into; allocated when None.
        kernels: CPU kernel set (see :func:`cpu_kernels`).
    """
    t = positive_float32("2bit", "threshold", threshold)
    _check_float32(grad, "grad")
    _check_float32(residual, "residual")
    if grad.size != residual.size:
        raise CodecError(f"grad has {grad.size} elements but residual has {residual.size}")
    g = grad.reshape(-1)
    r = residual.reshape(-1)
    if is_cupy_array(grad):
        import cupy  # noqa: PLC0415

        from kvstore.codecs import _twobit_cuda  # noqa: PLC0415

        if out is None:
            out = cupy.empty(packed_words(g.size), dtype=cupy.uint32)
        _twobit_cuda.encode(g, r, t, out)
        return out
    if out is None:
        out = np.empty(packed_words(g.size), dtype=np.uint32)
    encode_fn, _ = cpu_kernels(kernels)
    encode_fn(g, r, np.float32(t), out)
    return out


def decode(
    words: Any,
    numel: int,
    threshold: float,
    out: Any = None,
    *,
    accumulate: bool = False,
    kernels: str | None = None,
) -> Any:
    """Decode ``numel`` values from packed ``words`` into float32 ``out`` (allocated when None)."""
    t = positive_float32("2bit", "threshold", threshold)
    if words.size < packed_words(numel):
        raise CodecError(f"{words.size} words cannot hold {numel} 2-bit codes")
    if is_cupy_array(words):
        import cupy  # noqa: PLC0415

        from kvstore.codecs import _twobit_cuda  # noqa: PLC0415

        if out is None:
            out = cupy.zeros(numel, dtype=cupy.float32)
        _twobit_cuda.decode(words, numel, t, out.reshape(-1), accumulate)
        return out
    if out is None:
        out = np.zeros(numel, dtype=np.float32)
    _, decode_fn = cpu_kernels(kernels)
    decode_fn(np.asarray(words).view(np.uint32), numel, np.float32(t), out.reshape(-1), accumulate)
    return out


_NONZERO_CODES = np.array(
    [sum((byte >> shift) & 2 != 0 for shift in (0, 2, 4, 6)) for byte in range(256)], np.uint8
)
"""Nonzero 2-bit codes in each byte value: a code is nonzero exactly when its high bit is set
(``11`` and ``10``; ``01`` is never produced, and the padding is ``00``)."""


def count_sent(words: np.ndarray) -> int:
    """How many elements packed ``words`` (host memory) send as +t or -t."""
    return int(_NONZERO_CODES[np.asarray(words).view(np.uint8)].sum(dtype=np.int64))


# codec parts ---------------------------------------------------------------------------------


class _HostTwoBitEncoder(Encoder):
    """CPU encoder: residual and output words in host memory, compiled kernel."""

    state_names = ("residual",)

    def __init__(self, numel: int, threshold: float) -> None:
        super().__init__(numel, "float32")
        self.threshold = np.float32(threshold)
        self.residual = np.zeros(numel, dtype=np.float32)
        self._words = np.zeros(packed_words(numel), dtype=np.uint32)
        self._encode, _ = cpu_kernels()

    def encode(self, values: Any) -> list[Any]:
        self._encode(values, self.residual, self.threshold, self._words)
        return [self._words]

    def quality(self, values: Any) -> PushQuality:
        return PushQuality(
            squared_norm(values), squared_norm(self.residual), count_sent(self._words)
        )


class _CudaTwoBitEncoder(Encoder):
    """GPU encoder: residual and words on the device, words copied to pinned host memory."""

    state_names = ("residual",)  # copied to the host by state(), back by load_state()

    def __init__(self, numel: int, threshold: float) -> None:
        import cupy  # noqa: PLC0415

        super().__init__(numel, "float32")
        self.threshold = float(threshold)
        self.residual = cupy.zeros(numel, dtype=cupy.float32)
        self._words = cupy.zeros(packed_words(numel), dtype=cupy.uint32)
        self._host = pinned_empty(packed_words(numel), np.uint32)

    def encode(self, values: Any) -> list[Any]:
        from kvstore.codecs import _twobit_cuda  # noqa: PLC0415

        _twobit_cuda.encode(values, self.residual, self.threshold, self._words)
        self._words.get(out=self._host)  # waits for the kernel; the grad is free afterwards
        return [self._host]

    def quality(self, values: Any) -> PushQuality:
        # The norms on the device (two reductions, one scalar back each); the codes from the
        # host copy of the words that the push sends anyway.
        return PushQuality(
            squared_norm(values), squared_norm(self.residual), count_sent(self._host)
        )


class _TwoBitAggregator(Aggregator):
    def __init__(self, numel: int, threshold: float) -> None:
        super().__init__(numel, "float32")
        self.threshold = np.float32(threshold)
        _, self._decode = cpu_kernels()

    def add(self, payloads: Payloads, first: bool) -> None:
        # TwoBitCodec.sum_relay repeats exactly this on the worker: keep the two in step.
        words = frame_array(payloads[0], np.uint32)
        self._decode(words, self.numel, self.threshold, self.result, not first)


@register_codec
class TwoBitCodec(Codec):
    """MXNet-compatible 2-bit threshold quantization with error feedback (16x smaller pushes).

    Args:
        threshold: the quantum ``t > 0`` (default 0.5), used as float32. It is absolute, so it
            must match the gradients' scale.
    """

    name = "2bit"
    dtypes = frozenset({"float32"})
    param_defaults = {"threshold": 0.5}
    # Decoding is exact (+t, -t or +0.0) and the server adds the decoded pushes one after
    # another in float32, so the worker can redo the sum from the pushes bit for bit.
    relayable = True

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.threshold = positive_float32(self.name, "threshold", self._params["threshold"])
        self._params["threshold"] = self.threshold

    def payload_nbytes(self, numel: int, dtype: str) -> tuple[int, ...]:
        return (4 * packed_words(numel),)

    def make_encoder(self, numel: int, dtype: str, device: Any = None) -> Encoder:
        self.check_dtype(dtype)
        if device is not None:
            return _CudaTwoBitEncoder(numel, self.threshold)
        return _HostTwoBitEncoder(numel, self.threshold)

    def make_aggregator(self, numel: int, dtype: str) -> Aggregator:
        self.check_dtype(dtype)
        return _TwoBitAggregator(numel, self.threshold)

    def sum_relay(self, pushes: Sequence[Payloads], numel: int, dtype: str, out: Any) -> None:
        self.check_dtype(dtype)
        if not pushes:
            raise CodecError("a relayed pull needs at least one push")
        for payloads in pushes:
            self.validate_payloads(payloads, numel, dtype)
        on_gpu = is_cupy_array(out)
        if on_gpu:
            import cupy  # noqa: PLC0415

        for i, payloads in enumerate(pushes):
            words = frame_array(payloads[0], np.uint32)
            if on_gpu:
                words = cupy.asarray(words)
            # The aggregator's arithmetic: the first push written, the others added in order.
            decode(words, numel, self.threshold, out, accumulate=i > 0)
