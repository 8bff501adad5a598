"""CuPy (CUDA) kernels of the sign quantizers ``1bit`` and ``efsign``: the payload bytes and the
residual bits of the numpy references (:mod:`kvstore.codecs.sign.onebit`,
:mod:`kvstore.codecs.sign.efsign`).

An encode is three launches on the current stream, with no host round trip:

1. ``sign_split_partials`` / ``sign_abs_partials``: one warp per block of ``SUM_BLOCK``
   elements forms ``p = residual + g`` (saturated) and lane-sums its terms (thread ``l`` takes
   elements ``l, l+32, ...`` of the block, in order), then writes the block's sums to a float64
   array: ``1bit``'s sums over ``p >= 0`` and ``p < 0`` and its count of ``p >= 0`` (exact in
   float64), or ``efsign``'s sum of ``abs(p)``. It reads only.
2. ``sign_split_scales`` / ``sign_abs_scales``: one block lane-sums the block sums and writes the
   float32 scales into the device scales frame.
3. ``sign_apply``: one thread per code byte (eight elements) reads the scales from device
   memory, forms ``p`` again, writes the code byte and ``residual = p - decoded``. With 16-byte
   aligned arrays it moves its elements as two ``float4`` per array; a misaligned view (a slice
   of a bigger array) loads them one by one.

CuPy compiles with ``-ftz=true`` and contracts multiply-adds, so every float32 operation goes
through the PTX helpers of :mod:`kvstore.codecs.cuda_source`, and the tests that a flush would
change are made on the bits: ``p >= 0`` is "sign bit clear, or ``p`` is -0.0" (a flushed
compare would call a negative subnormal -0.0 and send it as non-negative), an overflowed ``p``
is an infinite exponent, replaced by ``+-FLOAT32_MAX`` of its sign (always: on the GPU the
check is free next to the memory traffic), and negation flips the sign bit. float64 adds and
the division go through ``__dadd_rn`` and ``__ddiv_rn``; the rounding to float32 is
``cvt.rn.f32.f64`` without ``.ftz``.

Imported only when a CuPy array is encoded; importing it needs CuPy.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy

from kvstore.codecs.cuda_source import assemble, defines, ieee_ops, read_cu
from kvstore.codecs.quantize import LANES, SUM_BLOCK
from kvstore.codecs.quantize.cuda_ops import quant_ops

_THREADS = 256  # a multiple of 32: the partial-sum kernels give each warp one block
_SCALE_THREADS = 1024  # the one block that stages the block sums (quant_lane_sums_block)


def cuda_source() -> str:
    """The CUDA C of these kernels: the IEEE helpers, the quantizers' ops, ``SIGN_SUM_BLOCK``,
    then ``sign.cu``."""
    return assemble(
        ieee_ops(),
        quant_ops(),
        defines(SIGN_SUM_BLOCK=SUM_BLOCK),
        read_cu("kvstore.codecs.sign", "sign.cu"),
    )


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=cuda_source(), options=("--std=c++14",))


def partials_for(numel: int, symmetric: bool) -> Any:
    """The float64 device array of per-block sums an encoder of ``numel`` elements reuses."""
    nblocks = -(-numel // SUM_BLOCK)
    return cupy.empty((1 if symmetric else 3) * nblocks, dtype=cupy.float64)


def encode(
    grad: Any, residual: Any, scales: Any, codes: Any, symmetric: bool, partials: Any
) -> None:
    """Encode one push of a chunk on the device.

    Args:
        grad: float32[n] CuPy array (may be a view at any offset).
        residual: float32[n] CuPy array; updated in place.
        scales: the uint8 device scales frame (4 or 8 bytes); gets ``[s]`` or ``[a, b]``.
        codes: the uint8 device codes frame, ``ceil(n/8)`` bytes; every byte written.
        symmetric: ``efsign`` (True) or ``1bit`` (False).
        partials: :func:`partials_for` of ``n`` and ``symmetric``.
    """
    n = int(grad.size)
    nblocks = -(-n // SUM_BLOCK)
    module = _module()
    kind = "abs" if symmetric else "split"
    if nblocks:
        module.get_function(f"sign_{kind}_partials")(
            (-(-nblocks * LANES // _THREADS),),
            (_THREADS,),
            (grad, residual, partials, cupy.int64(n), cupy.int64(nblocks)),
        )
    module.get_function(f"sign_{kind}_scales")(
        (1,), (_SCALE_THREADS,), (partials, cupy.int64(nblocks), cupy.int64(n), scales)
    )
    nbytes = int(codes.size)
    if nbytes:
        aligned = grad.data.ptr % 16 == 0 and residual.data.ptr % 16 == 0
        module.get_function("sign_apply")(
            (-(-nbytes // _THREADS),),
            (_THREADS,),
            (
                grad,
                residual,
                codes,
                scales,
                cupy.int32(1 if symmetric else 0),
                cupy.int64(n),
                cupy.int64(nbytes),
                cupy.int32(1 if aligned else 0),
            ),
        )
