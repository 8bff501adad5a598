"""The ``randomk`` codec: send ``k`` error-feedback residual entries chosen at random.

Per push, with float32 residual ``r`` (one per key per worker, zero at start) and
``k = max(1, ceil(ratio * n))`` over the whole key::

    r += g
    S  = sorted(first k outputs of P)          P: a keyed permutation of [0, n)
    send (S, r[S]) cut by chunk;  r[S] = 0

``P`` is drawn from a counter-based generator keyed by ``(seed, key, step)`` and the element
counter: a Feistel network of 4 rounds on ``2h`` bits (``2**(2h) >= n``, ``h >= 1``) whose round
function is a 32-bit integer hash of the right half and the round key, cycle-walking outputs
``>= n`` back into range (applying the network again until the value is below ``n``, which
keeps it a permutation of ``[0, n)``). Integer arithmetic only, so every worker (whatever its
rank) and every implementation draws the same indices for the same key and step; ``step`` is the
encoder's push count, which checkpoints keep.

Payload, validation, server scatter-add and relay: :mod:`kvstore.codecs.sparse`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.codecs.base import seed_param
from kvstore.codecs.counter_rng import counter_hash, hash32
from kvstore.codecs.sparse import (
    RANDOM,
    Selection,
    SparseCodec,
    ratio_param,
    top_count,
)
from kvstore.errors import CodecError

ROUNDS = 4
PERMUTATION_PURPOSE = 2
"""The purpose word of :func:`~kvstore.codecs.counter_rng.counter_hash` for round keys."""

_M32 = 0xFFFFFFFF


def half_bits(numel: int) -> int:
    """``h``: the permutation works on ``2h`` bits, the fewest (``h >= 1``) that cover
    ``numel`` values."""
    h = 1
    while (1 << (2 * h)) < numel:
        h += 1
    return h


def round_keys(seed: int, key_hash: int, step: int) -> tuple[int, ...]:
    """The 32-bit round keys of push ``step`` of a key."""
    return tuple(
        counter_hash(seed, key_hash, step, PERMUTATION_PURPOSE, r) & _M32 for r in range(ROUNDS)
    )


def _feistel(values: np.ndarray, half: int, keys: tuple[int, ...]) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left = values >> np.uint64(half)
    right = values & mask
    for key in keys:
        left, right = right, left ^ (hash32(right ^ np.uint64(key)) & mask)
    return (left << np.uint64(half)) | right


def permuted_prefix_reference(
    numel: int, count: int, half: int, keys: tuple[int, ...]
) -> np.ndarray:
    """The images of ``0 .. count-1`` under the keyed permutation of ``[0, numel)`` (int64)."""
    values = _feistel(np.arange(count, dtype=np.uint64), half, keys)
    outside = values >= np.uint64(numel)
    while outside.any():  # cycle walking: the orbit of every start returns into [0, numel)
        values[outside] = _feistel(values[outside], half, keys)
        outside = values >= np.uint64(numel)
    return values.astype(np.int64)


def encode_reference(
    residual: np.ndarray, grad: np.ndarray, selection: Selection
) -> tuple[np.ndarray, np.ndarray]:
    """The numpy reference: update ``residual`` in place; return (ascending int64 indices,
    float32 values) of the elements sent."""
    residual += grad
    indices = np.sort(
        permuted_prefix_reference(
            residual.size, selection.k, selection.half_bits, selection.round_keys
        )
    )
    values = residual[indices]
    residual[indices] = 0
    return indices, values


class RandomKCodec(SparseCodec):
    """Send ``k = max(1, ceil(ratio * n))`` residual entries per key, the same indices on
    every worker.

    Args:
        ratio: density in (0, 1] (default 0.01).
        seed: integer in [0, 2**63) keying the generator (default 0).
    """

    name = "randomk"
    param_defaults = {"ratio": 0.01, "seed": 0}
    example_params = ({"ratio": 0.02, "seed": 3},)

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.ratio = ratio_param(self.name, self._params["ratio"])
        self.seed = seed_param(self.name, self._params["seed"])
        self._params.update(ratio=self.ratio, seed=self.seed)

    def pushed_fraction(self, numel: int, dtype: str) -> float:
        return min(1.0, 2 * self.ratio)

    def selection(self, numel: int, step: int, key_hash: int) -> Selection:
        if numel > 1 << 32:
            raise CodecError(f"codec 'randomk' handles keys of up to 2**32 elements, not {numel}")
        return Selection(
            RANDOM,
            k=top_count(self.ratio, numel),
            half_bits=half_bits(numel),
            round_keys=round_keys(self.seed, key_hash, step),
        )

    def reference(self, state, grad, selection):
        return encode_reference(state["residual"], grad, selection)
