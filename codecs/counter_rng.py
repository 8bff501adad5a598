"""The codecs' one source of randomness: a counter-based generator with no state to carry.

Every random number a codec draws is a pure function of integers, so the numpy reference, the
numba kernels and the CuPy kernels draw the same numbers, a run repeats exactly with the same
seed, and a checkpoint only needs the push count:

* :func:`counter_hash` hashes a tuple of words (``seed, key, step, purpose...``) into a 64-bit
  *stream key*, with SplitMix64's finalizer applied once per word. ``randomk`` derives its
  permutation's round keys from it (the same indices on every worker); ``terngrad`` and
  ``qsgd`` include the worker's rank (:func:`stream_key`), because stochastic rounding with the
  same noise on every worker would not average out on the server.
* :func:`uniforms_reference` turns a stream key and an element index ``i`` (the element's
  index in the whole key, so chunking changes nothing) into a float32 uniform in ``[0, 1)``::

      lo, hi = key & 0xFFFFFFFF, key >> 32
      h = hash32((hash32(i ^ lo) + hi) mod 2**32)
      u = (h >> 8) * 2**-24                       (exact in float32)

  where :func:`hash32` is a 32-bit integer finalizer (xor-shift-multiply, bijective): cheap in
  32-bit SIMD lanes, which a 64-bit mix per element is not.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
UNIFORM_SCALE = np.float32(2.0**-24)
"""``u = (h >> 8) * UNIFORM_SCALE``: 24 random bits, every value exact in float32."""


def stable_key_hash(key: Any) -> int:
    """A 32-bit hash of a key that is the same in every process and run (CRC-32 of its
    ``repr``: ``5`` and ``"5"`` differ). None (an encoder made without a key) hashes to 0."""
    if key is None:
        return 0
    return zlib.crc32(repr(key).encode("utf-8"))


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijective mix of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def counter_hash(*words: int) -> int:
    """A 64-bit hash of a tuple of non-negative integers (seed, key hash, step, purpose...)."""
    h = 0
    for word in words:
        h = _mix64(h ^ (int(word) & _M64))
    return h


def stream_key(seed: int, worker: int, key_hash: int, step: int, purpose: int) -> int:
    """The 64-bit key of the uniforms one worker draws for push ``step`` of a key."""
    return counter_hash(seed, worker, key_hash, step, purpose)


def key_halves(key: int) -> tuple[int, int]:
    """``(lo, hi)``: the two 32-bit halves of a stream key, as the kernels take them."""
    return key & M32, (key >> 32) & M32


def hash32(x: np.ndarray) -> np.ndarray:
    """The 32-bit finalizer, on uint64 arrays holding 32-bit values (returns the same)."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(M32)
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & np.uint64(M32)
    return x ^ (x >> np.uint64(16))


def uniforms_reference(key: int, start: int, count: int) -> np.ndarray:
    """The float32 uniforms of elements ``start .. start + count - 1`` of stream ``key``."""
    if start < 0 or start + count > 1 << 32:
        raise ValueError(f"element indices must be in [0, 2**32), got [{start}, {start + count})")
    lo, hi = key_halves(key)
    i = np.arange(start, start + count, dtype=np.uint64)
    h = hash32((hash32(i ^ np.uint64(lo)) + np.uint64(hi)) & np.uint64(M32))
    return (h >> np.uint64(8)).astype(np.float32) * UNIFORM_SCALE
