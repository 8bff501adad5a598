"""Compiled CPU building blocks of the quantizing codecs (numba, GIL released, cached on disk).

Bit for bit the numpy references of :mod:`kvstore.codecs.quantize` and
:mod:`kvstore.codecs.counter_rng`; the codecs' own kernels (the ``numba_kernels`` modules of the
sign, stochastic and cast families) inline them. Compiled without fast-math: every float
operation rounds like numpy's, in the order written.

A blocked lane sum is written in a kernel as::

    lanes = stack_lanes(32, np.float64)      # once; lanes[:] = 0.0 per block
    table = block_values[:rows * 32].reshape(rows, 32)
    for r in range(rows):                    # through a row view, which LLVM vectorizes
        row = table[r]
        for lane in range(32): lanes[lane] += term(row[lane])
    block_sums[b] = combine_lanes(lanes)
    ...
    total = lane_sum(block_sums)

(a partial last row only feeds its first lanes). Lanes on the stack (:func:`stack_lanes`) stay
in vector registers across the rows; lanes on the heap make every row store and reload them,
which costs more than the arithmetic (1bit's pass 1 in L2 cache: 250 -> 190 ps per element).

The counter generator's uniforms (:func:`uniform`) have their hash emitted as 32-bit LLVM IR:
numba types every operation on 32-bit integers as 64-bit, and 64-bit lanes halve the SIMD width
and need emulated 64-bit multiplies (16M uniforms: 10.4 ms -> 4.6 ms on the development
machine).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import make_array, populate_array

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)

LANES = 32
_UNIFORM_SCALE = np.float32(2.0**-24)


@intrinsic
def stack_lanes(typingctx, count, dtype):
    """An uninitialised ``dtype[count]`` array (``count`` a literal integer) in the calling
    kernel's stack frame, for a lane loop's accumulators.

    A lane array from ``np.empty`` is opaque heap memory to LLVM, which may alias the arrays the
    loop reads, so every row loads and stores the accumulators again (a store-to-load round trip
    on every lane's chain); LLVM knows a stack slot aliases nothing else and keeps the lanes in
    vector registers across the rows. The array has no owner: it must not outlive the kernel
    (never return it or store it in another array)."""
    if not isinstance(count, types.IntegerLiteral):
        return None
    if isinstance(dtype, types.NumberClass):
        element = dtype.instance_type
    elif isinstance(dtype, types.DType):
        element = dtype.dtype
    else:
        return None
    size = count.literal_value
    array_type = types.Array(element, 1, "C")

    def codegen(context, builder, signature, args):
        value_type = context.get_value_type(element)
        itemsize = context.get_abi_sizeof(value_type)
        slot = cgutils.alloca_once(builder, ir.ArrayType(value_type, size))  # in the entry block
        intp = context.get_value_type(types.intp)
        array = make_array(array_type)(context, builder)
        populate_array(
            array,
            data=builder.bitcast(slot, value_type.as_pointer()),
            shape=[ir.Constant(intp, size)],
            strides=[ir.Constant(intp, itemsize)],
            itemsize=ir.Constant(intp, itemsize),
            meminfo=None,
        )
        return array._getvalue()

    return array_type(count, dtype), codegen


@njit(nogil=True, cache=True, inline="always")
def combine_lanes(lanes):
    """Lane 0 + lane 1 + ... + lane 31, in order, from +0.0 (float64)."""
    total = 0.0
    for lane in range(LANES):
        total += lanes[lane]
    return total


@njit(nogil=True, cache=True)
def lane_sum(values):
    """:func:`kvstore.codecs.quantize.lane_sum_reference` of float64 ``values``."""
    lanes = np.zeros(LANES)
    n = values.shape[0]
    full = n - n % LANES
    for base in range(0, full, LANES):
        for lane in range(LANES):
            lanes[lane] += values[base + lane]
    for i in range(full, n):
        lanes[i - full] += values[i]
    return combine_lanes(lanes)


@njit(nogil=True, cache=True)
def blocked_sum(values, block):
    """:func:`kvstore.codecs.quantize.blocked_sum_reference` of float32 ``values`` (the
    plain sum; the codecs fuse their own terms into the same loop shape)."""
    n = values.shape[0]
    nblocks = (n + block - 1) // block
    sums = np.empty(nblocks)
    lanes = np.empty(LANES)
    for b in range(nblocks):
        lanes[:] = 0.0
        start = b * block
        stop = min(n, start + block)
        rows = (stop - start) // LANES
        table = values[start : start + rows * LANES].reshape(rows, LANES)
        for r in range(rows):
            row = table[r]  # a row view: LLVM vectorizes the lane loop (a flat index does not)
            for lane in range(LANES):
                lanes[lane] += np.float64(row[lane])
        for i in range(start + rows * LANES, stop):
            lanes[i - start - rows * LANES] += np.float64(values[i])
        sums[b] = combine_lanes(lanes)
    return lane_sum(sums)


# the counter generator in 32-bit lanes ---------------------------------------------------------


def _hash32_ir(builder, x):
    """:func:`kvstore.codecs.counter_rng.hash32` on an LLVM i32 (wrapping multiplies)."""
    i32 = ir.IntType(32)
    x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 16)))
    x = builder.mul(x, ir.Constant(i32, 0x7FEB352D))
    x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 15)))
    x = builder.mul(x, ir.Constant(i32, 0x846CA68B))
    return builder.xor(x, builder.lshr(x, ir.Constant(i32, 16)))


@intrinsic
def _uniform_bits(typingctx, lo, hi, base, offset):
    """The 24 random bits ``hash32((hash32(i ^ lo) + hi) mod 2**32) >> 8`` (int32) of element
    ``i = base + offset``, every argument taken modulo 2**32. ``base`` and ``offset`` come
    separately so that the index is added in 32 bits: a kernel passes its loop counter as
    ``offset`` and LLVM keeps a 32-bit vector of indices (a 64-bit one costs a fifth more)."""
    if not all(isinstance(t, types.Integer) for t in (lo, hi, base, offset)):
        return None

    def codegen(context, builder, signature, args):
        lo32, hi32, base32, offset32 = (
            context.cast(builder, value, kind, types.uint32)
            for value, kind in zip(args, signature.args, strict=True)
        )
        index = builder.add(base32, offset32)
        h = _hash32_ir(builder, builder.add(_hash32_ir(builder, builder.xor(index, lo32)), hi32))
        return builder.lshr(h, ir.Constant(ir.IntType(32), 8))

    return types.int32(lo, hi, base, offset), codegen


@njit(nogil=True, cache=True, inline="always")
def uniform(lo, hi, base, offset):
    """The float32 uniform in [0, 1) of element ``base + offset`` of the stream with key halves
    ``lo``, ``hi`` (exact: 24 bits times 2**-24)."""
    return np.float32(_uniform_bits(lo, hi, base, offset)) * _UNIFORM_SCALE


@njit(nogil=True, cache=True)
def uniforms(lo, hi, start, out):
    """``out[j]`` = the uniform of element ``start + j`` (for tests)."""
    for j in range(out.shape[0]):
        out[j] = uniform(lo, hi, start, j)
