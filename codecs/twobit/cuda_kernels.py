"""CuPy (CUDA) kernels of the 2-bit codec: same contract, bytes and residuals as the CPU ones.

The fast kernels give each thread one byte of codes, i.e. four consecutive elements: it loads
them as one 16-byte ``float4`` (gradient and residual), stores the residual the same way and
writes its code byte, so a warp moves whole 512-byte lines and memory runs near the device's copy
bandwidth. Byte ``j`` of the little-endian words is exactly the format's byte ``j`` (elements
``4j..4j+3``, first in the high bits). Threads of the last, partial group and of the padding
bytes of the last word fall back to element-wise loads and write code 00, the format's padding.
Those kernels need 16-byte aligned arrays; a misaligned view (a slice that starts mid-line) uses
the element-per-thread kernels below them, which combine 16 codes per word with an XOR-shuffle
OR-reduction. Compiled without fast-math, so the float32 add, compares and subtracts round
exactly like numpy's.

Imported only when a CuPy array is encoded; importing it needs CuPy.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

from kvstore.codecs.cuda_source import assemble, ieee_ops, read_cu

_BLOCK = 256  # a multiple of 32, so every warp holds whole 16-element words


def cuda_source() -> str:
    """The CUDA C of these kernels: the IEEE helpers, then ``twobit.cu``."""
    return assemble(ieee_ops(), read_cu("kvstore.codecs.twobit", "twobit.cu"))


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=cuda_source(), options=("--std=c++14",))


def _aligned(*arrays: Any) -> bool:
    """Whether every array starts on a 16-byte boundary (what ``float4`` loads need)."""
    return all(a.data.ptr % 16 == 0 for a in arrays)


def encode(grad: Any, residual: Any, threshold: float, out: Any) -> None:
    """GPU twin of the CPU ``encode``: float32 ``grad``/``residual`` [n], uint32 ``out`` words."""
    n = int(grad.size)
    nwords = int(out.size)
    if n == 0:
        return
    if _aligned(grad, residual):
        nbytes = 4 * nwords  # every byte of the words is written, the padding ones with 00
        _module().get_function("twobit_encode4")(
            ((nbytes + _BLOCK - 1) // _BLOCK,),
            (_BLOCK,),
            (grad, residual, out, cupy.float32(threshold), cupy.int64(n), cupy.int64(nbytes)),
        )
        return
    threads = nwords * 16
    grid = (threads + _BLOCK - 1) // _BLOCK
    kernel = _module().get_function("twobit_encode")
    kernel(
        (grid,),
        (_BLOCK,),
        (grad, residual, out, cupy.float32(threshold), cupy.int64(n), cupy.int64(nwords)),
    )


def decode(words: Any, n: int, threshold: float, out: Any, accumulate: bool) -> None:
    """GPU twin of the CPU ``decode``."""
    if n == 0:
        return
    if _aligned(out):
        groups = (n + 3) // 4
        _module().get_function("twobit_decode4")(
            ((groups + _BLOCK - 1) // _BLOCK,),
            (_BLOCK,),
            (
                words,
                out,
                cupy.float32(threshold),
                cupy.int64(n),
                cupy.int32(1 if accumulate else 0),
            ),
        )
        return
    grid = (n + _BLOCK - 1) // _BLOCK
    kernel = _module().get_function("twobit_decode")
    kernel(
        (grid,),
        (_BLOCK,),
        (words, out, cupy.float32(threshold), cupy.int64(n), cupy.int32(1 if accumulate else 0)),
    )
