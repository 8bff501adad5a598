"""CuPy (CUDA) kernels of the 2-bit codec's ``residual_clip`` variant and of its residual watch.

Same contract, bytes and residuals as :func:`kvstore.codecs.twobit.encode_clipped_reference` and
the numba ``encode_clipped``: the MXNet quantization of ``residual + grad``, then the kept
residual clipped to ``[-limit, limit]`` with selects (a NaN stays NaN, +-inf becomes +-limit).
The MXNet-exact kernels stay in :mod:`kvstore.codecs.twobit.cuda_kernels`; this module only adds.

Layout of the work, as there: with 16-byte aligned arrays each thread owns one code byte (four
elements, loaded and stored as ``float4``) and writes it, padding bytes included (code 00);
otherwise one thread per element, and the 16 threads of a word OR their codes together with
XOR shuffles. Compiled without fast-math, so adds, compares and subtracts round like numpy's.

:func:`count_at_least`, behind the runaway warning, reads the residual once (a grid-stride loop,
warp shuffles, one atomic add per warp) and returns one integer; no temporary array.

Imported only for CuPy arrays; importing it needs CuPy.
"""

from __future__ import annotations

import functools
from typing import Any, SupportsFloat

import cupy

from kvstore.codecs.cuda_source import assemble, ieee_ops, read_cu

_BLOCK = 256  # a multiple of 32: every warp holds whole 16-element words
_COUNT_BLOCKS = 2048  # the count's grid-stride loop: enough blocks to fill any current device


def cuda_source() -> str:
    """The CUDA C of these kernels: the IEEE helpers, then ``twobit_variant.cu``."""
    return assemble(ieee_ops(), read_cu("kvstore.codecs.twobit", "twobit_variant.cu"))


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=cuda_source(), options=("--std=c++14",))


def _aligned(*arrays: Any) -> bool:
    """Whether every array starts on a 16-byte boundary (what ``float4`` loads need)."""
    return all(a.data.ptr % 16 == 0 for a in arrays)


def encode_clipped(
    grad: Any, residual: Any, threshold: SupportsFloat, limit: SupportsFloat, out: Any
) -> None:
    """GPU twin of the CPU ``encode_clipped``: float32 ``grad``/``residual`` [n], uint32 ``out``
    words (``ceil(n/16)``, fully overwritten), float32 ``limit`` >= ``threshold``."""
    n = int(grad.size)
    nwords = int(out.size)
    if n == 0:
        return
    t = cupy.float32(threshold)
    bound = cupy.float32(limit)
    if _aligned(grad, residual):
        nbytes = 4 * nwords
        _module().get_function("twobit_encode_clipped4")(
            ((nbytes + _BLOCK - 1) // _BLOCK,),
            (_BLOCK,),
            (grad, residual, out, t, bound, cupy.int64(n), cupy.int64(nbytes)),
        )
        return
    threads = nwords * 16
    _module().get_function("twobit_encode_clipped")(
        ((threads + _BLOCK - 1) // _BLOCK,),
        (_BLOCK,),
        (grad, residual, out, t, bound, cupy.int64(n), cupy.int64(nwords)),
    )


def count_at_least(values: Any, bound: SupportsFloat) -> int:
    """How many elements of float32 ``values`` have ``|v| >= bound`` (one scalar back)."""
    n = int(values.size)
    if n == 0:
        return 0
    count = cupy.zeros(1, dtype=cupy.uint64)
    blocks = min((n + _BLOCK - 1) // _BLOCK, _COUNT_BLOCKS)
    _module().get_function("twobit_count_at_least")(
        (blocks,), (_BLOCK,), (values, cupy.float32(bound), cupy.int64(n), count)
    )
    return int(count.get()[0])
