"""Compiled CPU kernels of the 16-bit casts ``fp16`` and ``bf16`` (numba, GIL released, cached
on disk).

Bit for bit the numpy references of :mod:`kvstore.codecs.cast`. numba has no float16 on the
CPU, so the conversions work on bit patterns: :func:`float32_bits` / :func:`bits_float32`
reinterpret a float32 as its uint32 pattern and back (an LLVM ``bitcast``, no memory round
trip), and everything else is uint32 arithmetic, compares and selects, which LLVM vectorizes
(16 lanes with AVX-512). Every intermediate is wrapped in ``np.uint32``: numba widens integer
arithmetic to 64 bits, which would halve the vector width.

fp16 from the magnitude bits ``a`` of a float32 (:func:`fp16_magnitude`):

* ``a >= 0x38800000`` (``|p| >= 2**-14``, a normal half): rebias the exponent (subtract
  ``112 << 23``) and drop 13 mantissa bits rounding to nearest even (add ``0xFFF`` plus the
  lowest kept bit, shift). A carry moves into the exponent by itself, and a result
  ``>= 0x7C00`` means the value rounds past 65504 (``|p| >= 65520``).
* smaller (a subnormal half or zero): ``|p| + 0.5`` in float32. Floats in ``[0.5, 1)`` are
  spaced ``2**-24`` apart, the subnormal halves' step, so the add rounds ``|p|`` to the nearest
  multiple of ``2**-24`` (ties to even) and the low bits of the sum are the half's bits
  (``0x400``, the smallest normal half, when ``|p|`` rounds up to ``2**-14``).

fp16 to float32 (:func:`fp16_widen`): a normal half's exponent is rebiased by adding
``112 << 23`` to its shifted bits, infinities and NaN by adding ``224 << 23`` (payload bits kept,
as numpy does); a subnormal half is ``float32(m) * 2**-24``, exact. bf16 to float32 is the
16 bits shifted up.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)

_U = np.uint32

ABS_MASK = _U(0x7FFF_FFFF)
FLOAT32_MAX_BITS = _U(0x7F7F_FFFF)
"""Bits of the largest finite float32; an infinite magnitude is the only one above it."""

FP16_MAX_FINITE = _U(0x7BFF)
FP16_INF = _U(0x7C00)
BF16_MAX_FINITE = _U(0x7F7F)

_HALF_SIGN = _U(0x8000)
_FP16_REBIAS = _U(112 << 23)
_FP16_INF_REBIAS = _U(224 << 23)
_FP16_MIN_NORMAL = _U(0x3880_0000)  # 2**-14 as float32 bits
_FP16_ROUND = _U(0xFFF)
_HALF_BITS = _U(0x3F00_0000)  # 0.5 as float32 bits
_HALF = np.float32(0.5)
_FP16_SUBNORMAL_STEP = np.float32(2.0**-24)
_BF16_ROUND = _U(0x7FFF)
_ONE = _U(1)
_SHIFT13 = _U(13)
_SHIFT16 = _U(16)


@intrinsic
def float32_bits(typingctx, value):
    """The uint32 bit pattern of a float32 (a bitcast)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_float32(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of the integer ``bits`` (a bitcast)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if bits.bitwidth > 32:
            value = builder.trunc(value, context.get_value_type(types.uint32))
        elif bits.bitwidth < 32:
            value = builder.zext(value, context.get_value_type(types.uint32))
        return builder.bitcast(value, context.get_value_type(types.float32))

    return types.float32(bits), codegen


# conversions of one element ---------------------------------------------------------------


@njit(nogil=True, cache=True, inline="always")
def fp16_magnitude(a):
    """The fp16 magnitude bits of the float32 magnitude bits ``a`` (uint32), rounded to nearest
    even; ``>= 0x7C00`` when the value rounds past the largest finite half."""
    lowest_kept = _U(_U(a >> _SHIFT13) & _ONE)
    normal = _U(_U(_U(a - _FP16_REBIAS) + _U(_FP16_ROUND + lowest_kept)) >> _SHIFT13)
    subnormal = _U(float32_bits(bits_float32(a) + _HALF) - _HALF_BITS)
    return subnormal if a < _FP16_MIN_NORMAL else normal


@njit(nogil=True, cache=True, inline="always")
def bf16_magnitude(x):
    """The bf16 magnitude bits of the float32 bits ``x`` (uint32, finite), rounded to nearest
    even; ``0x7F80`` when the value rounds past the largest finite bf16."""
    lowest_kept = _U(_U(x >> _SHIFT16) & _ONE)
    rounded = _U(x + _U(_BF16_ROUND + lowest_kept))
    return _U(_U(rounded >> _SHIFT16) & _U(0x7FFF))


@njit(nogil=True, cache=True, inline="always")
def half_sign(x):
    """The sign bit of the float32 bits ``x`` at its 16-bit place."""
    return _U(_U(x >> _SHIFT16) & _HALF_SIGN)


@njit(nogil=True, cache=True, inline="always")
def fp16_widen(h):
    """The float32 of the fp16 bits ``h`` (any unsigned integer holding 16 bits), exactly."""
    h = _U(h)
    magnitude = _U(h & _U(0x7FFF))
    shifted = _U(magnitude << _SHIFT13)
    rebias = _FP16_INF_REBIAS if magnitude >= FP16_INF else _FP16_REBIAS
    normal = _U(shifted + rebias)
    subnormal = float32_bits(np.float32(magnitude) * _FP16_SUBNORMAL_STEP)
    bits = subnormal if magnitude < _U(0x400) else normal
    return bits_float32(_U(bits | _U(_U(h & _HALF_SIGN) << _SHIFT16)))


@njit(nogil=True, cache=True, inline="always")
def bf16_widen(h):
    """The float32 of the bf16 bits ``h`` (any unsigned integer holding 16 bits), exactly."""
    return bits_float32(_U(_U(h) << _SHIFT16))


@njit(nogil=True, cache=True, inline="always")
def clamp_to_finite(x):
    """The float32 bits ``x`` with an infinite magnitude replaced by the largest finite one of
    the same sign (``x`` is never NaN: it is a sum of finite floats)."""
    magnitude = min(_U(x & ABS_MASK), FLOAT32_MAX_BITS)
    return _U(_U(x & _U(0x8000_0000)) | magnitude)


# kernels -----------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def encode_fp16(values, out):
    """``out[j]`` = the fp16 bits of ``values[j]`` (float32[n] -> uint16[n]), an overflow as
    infinity; returns the largest magnitude's float32 bits (the caller refuses the push when
    it is >= the overflow bound)."""
    largest = _U(0)
    for j in range(values.shape[0]):
        x = float32_bits(values[j])
        a = _U(x & ABS_MASK)
        magnitude = min(fp16_magnitude(a), FP16_INF)
        out[j] = np.uint16(half_sign(x) | magnitude)
        largest = max(largest, a)
    return largest


@njit(nogil=True, cache=True)
def encode_fp16_feedback(values, residual, out):
    """With error feedback: ``p = residual + values`` (float32; clamped to the finite range),
    ``out[j]`` = fp16 bits of ``p`` saturated at 65504, ``residual = p - float32(out)``."""
    for j in range(values.shape[0]):
        x = clamp_to_finite(float32_bits(residual[j] + values[j]))
        magnitude = min(fp16_magnitude(_U(x & ABS_MASK)), FP16_MAX_FINITE)
        h = _U(half_sign(x) | magnitude)
        out[j] = np.uint16(h)
        residual[j] = bits_float32(x) - fp16_widen(h)


@njit(nogil=True, cache=True)
def encode_bf16(values, out):
    """``out[j]`` = the bf16 bits of ``values[j]`` (an overflow rounds to infinity by itself);
    returns the largest magnitude's float32 bits."""
    largest = _U(0)
    for j in range(values.shape[0]):
        x = float32_bits(values[j])
        out[j] = np.uint16(half_sign(x) | bf16_magnitude(x))
        largest = max(largest, _U(x & ABS_MASK))
    return largest


@njit(nogil=True, cache=True)
def encode_bf16_feedback(values, residual, out):
    """:func:`encode_fp16_feedback` for bf16 (saturated at 0x7F7F)."""
    for j in range(values.shape[0]):
        x = clamp_to_finite(float32_bits(residual[j] + values[j]))
        h = _U(half_sign(x) | min(bf16_magnitude(x), BF16_MAX_FINITE))
        out[j] = np.uint16(h)
        residual[j] = bits_float32(x) - bf16_widen(h)


@njit(nogil=True, cache=True)
def decode_fp16(codes, out, accumulate):
    """``out[j]`` = float32 of the fp16 bits ``codes[j]``, or ``out[j] +=`` it with
    ``accumulate`` (a float32 add)."""
    if accumulate:
        for j in range(out.shape[0]):
            out[j] += fp16_widen(codes[j])
    else:
        for j in range(out.shape[0]):
            out[j] = fp16_widen(codes[j])


@njit(nogil=True, cache=True)
def decode_bf16(codes, out, accumulate):
    """:func:`decode_fp16` for bf16 bits."""
    if accumulate:
        for j in range(out.shape[0]):
            out[j] += bf16_widen(codes[j])
    else:
        for j in range(out.shape[0]):
            out[j] = bf16_widen(codes[j])


@njit(nogil=True, cache=True)
def largest_magnitude(values):
    """The largest ``|v|`` of float32 ``values`` as float32 bits (0 when empty): one read."""
    largest = _U(0)
    for j in range(values.shape[0]):
        largest = max(largest, _U(float32_bits(values[j]) & ABS_MASK))
    return largest
