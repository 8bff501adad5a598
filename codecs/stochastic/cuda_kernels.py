"""CuPy (CUDA) kernels of the stochastic quantizers ``terngrad`` and ``qsgd``: the payload bytes
of the numpy references in :mod:`kvstore.codecs.stochastic.terngrad` and
:mod:`kvstore.codecs.stochastic.qsgd`, bit for bit, written on the device (the encoder copies
them to pinned host buffers).

One push, on the device, without a host round trip:

* **terngrad**: ``terngrad_stats`` gives one warp to each block of ``SUM_BLOCK`` elements: its
  lane sums of ``x`` and ``x * x`` in float64 (thread ``l`` sums elements ``l, l + 32, ...`` in
  order; :func:`quant_combine_lanes` adds the lanes in order) and its largest magnitude (the
  bits of ``abs(x)``: non-negative floats order like their bits). ``terngrad_finish``, one
  block, lane-sums the block sums, takes the largest magnitude and writes ``s`` into the scales
  frame; ``terngrad_codes`` reads ``s`` there, one thread per four code bytes (16 elements,
  four ``float4`` loads and one 32-bit store).
* **qsgd**: ``qsgd_partials`` gives one warp to each (bucket, ``SUM_BLOCK`` block of it) for
  the lane sum of squares; ``qsgd_norms``, one warp per bucket, lane-sums a bucket's partial
  sums (a bucket of one block has one, which is its sum) and writes the norm into the scales
  frame and ``levels / norm`` into a scratch array; ``qsgd_codes`` gives one thread to each
  group of eight codes (``width`` bytes; two ``float4`` loads).

The per-block sums load eight terms per lane before adding them in order, so a warp waits for
memory once per eight terms rather than once per term.

CuPy compiles with ``-ftz=true`` (subnormal inputs and results of float32 operations flushed
to zero) and NVRTC contracts ``a*b + c``, so every float32 operation whose bits matter goes
through explicit PTX (the IEEE helpers, and ``stochastic.cu``'s division and float64 to float32)
and float64 ones through the ``__d*_rn`` intrinsics; magnitudes and comparisons between
non-negative floats use their bits (``fabsf``, ``fminf`` and float compares flush subnormals).

Imported only when a CuPy array is encoded; importing it needs CuPy.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

from kvstore.codecs.cuda_source import assemble, defines, ieee_ops, read_cu
from kvstore.codecs.quantize import SUM_BLOCK
from kvstore.codecs.quantize.cuda_ops import quant_ops

_WARPS_PER_BLOCK = 8
_THREADS = 256
_FINISH_THREADS = 1024  # terngrad_finish: one block stages the block sums


def cuda_source() -> str:
    """The CUDA C of these kernels: the IEEE helpers, the quantizers' ops, the block sizes,
    then ``stochastic.cu``."""
    return assemble(
        ieee_ops(),
        quant_ops(),
        defines(SUM_BLOCK=SUM_BLOCK, WARPS_PER_BLOCK=_WARPS_PER_BLOCK),
        read_cu("kvstore.codecs.stochastic", "stochastic.cu"),
    )


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=cuda_source(), options=("--std=c++14", "--fmad=false"))


def _kernel(name: str) -> Any:
    return _module().get_function(name)


def _grid(count: int, per_block: int) -> tuple[int]:
    return ((count + per_block - 1) // per_block,)


def terngrad_encode(
    grad: Any, clip: float, lo: int, hi: int, start: int, scales: Any, packed: Any
) -> None:
    """Encode float32 ``grad`` (CuPy, flat): its scale into the 4-byte uint8 ``scales`` frame,
    its 2-bit codes into the uint8 ``packed`` frame (both CuPy)."""
    n = int(grad.size)
    scale = scales.view(cupy.float32)
    if n == 0:
        scale.fill(0)
        return
    grad = cupy.ascontiguousarray(grad)
    nblocks = (n + SUM_BLOCK - 1) // SUM_BLOCK
    sums = cupy.empty(nblocks, dtype=cupy.float64)
    squares = cupy.empty(nblocks, dtype=cupy.float64)
    tops = cupy.empty(nblocks, dtype=cupy.uint32)
    _kernel("terngrad_stats")(
        _grid(nblocks, _WARPS_PER_BLOCK),
        (_THREADS,),
        (grad, cupy.int64(n), cupy.int32(clip > 0), sums, squares, tops, cupy.int64(nblocks)),
    )
    _kernel("terngrad_finish")(
        (1,),
        (_FINISH_THREADS,),
        (sums, squares, tops, cupy.int64(nblocks), cupy.int64(n), cupy.float64(clip), scale),
    )
    nbytes = int(packed.size)
    aligned = grad.data.ptr % 16 == 0 and packed.data.ptr % 4 == 0
    _kernel("terngrad_codes")(
        _grid(-(-n // 16), _THREADS),
        (_THREADS,),
        (
            grad,
            cupy.int64(n),
            scale,
            cupy.uint32(lo),
            cupy.uint32(hi),
            cupy.uint64(start),
            packed,
            cupy.int64(nbytes),
            cupy.int32(aligned),
        ),
    )


def qsgd_encode(
    values: Any,
    levels: int,
    bucket: int,
    lo: int,
    hi: int,
    start: int,
    scales: Any,
    packed: Any,
    width: int,
) -> None:
    """Encode float32 ``values`` (CuPy, flat): one norm per bucket into the uint8 ``scales``
    frame, the ``width``-bit codes into the uint8 ``packed`` frame (both CuPy)."""
    n = int(values.size)
    if n == 0:
        return
    values = cupy.ascontiguousarray(values)
    norms = scales.view(cupy.float32)
    nbuckets = int(norms.size)
    nsub = (min(bucket, n) + SUM_BLOCK - 1) // SUM_BLOCK
    nwork = nbuckets * nsub
    partials = cupy.empty(nwork, dtype=cupy.float64)
    inverses = cupy.empty(nbuckets, dtype=cupy.float32)
    _kernel("qsgd_partials")(
        _grid(nwork, _WARPS_PER_BLOCK),
        (_THREADS,),
        (values, cupy.int64(n), cupy.int64(bucket), cupy.int64(nsub), cupy.int64(nwork), partials),
    )
    _kernel("qsgd_norms")(
        _grid(nbuckets, _WARPS_PER_BLOCK),
        (_THREADS,),
        (
            partials,
            cupy.int64(nsub),
            cupy.int64(nbuckets),
            cupy.float32(levels),
            norms,
            inverses,
        ),
    )
    ngroups = (n + 7) // 8
    _kernel("qsgd_codes")(
        _grid(ngroups, _THREADS),
        (_THREADS,),
        (
            values,
            cupy.int64(n),
            cupy.int64(bucket),
            norms,
            inverses,
            cupy.int32(levels),
            cupy.uint32(lo),
            cupy.uint32(hi),
            cupy.uint64(start),
            cupy.int32(width),
            packed,
            cupy.int64(int(packed.size)),
            cupy.int64(ngroups),
            cupy.int32(values.data.ptr % 16 == 0),
        ),
    )
