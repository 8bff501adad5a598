"""CuPy (CUDA) kernels of the 16-bit casts ``fp16`` and ``bf16``: the same bytes and residuals,
bit for bit, as the numpy references of :mod:`kvstore.codecs.cast` and the numba kernels of
:mod:`kvstore.codecs.cast.numba_kernels`, whose bit-pattern arithmetic they repeat (see that
module's docstring).

Four elements per thread: one ``float4`` of values (and of residuals) and one ``ushort4`` of
codes when the arrays are 16-byte aligned, one by one for a misaligned view and the last partial
group. The check of a multi-chunk key for overflow (:func:`largest_magnitude`) is a grid-stride
maximum with one ``atomicMax`` per warp.
CuPy compiles with ``-ftz=true``, under which ``__float2half_rn`` and the float operators would
flush subnormal float32 inputs and results to zero, so the conversions are integer operations
on the bit patterns, and the few float32 operations (the error-feedback add and subtract, the
``|p| + 0.5`` that rounds a subnormal half, the ``m * 2**-24`` of a subnormal half's value) go
through the PTX helpers of :mod:`kvstore.codecs.cuda_source`. Without error feedback, an element
that rounds past the format's range writes infinity (as the references do) and raises the
kernel's overflow report (an ``atomicMax`` of its magnitude bits, taken only by such elements),
which the encoder reads back before the payload is copied to the host.

Imported only when a CuPy array is encoded; importing it needs CuPy.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

from kvstore.codecs.cuda_source import assemble, ieee_ops, read_cu
from kvstore.codecs.quantize.cuda_ops import quant_ops

_BLOCK = 256


def cuda_source() -> str:
    """The CUDA C of these kernels: the IEEE helpers, the quantizers' ops, then ``cast.cu``."""
    return assemble(ieee_ops(), quant_ops(), read_cu("kvstore.codecs.cast", "cast.cu"))


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=cuda_source(), options=("--std=c++14",))


@functools.cache
def _blocks(device: int) -> int:
    return 8 * cupy.cuda.Device(device).attributes["MultiProcessorCount"]


def _aligned(*arrays: Any) -> Any:
    """1 when every array starts on a 16-byte boundary (float4 / ushort4 access), else 0."""
    return cupy.int32(all(a.data.ptr % 16 == 0 for a in arrays))


def _grid(n: int) -> tuple[int]:
    """Blocks for four elements per thread."""
    return ((-(-n // 4) + _BLOCK - 1) // _BLOCK,)


class OverflowReports:
    """The device scratch of an encoder's overflow reports: two uint32 slots used in turn, each
    push's kernel zeroing the slot the next push reports into (no clearing launch)."""

    def __init__(self) -> None:
        self.slots = cupy.zeros(2, dtype=cupy.uint32)
        self.slot = 0


def encode(values: Any, residual: Any, out: Any, bf16: bool, reports: Any) -> int:
    """Encode float32 ``values`` [n] into the uint16 patterns ``out`` [n]; with error feedback
    when ``residual`` (float32 [n], updated) is given.

    Returns:
        Without error feedback, the largest magnitude (float32 bits) among the elements that
        rounded past the format's range, 0 if none (``reports``: the encoder's
        :class:`OverflowReports`; reading the slot waits for the kernel); with error feedback, 0.
    """
    n = int(values.size)
    if n == 0:
        return 0
    fmt = cupy.int32(1 if bf16 else 0)
    if residual is None:
        slot = reports.slot
        _module().get_function("cast_encode")(
            _grid(n),
            (_BLOCK,),
            (
                values,
                out,
                cupy.int64(n),
                fmt,
                reports.slots,
                cupy.int32(slot),
                _aligned(values, out),
            ),
        )
        reports.slot = 1 - slot
        return int(reports.slots[slot].get())
    _module().get_function("cast_encode_feedback")(
        _grid(n),
        (_BLOCK,),
        (values, residual, out, cupy.int64(n), fmt, _aligned(values, residual, out)),
    )
    return 0


def decode(codes: Any, out: Any, bf16: bool, accumulate: bool) -> None:
    """``out`` (float32 [n]) = the float32 of the uint16 patterns ``codes`` [n], or ``+=`` it
    (a float32 add) with ``accumulate``."""
    n = int(out.size)
    if n == 0:
        return
    _module().get_function("cast_decode")(
        _grid(n),
        (_BLOCK,),
        (
            codes,
            out,
            cupy.int64(n),
            cupy.int32(1 if bf16 else 0),
            cupy.int32(int(accumulate)),
            _aligned(codes, out),
        ),
    )


def largest_magnitude(values: Any) -> int:
    """The largest ``|v|`` of float32 ``values`` as float32 bits (0 when empty); one scalar
    back, which waits for the reduction."""
    if values.size == 0:
        return 0
    n = int(values.size)
    largest = cupy.zeros(1, dtype=cupy.uint32)
    _module().get_function("cast_largest_magnitude")(
        (min(_blocks(values.device.id), -(-n // (4 * _BLOCK))),),
        (_BLOCK,),
        (values.view(cupy.uint32), cupy.int64(n), _aligned(values), largest),
    )
    return int(largest.get()[0])
