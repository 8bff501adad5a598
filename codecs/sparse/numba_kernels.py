"""Compiled CPU kernels of the sparse codec family (numba, GIL released, cached on disk).

Same results, bit for bit, as the numpy references in :mod:`kvstore.codecs.sparse.threshold`,
:mod:`~kvstore.codecs.sparse.topk`, :mod:`~kvstore.codecs.sparse.randomk`,
:mod:`~kvstore.codecs.sparse.dgc` and :mod:`~kvstore.codecs.sparse.topk2bit`;
:mod:`kvstore.codecs.sparse` strings them together. Compiled without fast-math, so every float32
operation rounds like numpy's (no reassociation, no fused multiply-add).

The passes over a whole key work in blocks of :data:`BLOCK` elements: a plain loop that LLVM
vectorizes updates the block (``r += g``, or DGC's momentum) and writes one flag byte per element
into a scratch array that stays in L1 cache; a second loop finds the set flags eight at a time
(one 64-bit word per eight flags, mostly zero at the densities these codecs use) and appends
their indices. Memory is streamed once.

"Accumulation" ``kind``: 0 is error feedback (``a`` is the residual ``r``, ``b`` unused:
``r += g``); 1 is DGC's momentum correction (``a`` is the momentum ``u``, ``b`` the velocity
``v``: ``u = m*u + s*g; v += u``, or with Nesterov ``u = m*(u + s*g); v = (v + u) + s*g``, where
``s`` is the clipping scale). Either way the returned value ``x`` is what gets selected from and
sent (``r`` or ``v``).

Magnitudes are ordered by their *keys*: the float32 bits of ``abs(x)`` as an unsigned integer
(``bits & 0x7fffffff``), which order exactly like the magnitudes themselves (NaN never gets
here: the encoders refuse it first). Exact top-k finds the k-th largest key by a three-level
radix select (11, 11 and 9 bits; one histogram pass per level).
"""

from __future__ import annotations

import numpy as np
from numba import njit

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)

BLOCK = 2048
"""Elements per block of a streaming pass: 8 KiB of floats per stream, 2 KiB of flags."""

_ABS = np.uint32(0x7FFFFFFF)
_SHIFTS = (20, 9, 0)
_WIDTHS = (11, 11, 9)

_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_BIT = np.zeros(64, dtype=np.int64)
for _bit in range(64):
    _DEBRUIJN_BIT[((int(_DEBRUIJN) << _bit) & 0xFFFFFFFFFFFFFFFF) >> 58] = _bit
"""The position of the single set bit of ``w``: ``_DEBRUIJN_BIT[(w * _DEBRUIJN) >> 58]``."""


# the per-element update --------------------------------------------------------------------


@njit(nogil=True, cache=True, inline="always")
def _update(kind, a, b, g, i, m, s, nesterov):
    """Update element ``i`` of the state from ``g[i]``; return the value to select from."""
    if kind == 0:
        x = a[i] + g[i]
        a[i] = x
        return x
    gi = g[i] * s
    if nesterov:
        u = m * (a[i] + gi)
        x = (b[i] + u) + gi
    else:
        u = m * a[i] + gi
        x = b[i] + u
    a[i] = u
    b[i] = x
    return x


@njit(nogil=True, cache=True, inline="always")
def _peek(kind, a, b, g, i, m, s, nesterov):
    """What :func:`_update` would return for element ``i``, without changing anything."""
    if kind == 0:
        return a[i] + g[i]
    gi = g[i] * s
    if nesterov:
        u = m * (a[i] + gi)
        return (b[i] + u) + gi
    u = m * a[i] + gi
    return b[i] + u


@njit(nogil=True, cache=True)
def accumulate(kind, a, b, g, m, s, nesterov):
    """Update every element (no selection)."""
    for i in range(g.shape[0]):
        _update(kind, a, b, g, i, m, s, nesterov)


@njit(nogil=True, cache=True)
def sample_magnitudes(kind, a, b, g, m, s, nesterov, start, stride, out):
    """``out[j] = abs(x)`` of element ``start + j * stride`` as the coming update will make it
    (the state is not changed), for ``j < out.shape[0]``."""
    for j in range(out.shape[0]):
        out[j] = abs(_peek(kind, a, b, g, start + j * stride, m, s, nesterov))


# streaming passes with selection -----------------------------------------------------------


@njit(nogil=True, cache=True, inline="always")
def _lowest_bit(word):
    """The position of the lowest set bit of a nonzero uint64, by De Bruijn multiplication."""
    low = word & (~word + np.uint64(1))
    return _DEBRUIJN_BIT[(low * _DEBRUIJN) >> np.uint64(58)]


@njit(nogil=True, cache=True, inline="always")
def _take_flagged(flags, xb, base, idx, val, c):
    """For every set ``flags[j]``, in order: append ``base + j`` to ``idx`` and ``xb[j]`` to
    ``val`` (from position ``c``) and zero ``xb[j]``, as long as there is room; return the new
    length, which counts the flagged entries that did not fit too (those are left as they
    are). Flags are read eight at a time as a uint64 whose set bits are the flagged bytes."""
    words = flags.view(np.uint64)
    cap = idx.shape[0]
    count = xb.shape[0]
    full = count // 8
    for w in range(full):
        word = words[w]
        while word != np.uint64(0):
            j = 8 * w + (_lowest_bit(word) >> 3)
            if c < cap:
                idx[c] = base + j
                val[c] = xb[j]
                xb[j] = 0
            c += 1
            word &= word - np.uint64(1)
    for j in range(8 * full, count):
        if flags[j]:
            if c < cap:
                idx[c] = base + j
                val[c] = xb[j]
                xb[j] = 0
            c += 1
    return c


@njit(nogil=True, cache=True)
def accumulate_take(kind, a, b, g, m, s, nesterov, thr, idx, val):
    """Update every element, and take every element whose new ``abs(x) >= thr``: its index
    and value go into ``idx``/``val`` (ascending, as many as fit) and ``x`` there is zeroed
    (``x`` is ``a`` for error feedback, ``b`` for DGC). Returns how many passed in all.

    Taking in the pass saves a second visit of every selected element; when the caller then
    rejects the selection it puts the values back (:func:`untake`), bit for bit.
    """
    n = g.shape[0]
    flags = np.zeros(BLOCK, dtype=np.uint8)
    one, zero = np.uint8(1), np.uint8(0)
    c = 0
    for start in range(0, n, BLOCK):
        stop = min(n, start + BLOCK)
        # Block views with indices from 0: the loop then vectorizes (with ``start + j``
        # numba cannot rule out negative indices and keeps the loop scalar, 4x slower).
        ab, bb, gb = a[start:stop], b[start:stop], g[start:stop]
        hits = 0
        if kind == 0:
            for j in range(stop - start):
                x = ab[j] + gb[j]
                ab[j] = x
                f = one if abs(x) >= thr else zero
                flags[j] = f
                hits += f
            if hits:
                c = _take_flagged(flags, ab, start, idx, val, c)
        else:
            for j in range(stop - start):
                x = _update(kind, ab, bb, gb, j, m, s, nesterov)
                f = one if abs(x) >= thr else zero
                flags[j] = f
                hits += f
            if hits:
                c = _take_flagged(flags, bb, start, idx, val, c)
    return c


@njit(nogil=True, cache=True)
def untake(x, idx, val, count):
    """Undo :func:`accumulate_take`'s taking: ``x[idx[j]] = val[j]`` for ``j < count``."""
    for j in range(count):
        x[idx[j]] = val[j]


@njit(nogil=True, cache=True)
def clear(x, idx, count):
    """``x[idx[j]] = 0`` for ``j < count`` (DGC's momentum factor masking)."""
    for j in range(count):
        x[idx[j]] = 0


@njit(nogil=True, cache=True)
def threshold_pass(r, g, t, idx, val, c, start):
    """The ``threshold`` codec from element ``start`` (a multiple of :data:`BLOCK`) on:
    ``r += g``; every ``abs(r[i]) >= t`` is appended to ``idx``/``val`` (from position ``c``)
    and zeroed.

    Stops before a block when fewer than :data:`BLOCK` entries of room are left, so that no
    block is ever half done. Returns ``(c, stop)``: the new length, and where to go on from
    after growing the buffers (``stop == n`` when done).
    """
    n = g.shape[0]
    flags = np.zeros(BLOCK, dtype=np.uint8)
    one, zero = np.uint8(1), np.uint8(0)
    cap = idx.shape[0]
    for block_start in range(start, n, BLOCK):
        if cap - c < BLOCK:
            return c, block_start
        stop = min(n, block_start + BLOCK)
        rb, gb = r[block_start:stop], g[block_start:stop]
        hits = 0
        for j in range(stop - block_start):
            x = rb[j] + gb[j]
            rb[j] = x
            f = one if abs(x) >= t else zero
            flags[j] = f
            hits += f
        if hits:
            c = _take_flagged(flags, rb, block_start, idx, val, c)
    return c, n


# exact selection: the k-th largest magnitude -----------------------------------------------


@njit(nogil=True, cache=True, inline="always")
def _pick(hist, need):
    """The bin (from the top) holding the ``need``-th largest entry, and its rank within it."""
    below = 0
    for bin_ in range(hist.shape[0] - 1, -1, -1):
        h = hist[bin_]
        if below + h >= need:
            return bin_, need - below
        below += h
    return 0, need  # (never reached when need <= the number of entries)


@njit(nogil=True, cache=True)
def kth_largest(x, k, idx=None, m=0):
    """The key of the ``k``-th largest ``abs(x)`` and how many entries with exactly that key
    the top ``k`` hold (those above it are all in). Over all of ``x`` (``1 <= k <= len(x)``),
    or over ``x[idx[:m]]`` (``1 <= k <= m``). ``idx is None`` is decided when numba compiles
    the function, so the whole-array version has no per-element branch."""
    bits = x.view(np.uint32)
    n = bits.shape[0] if idx is None else m
    hist = np.zeros(2048, dtype=np.int64)
    prefix = np.uint32(0)
    need = k
    for level in range(3):
        shift = np.uint32(_SHIFTS[level])
        above = np.uint32(_SHIFTS[level] + _WIDTHS[level])
        mask = np.uint32((1 << _WIDTHS[level]) - 1)
        hist[:] = 0
        for j in range(n):
            if idx is None:
                i = j
            else:
                i = idx[j]
            key = bits[i] & _ABS
            if (key >> above) == prefix:
                hist[(key >> shift) & mask] += 1
        bin_, need = _pick(hist, need)
        prefix = (prefix << np.uint32(_WIDTHS[level])) | np.uint32(bin_)
    return prefix, need


@njit(nogil=True, cache=True)
def select_top(x, key, quota, out, idx=None, m=0):
    """The top-k given its k-th key (:func:`kth_largest`): every index whose key is above
    ``key``, and the first ``quota`` (lowest indices) whose key equals it, ascending, into
    ``out``. Returns how many. Over all of ``x``, or among the ascending indices ``idx[:m]``
    (``out`` may be ``idx``)."""
    bits = x.view(np.uint32)
    n = bits.shape[0] if idx is None else m
    c = 0
    taken = 0
    for j in range(n):
        if idx is None:
            i = j
        else:
            i = idx[j]
        k = bits[i] & _ABS
        if k > key:
            out[c] = i
            c += 1
        elif k == key and taken < quota:
            out[c] = i
            c += 1
            taken += 1
    return c


@njit(nogil=True, cache=True)
def take_and_clear(x, other, clear_other, idx, count, val):
    """``val[j] = x[idx[j]]``, then ``x[idx[j]] = 0`` (and ``other[idx[j]] = 0`` when
    ``clear_other``: DGC's momentum factor masking), for ``j < count``."""
    for j in range(count):
        i = idx[j]
        val[j] = x[i]
        x[i] = 0
        if clear_other:
            other[i] = 0


# random-k: a keyed permutation -------------------------------------------------------------

_M32 = np.uint64(0xFFFFFFFF)


@njit(nogil=True, cache=True, inline="always")
def _hash32(x):
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & _M32
    return x ^ (x >> np.uint64(16))


@njit(nogil=True, cache=True)
def permuted_prefix(n, half_bits, round_keys, out):
    """``out[j]`` = the image of ``j`` under the keyed permutation of ``[0, n)`` (a Feistel
    network on ``2 * half_bits`` bits, cycle-walking back into range), for
    ``j < out.shape[0]``; see :func:`kvstore.codecs.sparse.randomk.permuted_prefix_reference`."""
    half = np.uint64(half_bits)
    mask = np.uint64((1 << half_bits) - 1)
    limit = np.uint64(n)
    for j in range(out.shape[0]):
        y = np.uint64(j)
        while True:
            left = y >> half
            right = y & mask
            for r in range(round_keys.shape[0]):
                left, right = right, left ^ (_hash32(right ^ round_keys[r]) & mask)
            y = (left << half) | right
            if y < limit:
                break
        out[j] = y


@njit(nogil=True, cache=True)
def sort_distinct(values, n, out):
    """``out`` = the distinct ``values`` (each in ``[0, n)``) in ascending order, through a
    bitmap of ``n`` bits (faster than a comparison sort for the ``k`` indices of random-k).
    Returns how many."""
    bitmap = np.zeros((n + 63) // 64, dtype=np.uint64)
    for j in range(values.shape[0]):
        v = np.uint64(values[j])
        bitmap[v >> np.uint64(6)] |= np.uint64(1) << (v & np.uint64(63))
    c = 0
    for w in range(bitmap.shape[0]):
        word = bitmap[w]
        while word != 0:
            out[c] = 64 * w + _lowest_bit(word)
            c += 1
            word &= word - np.uint64(1)
    return c


# server side -------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def scatter_add(acc, idx, val):
    """``acc[idx[j]] += val[j]`` in order (indices checked by the caller)."""
    for j in range(idx.shape[0]):
        acc[idx[j]] += val[j]


@njit(nogil=True, cache=True)
def first_unordered(idx):
    """The first position ``j`` with ``idx[j] <= idx[j-1]``, or -1 when strictly ascending."""
    for j in range(1, idx.shape[0]):
        if idx[j] <= idx[j - 1]:
            return j
    return -1


# topk2bit: two bits per selected value ----------------------------------------------------


@njit(nogil=True, cache=True)
def magnitude_range(val):
    """``(min(abs(val)), max(abs(val)))`` as float32 (``(0, 0)`` when ``val`` is empty)."""
    n = val.shape[0]
    if n == 0:
        return np.float32(0), np.float32(0)
    lo = np.float32(abs(val[0]))
    hi = lo
    for j in range(1, n):
        m = np.float32(abs(val[j]))
        if m < lo:
            lo = m
        if m > hi:
            hi = m
    return lo, hi


@njit(nogil=True, cache=True)
def quantize_2bit(val, mid, low, high, codes, decoded):
    """Code ``j`` in bits ``2 * (j % 4)`` of byte ``j // 4``: bit 0 ``abs(val[j]) >= mid``,
    bit 1 ``val[j] < 0``; ``decoded[j]`` is ``high`` or ``low`` with that sign. The unused
    bits of the last byte are 0 (see :mod:`kvstore.codecs.sparse.topk2bit`)."""
    n = val.shape[0]
    for b in range((n + 3) // 4):
        codes[b] = 0
    for j in range(n):
        v = val[j]
        big = abs(v) >= mid
        negative = v < 0
        code = (1 if big else 0) | (2 if negative else 0)
        codes[j >> 2] |= np.uint8(code << (2 * (j & 3)))
        magnitude = high if big else low
        decoded[j] = -magnitude if negative else magnitude


@njit(nogil=True, cache=True)
def decode_2bit(codes, low, high, out):
    """The values of :func:`quantize_2bit`'s codes: ``out[j]`` is ``high`` (bit 0 set) or
    ``low``, negated when bit 1 is set."""
    for j in range(out.shape[0]):
        code = (np.int64(codes[j >> 2]) >> (2 * (j & 3))) & 3
        magnitude = high if code & 1 else low
        out[j] = -magnitude if code & 2 else magnitude


# DGC's clipping norm -----------------------------------------------------------------------


@njit(nogil=True, cache=True)
def blocked_sum_of_squares(g, block):
    """``sum(g**2)`` in float64: each block of ``block`` elements summed in order, then the
    block sums in order (see :func:`kvstore.codecs.sparse.dgc.sum_of_squares_reference`)."""
    total = 0.0
    n = g.shape[0]
    for start in range(0, n, block):
        partial = 0.0
        for i in range(start, min(n, start + block)):
            v = np.float64(g[i])
            partial += v * v
        total += partial
    return total
