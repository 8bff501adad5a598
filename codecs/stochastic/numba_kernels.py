"""Compiled CPU kernels of the stochastic quantizers ``terngrad`` and ``qsgd`` (numba, GIL
released, cached on disk).

Bit for bit the numpy references of :mod:`kvstore.codecs.stochastic.terngrad` and
:mod:`kvstore.codecs.stochastic.qsgd`: same float32 and float64 operations in the same order, no
fast-math, blocked lane sums in the order of :func:`kvstore.codecs.quantize.blocked_sum_reference`.

Shape of an encode: the reductions first (terngrad: one pass over the chunk; qsgd: a bucket's
norm right before its codes, so the bucket is still in L1 cache), then blocks of
:data:`BLOCK` elements, each written as one code byte per element into a small scratch array
and then packed eight codes at a time (2-bit codes four per byte with one multiply). A decode
unpacks a block into the scratch the same way and turns the code bytes into floats.

What keeps the loops vectorized (each measured on 16M elements; an unvectorized loop is 2-4x
slower): element loops index slices from 0 (``out = codes[:m]; out[k]``: an offset index
``packed[first + k]`` brings numba's negative-index wraparound into the loop), conditional
values are chains of plain selects rather than nested conditional expressions, and the lane
loops of the blocked sums step two rows at a time over lanes on the stack (see below).

The generator's uniforms come from :func:`kvstore.codecs.quantize.numba_kernels.uniform` (its
hash in 32-bit lanes). A building block of their own:

* :func:`load_word` / :func:`store_word` read and write eight bytes at any byte offset, so a
  group of eight ``w``-bit codes (``w`` bytes) moves with one 8-byte access: groups are
  stored in order, each store's ``8 - w`` zero bytes being overwritten by the next group's,
  and only the groups within 8 bytes of the stream's end go byte by byte.

The packed words are little-endian, like the stream format; on a big-endian machine the codecs
use the numpy references instead.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)
from kvstore.codecs.quantize.numba_kernels import combine_lanes, lane_sum, stack_lanes, uniform

LANES = 32
SUM_BLOCK = 4096  # kvstore.codecs.quantize.SUM_BLOCK
BLOCK = 4096
"""Elements per encode/decode block: a multiple of 8 (whole groups of codes), 4 KiB of code
bytes and 16 KiB of floats, within L1 cache."""


_BYTE = np.uint64(0xFF)
_PACK_PAIRS = np.uint32(0x01041040)


# unaligned 8-byte access ---------------------------------------------------------------------


def _word_pointer(context, builder, array_type, array, offset_type, offset):
    data = context.make_array(array_type)(context, builder, array).data
    index = context.cast(builder, offset, offset_type, types.intp)
    return builder.bitcast(builder.gep(data, [index]), ir.IntType(64).as_pointer())


@intrinsic
def load_word(typingctx, data, offset):
    """The eight bytes ``data[offset : offset + 8]`` of a uint8 array as a little-endian uint64
    (any alignment; the caller keeps ``offset + 8 <= data.size``)."""
    if not (isinstance(data, types.Array) and data.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        pointer = _word_pointer(
            context, builder, signature.args[0], args[0], signature.args[1], args[1]
        )
        return builder.load(pointer, align=1)

    return types.uint64(data, offset), codegen


@intrinsic
def store_word(typingctx, data, offset, value):
    """Write uint64 ``value`` little-endian into ``data[offset : offset + 8]`` (any alignment;
    the caller keeps ``offset + 8 <= data.size``)."""
    if not (isinstance(data, types.Array) and data.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        pointer = _word_pointer(
            context, builder, signature.args[0], args[0], signature.args[1], args[1]
        )
        word = context.cast(builder, args[2], signature.args[2], types.uint64)
        builder.store(word, pointer, align=1)
        return context.get_dummy_value()

    return types.none(data, offset, value), codegen


# packing eight codes per group ---------------------------------------------------------------


@njit(nogil=True, cache=True, inline="always")
def _squeeze(word, width):
    """Eight codes held one per byte (code ``k`` at bit ``8k``) moved to bits ``k * width``:
    odd codes of each byte pair shift down first, then the pairs, then the halves."""
    w = np.uint64(width)
    pairs = (word & np.uint64(0x00FF00FF00FF00FF)) | (
        (word & np.uint64(0xFF00FF00FF00FF00)) >> (np.uint64(8) - w)
    )
    quads = (pairs & np.uint64(0x0000FFFF0000FFFF)) | (
        (pairs & np.uint64(0xFFFF0000FFFF0000)) >> (np.uint64(16) - np.uint64(2) * w)
    )
    return (quads & np.uint64(0xFFFFFFFF)) | ((quads >> np.uint64(32)) << (np.uint64(4) * w))


@njit(nogil=True, cache=True, inline="always")
def _spread(word, width):
    """The inverse of :func:`_squeeze`: eight ``width``-bit codes back to one per byte."""
    w = np.uint64(width)
    one = np.uint64(1)
    half_mask = (one << (np.uint64(4) * w)) - one
    quads = (word & half_mask) | ((word >> (np.uint64(4) * w)) << np.uint64(32))
    pair_mask = ((one << (np.uint64(2) * w)) - one) * np.uint64(0x0000000100000001)
    pairs = (quads & pair_mask) | (((quads >> (np.uint64(2) * w)) & pair_mask) << np.uint64(16))
    code_mask = ((one << w) - one) * np.uint64(0x0001000100010001)
    return (pairs & code_mask) | (((pairs >> w) & code_mask) << np.uint64(8))


@njit(nogil=True, cache=True, inline="always")
def _pack_pairs(codes, count, packed, first_byte):
    """2-bit codes, four per byte, with one multiply: read as a little-endian uint32, four
    code bytes are ``c0 | c1 << 8 | c2 << 16 | c3 << 24``, and bits 24..31 of that times
    ``2**24 + 2**18 + 2**12 + 2**6`` are ``c0 | c1 << 2 | c2 << 4 | c3 << 6`` (the other
    partial products stay below bit 24 or go above bit 31)."""
    quads = codes.view(np.uint32)
    out = packed[first_byte : first_byte + (count + 3) // 4]  # a slice: no index wraparound
    for j in range(out.shape[0]):
        out[j] = np.uint8((quads[j] * _PACK_PAIRS) >> np.uint64(24))


@njit(nogil=True, cache=True, inline="always")
def _unpack_pairs(packed, first_byte, count, codes):
    """The inverse of :func:`_pack_pairs`: each byte's four codes into four code bytes."""
    quads = codes.view(np.uint32)
    source = packed[first_byte : first_byte + (count + 3) // 4]
    for j in range(source.shape[0]):
        b = np.uint32(source[j])
        quads[j] = (b | (b << np.uint32(6)) | (b << np.uint32(12)) | (b << np.uint32(18))) & (
            np.uint32(0x03030303)
        )


@njit(nogil=True, cache=True)
def pack_block(codes, count, packed, first_group, width, groups):
    """Pack ``codes[:count]`` (one code per byte, below ``2**width``) as groups ``first_group``
    on of the stream ``packed``; ``codes`` must be zero from ``count`` to the next multiple of
    8. ``groups``: uint64 scratch of ``len(codes) // 8``."""
    if width == 2:
        _pack_pairs(codes, count, packed, 2 * first_group)
        return
    ngroups = (count + 7) // 8
    words = codes.view(np.uint64)
    for k in range(ngroups):
        groups[k] = _squeeze(words[k], width)
    # groups whose 8-byte store stays inside the stream, then the last few byte by byte
    nbytes = packed.shape[0]
    whole = min(ngroups, max(0, (nbytes - 8) // width + 1 - first_group))
    base = first_group * width
    for k in range(whole):
        store_word(packed, base + k * width, groups[k])
    for k in range(whole, ngroups):
        at = base + k * width
        for b in range(min(width, nbytes - at)):
            packed[at + b] = np.uint8((groups[k] >> np.uint64(8 * b)) & _BYTE)


@njit(nogil=True, cache=True)
def unpack_block(packed, first_group, count, width, codes):
    """Codes ``8 * first_group`` .. ``+ count`` of the stream ``packed`` into ``codes`` (one per
    byte; the last group's codes past ``count`` are whatever the stream holds there)."""
    if width == 2:
        _unpack_pairs(packed, 2 * first_group, count, codes)
        return
    ngroups = (count + 7) // 8
    words = codes.view(np.uint64)
    nbytes = packed.shape[0]
    whole = min(ngroups, max(0, (nbytes - 8) // width + 1 - first_group))
    base = first_group * width
    mask = (np.uint64(1) << np.uint64(8 * width)) - np.uint64(1) if width < 8 else ~np.uint64(0)
    for k in range(whole):
        words[k] = load_word(packed, base + k * width) & mask
    for k in range(whole, ngroups):
        at = base + k * width
        word = np.uint64(0)
        for b in range(min(width, nbytes - at)):
            word |= np.uint64(packed[at + b]) << np.uint64(8 * b)
        words[k] = word
    for k in range(ngroups):
        words[k] = _spread(words[k], width)


@njit(nogil=True, cache=True, inline="always")
def _pad_codes(codes, count):
    """Zero ``codes`` from ``count`` to the end of its group of eight."""
    for k in range(count, (count + 7) // 8 * 8):
        codes[k] = 0


# blocked lane sums ---------------------------------------------------------------------------
#
# The lanes are stack arrays (``quantize.numba_kernels.stack_lanes``: 32 of them, kept in vector
# registers across the rows; a bucket narrower than 32 passes a slice of them) and the loops take
# their trip count from ``lanes.shape[0]``. Two rows per step keep the loop vectorized with a
# count LLVM sees as the constant 32: one row per step gets fully unrolled into scalar code
# before the loop vectorizer runs (qsgd's norms in L2 cache: 420 instead of 145 ps per element).
# Each lane still adds its terms in index order.


@njit(nogil=True, cache=True, inline="always")
def _add_squares(block, lanes):
    """``lanes[j % 32] += float64(x) * float64(x)`` for the elements ``x = block[j]`` in
    order (``block``: at most one SUM_BLOCK)."""
    width = lanes.shape[0]
    n = block.shape[0]
    rows = n // width
    for r in range(0, rows - 1, 2):
        row = block[r * width : r * width + width]
        nxt = block[r * width + width : r * width + 2 * width]
        for lane in range(width):
            w = np.float64(row[lane])
            v = np.float64(nxt[lane])
            lanes[lane] = (lanes[lane] + w * w) + v * v
    for i in range((rows - rows % 2) * width, n):  # an odd last row, then the partial one
        w = np.float64(block[i])
        lanes[i % width] += w * w


@njit(nogil=True, cache=True, inline="always")
def _add_moments(block, lanes, lane_squares, top):
    """:func:`_add_squares` into ``lane_squares``, the plain values into ``lanes``, and each
    lane's largest ``abs`` into float32 ``top`` (an elementwise select: no order needed)."""
    width = lanes.shape[0]
    n = block.shape[0]
    rows = n // width
    for r in range(0, rows - 1, 2):
        row = block[r * width : r * width + width]
        nxt = block[r * width + width : r * width + 2 * width]
        for lane in range(width):
            x = row[lane]
            y = nxt[lane]
            w = np.float64(x)
            v = np.float64(y)
            lanes[lane] = (lanes[lane] + w) + v
            lane_squares[lane] = (lane_squares[lane] + w * w) + v * v
            m = abs(x)
            m = abs(y) if abs(y) > m else m
            top[lane] = m if m > top[lane] else top[lane]
    for i in range((rows - rows % 2) * width, n):
        x = block[i]
        w = np.float64(x)
        lanes[i % width] += w
        lane_squares[i % width] += w * w
        top[i % width] = abs(x) if abs(x) > top[i % width] else top[i % width]


# terngrad ------------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def _largest_magnitude_bits(bits):
    """The largest ``abs`` of float32 values given as their uint32 bits (finite values: the
    bits of non-negative floats order like the floats), as bits."""
    top = np.uint32(0)
    for i in range(bits.shape[0]):
        m = bits[i] & np.uint32(0x7FFFFFFF)
        top = m if m > top else top
    return top


@njit(nogil=True, cache=True)
def terngrad_scale(grad, clip):
    """The chunk's scale ``s`` (float32): ``max(abs(g))``, capped at ``float32(clip * sigma)``
    when ``clip > 0``; ``+0.0`` for an empty or all-zero chunk. ``grad``: contiguous, finite."""
    n = grad.shape[0]
    if n == 0:
        return np.float32(0.0)
    if clip > 0.0:
        nblocks = (n + SUM_BLOCK - 1) // SUM_BLOCK
        sums = np.empty(nblocks)
        squares = np.empty(nblocks)
        lanes = stack_lanes(32, np.float64)  # on the stack: kept in registers
        lane_squares = stack_lanes(32, np.float64)
        top = stack_lanes(32, np.float32)
        top[:] = 0.0
        for b in range(nblocks):
            lanes[:] = 0.0
            lane_squares[:] = 0.0
            start = b * SUM_BLOCK
            _add_moments(grad[start : min(n, start + SUM_BLOCK)], lanes, lane_squares, top)
            sums[b] = combine_lanes(lanes)
            squares[b] = combine_lanes(lane_squares)
        s = np.float32(0.0)
        for lane in range(LANES):
            s = top[lane] if top[lane] > s else s
        mean = lane_sum(sums) / n
        var = lane_sum(squares) / n - mean * mean
        var = var if var > 0.0 else 0.0
        limit = np.float32(clip * np.sqrt(var))
        s = limit if limit < s else s
    else:
        top_bits = _largest_magnitude_bits(grad.view(np.uint32))
        s = np.array([top_bits], dtype=np.uint32).view(np.float32)[0]
    return s if s > 0 else np.float32(0.0)


@njit(nogil=True, cache=True)
def terngrad_codes(grad, s, lo, hi, start, packed):
    """Write the 2-bit codes of ``grad`` with scale ``s`` into ``packed``: element ``j`` sends
    ``sign(g)`` (code 1: +s, 2: -s) iff ``u * s < min(abs(g), s)`` with ``u`` the uniform of
    element ``start + j``; all zero when ``s == 0``."""
    s = np.float32(s)  # a float64 ``s`` would make ``u * s`` exact instead of float32
    n = grad.shape[0]
    if s == 0:
        packed[:] = 0
        return
    codes = np.zeros(BLOCK, dtype=np.uint8)
    groups = np.empty(BLOCK // 8, dtype=np.uint64)
    for b0 in range(0, n, BLOCK):
        m = min(BLOCK, n - b0)
        block = grad[b0 : b0 + m]  # slices and plain selects: the loop vectorizes
        out = codes[:m]
        first = start + b0
        for k in range(m):
            x = block[k]
            a = abs(x)
            a = s if a > s else a
            code = np.uint8(2)
            code = np.uint8(1) if x > 0 else code
            out[k] = code if uniform(lo, hi, first, k) * s < a else np.uint8(0)
        _pad_codes(codes, m)
        pack_block(codes, m, packed, b0 // 8, 2, groups)


@njit(nogil=True, cache=True)
def terngrad_decode(s, packed, n, out, accumulate):
    """Codes 1 -> ``+s``, 2 -> ``-s``, anything else -> ``+0.0``; written into, or added to,
    float32 ``out[:n]``."""
    s = np.float32(s)
    codes = np.empty(BLOCK, dtype=np.uint8)
    minus = -s
    zero = np.float32(0.0)
    for b0 in range(0, n, BLOCK):
        m = min(BLOCK, n - b0)
        unpack_block(packed, b0 // 8, m, 2, codes)
        target = out[b0 : b0 + m]
        for k in range(m):
            c = codes[k]
            value = zero
            value = s if c == 1 else value
            value = minus if c == 2 else value
            if accumulate:
                target[k] += value
            else:
                target[k] = value


@njit(nogil=True, cache=True)
def count_codes_at_least(packed, n, width, smallest):
    """How many of the ``n`` codes of a packed stream are ``>= smallest``."""
    codes = np.empty(BLOCK, dtype=np.uint8)
    total = 0
    for b0 in range(0, n, BLOCK):
        m = min(BLOCK, n - b0)
        unpack_block(packed, b0 // 8, m, width, codes)
        for k in range(m):
            total += 1 if codes[k] >= smallest else 0
    return total


# qsgd ----------------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def bucket_norm(values, partials):
    """``float32(sqrt(blocked lane sum of float64(v) * float64(v)))`` of the bucket
    ``values`` (``partials``: float64 scratch of one entry per SUM_BLOCK block of the
    bucket)."""
    n = values.shape[0]
    nsub = (n + SUM_BLOCK - 1) // SUM_BLOCK
    lanes = stack_lanes(32, np.float64)
    for sub in range(nsub):
        lanes[:] = 0.0
        _add_squares(values[sub * SUM_BLOCK : min(n, sub * SUM_BLOCK + SUM_BLOCK)], lanes)
        partials[sub] = combine_lanes(lanes)
    # the lane sum of one block sum is that sum (lane 0 = +0.0 + x, the other lanes +0.0)
    total = partials[0] if nsub == 1 else lane_sum(partials[:nsub])
    return np.float32(np.sqrt(total))


@njit(nogil=True, cache=True)
def small_bucket_norms(values, bucket, norms, flipped, totals):
    """:func:`bucket_norm` of every bucket of ``values`` (``bucket <= SUM_BLOCK``: one block
    each) into ``norms``, the lanes of all buckets combined together: lane 0 of every bucket,
    then lane 1..., so the 32 dependent adds of a lane sum run once per batch, vectorized
    across buckets. Scratch: ``flipped`` (``min(bucket, 32)``, >= buckets: bucket ``q``'s
    lanes in column ``q``) and ``totals`` (>= buckets). Lanes a bucket shorter than 32 does
    not reach stay +0.0 and change no sum."""
    n = values.shape[0]
    count = (n + bucket - 1) // bucket
    width = flipped.shape[0]
    lanes = stack_lanes(32, np.float64)
    if width == LANES:  # 32 lanes LLVM can see: it keeps them in registers
        for q in range(count):
            lanes[:] = 0.0
            _add_squares(values[q * bucket : min(n, q * bucket + bucket)], lanes)
            for lane in range(LANES):
                flipped[lane, q] = lanes[lane]
    else:  # buckets of fewer than 32 elements: one row each
        few = lanes[:width]
        for q in range(count):
            few[:] = 0.0
            _add_squares(values[q * bucket : min(n, q * bucket + bucket)], few)
            for lane in range(width):
                flipped[lane, q] = few[lane]
    sums = totals[:count]
    sums[:] = 0.0
    for lane in range(width):
        terms = flipped[lane, :count]
        for q in range(count):
            sums[q] += terms[q]
    out = norms[:count]
    for q in range(count):
        out[q] = np.float32(np.sqrt(sums[q]))


@njit(nogil=True, cache=True)
def qsgd_encode(values, levels, bucket, lo, hi, start, norms, packed, width):
    """Write each bucket's norm into ``norms`` and the codes ``(level << 1) | neg`` into
    ``packed`` (``width`` bits each); see :mod:`kvstore.codecs.stochastic.qsgd` for the arithmetic.

    A bucket's norm is computed right before its first codes, so its values are still in L1
    cache for them; buckets of at most SUM_BLOCK elements have theirs computed a block's worth
    at a time (:func:`small_bucket_norms`: the 32 dependent adds of each lane sum vectorized
    across buckets; bucket 512, norms in L2 cache: 145 instead of 167 ps per element)."""
    n = values.shape[0]
    top = np.float32(levels)
    top_level = np.int32(levels)
    one = np.float32(1.0)
    codes = np.zeros(BLOCK, dtype=np.uint8)
    groups = np.empty(BLOCK // 8, dtype=np.uint64)
    batched = bucket <= SUM_BLOCK
    most = BLOCK // bucket + 1 if batched else 1  # buckets starting in one block
    flipped = np.empty((min(bucket, LANES), most))
    totals = np.empty(most)
    partials = np.empty((min(bucket, max(n, 1)) + SUM_BLOCK - 1) // SUM_BLOCK)
    normed = 0  # buckets whose norm is written
    for b0 in range(0, n, BLOCK):
        b1 = min(n, b0 + BLOCK)
        if batched:
            first = (b0 + bucket - 1) // bucket  # the buckets starting in [b0, b1)
            normed = (b1 + bucket - 1) // bucket
            chunk = values[first * bucket : min(n, normed * bucket)]
            small_bucket_norms(chunk, bucket, norms[first:normed], flipped, totals)
        i = b0
        while i < b1:
            q = i // bucket
            stop = min(b1, q * bucket + bucket)
            if q == normed:
                chunk = values[q * bucket : min(n, q * bucket + bucket)]  # i == q * bucket
                norms[q] = bucket_norm(chunk, partials)
                normed += 1
            norm = norms[q]
            segment = values[i:stop]
            out = codes[i - b0 : stop - b0]
            if norm == 0:
                out[:] = 0
            else:
                inv = top / norm
                base = start + i
                for k in range(stop - i):
                    x = segment[k]
                    t = abs(x) * inv + uniform(lo, hi, base, k)
                    level = np.int32(0)  # t NaN (0 * inf) or below 1
                    level = np.int32(t) if t >= one else level
                    level = top_level if t >= top else level
                    neg = np.int32(1) if x < 0 else np.int32(0)
                    neg = neg if level > 0 else np.int32(0)
                    out[k] = np.uint8((level << 1) | neg)
            i = stop
        _pad_codes(codes, b1 - b0)
        pack_block(codes, b1 - b0, packed, b0 // 8, width, groups)


@njit(nogil=True, cache=True)
def qsgd_decode(norms, levels, bucket, packed, n, width, out, accumulate):
    """Code ``(level << 1) | neg`` -> ``-+(step * float32(level))``, ``step = norm /
    float32(levels)`` of the element's bucket; level 0 -> ``+0.0``. Written into, or added to,
    float32 ``out[:n]``."""
    top = np.float32(levels)
    codes = np.empty(BLOCK, dtype=np.uint8)
    zero = np.float32(0.0)
    for b0 in range(0, n, BLOCK):
        b1 = min(n, b0 + BLOCK)
        unpack_block(packed, b0 // 8, b1 - b0, width, codes)
        i = b0
        while i < b1:
            q = i // bucket
            stop = min(b1, q * bucket + bucket)
            step = norms[q] / top
            segment = codes[i - b0 : stop - b0]
            target = out[i:stop]
            for k in range(stop - i):
                c = segment[k]
                magnitude = step * np.float32(c >> 1)
                value = -magnitude if c & 1 else magnitude
                value = value if c >= 2 else zero
                if accumulate:
                    target[k] += value
                else:
                    target[k] = value
            i = stop
