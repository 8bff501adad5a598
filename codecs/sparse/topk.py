"""The ``topk`` codec: send the ``k`` largest error-feedback residual entries of a key.

Per push, with float32 residual ``r`` (one per key per worker, zero at start) and
``k = max(1, ceil(ratio * n))`` over the whole key (``n`` its elements, however many servers its
chunks live on)::

    r += g
    S  = select(abs(r), k)                     (ascending)
    send (S, r[S]) cut by chunk;  r[S] = 0

*Exact* selection (``sample = 0``): the ``k`` largest ``abs(r)``, ties broken by the lower index:
with ``T`` the k-th largest magnitude, every element above ``T`` and the lowest-index elements
equal to ``T`` until there are ``k``.

*Sampled* selection (the threshold estimate of Deep Gradient Compression, Lin et al. 2018, made
deterministic): ``abs(r)`` is sampled at an odd stride from a start that changes every push
(:func:`kvstore.codecs.sparse.sample_plan`, keyed by the key and the push count); the threshold
``thr`` is the ``ceil(ratio * samples)``-th largest sample, and the candidates are every element
with ``abs(r) >= thr``. Between ``k/2`` and ``1.3 k`` candidates are sent as they are; any other
count falls back to the exact selection (which, with more than ``1.3 k`` candidates, is the exact
top-k among them). Either way every element sent is at least as large in magnitude as every
element kept.

Payload, validation, server scatter-add and relay: :mod:`kvstore.codecs.sparse`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.codecs.counter_rng import counter_hash
from kvstore.codecs.sparse import (
    TOP_K,
    SamplePlan,
    Selection,
    SparseCodec,
    accepted_count,
    fraction_param,
    ratio_param,
    sample_plan,
    top_count,
)

SAMPLE_PURPOSE = 1
"""The purpose word of :func:`~kvstore.codecs.counter_rng.counter_hash` for sample starts."""


def top_k_reference(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """The ascending int64 indices of the ``k`` largest ``magnitudes`` (lower index first among
    equals)."""
    n = magnitudes.size
    if k <= 0:
        return np.empty(0, np.int64)
    kth = np.partition(magnitudes, n - k)[n - k]
    above = np.flatnonzero(magnitudes > kth)
    equal = np.flatnonzero(magnitudes == kth)[: k - above.size]
    return np.union1d(above, equal).astype(np.int64)


def select_reference(magnitudes: np.ndarray, k: int, plan: SamplePlan | None) -> np.ndarray:
    """The indices a push sends, exact (``plan`` None) or through the sampled threshold."""
    if plan is None or k <= 0:
        return top_k_reference(magnitudes, k)
    last = plan.start + (plan.count - 1) * plan.stride
    samples = magnitudes[plan.start : last + 1 : plan.stride]
    thr = np.partition(samples, plan.count - plan.top)[plan.count - plan.top]
    candidates = np.flatnonzero(magnitudes >= thr)
    if accepted_count(candidates.size, k):
        return candidates
    return top_k_reference(magnitudes, k)


def encode_reference(
    residual: np.ndarray, grad: np.ndarray, k: int, plan: SamplePlan | None
) -> tuple[np.ndarray, np.ndarray]:
    """The numpy reference: update ``residual`` in place; return (ascending int64 indices,
    float32 values) of the elements sent."""
    residual += grad
    indices = select_reference(np.abs(residual), k, plan)
    values = residual[indices]
    residual[indices] = 0
    return indices, values


def top_selection(
    numel: int, ratio: float, sample: float, seed: int, key_hash: int, step: int
) -> Selection:
    """The :class:`~kvstore.codecs.sparse.Selection` of a top-k push (shared with DGC)."""
    k = top_count(ratio, numel)
    plan = None
    if sample > 0 and numel > 0:
        plan = sample_plan(numel, ratio, sample, counter_hash(seed, key_hash, step, SAMPLE_PURPOSE))
    return Selection(TOP_K, k=k, sample=plan)


class TopKCodec(SparseCodec):
    """Send the ``k = max(1, ceil(ratio * n))`` largest residual entries of each key.

    Args:
        ratio: density in (0, 1] (default 0.01).
        sample: fraction of the key sampled to estimate the threshold, in [0, 1] (default
            0.01); 0 selects exactly.
    """

    name = "topk"
    param_defaults = {"ratio": 0.01, "sample": 0.01}
    example_params = ({"ratio": 0.01}, {"ratio": 0.05, "sample": 0})

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.ratio = ratio_param(self.name, self._params["ratio"])
        self.sample = fraction_param(self.name, self._params["sample"], "sample")
        self._params.update(ratio=self.ratio, sample=self.sample)

    def pushed_fraction(self, numel: int, dtype: str) -> float:
        return min(1.0, 2 * self.ratio)  # an index and a value per element sent

    def selection(self, numel: int, step: int, key_hash: int) -> Selection:
        return top_selection(numel, self.ratio, self.sample, 0, key_hash, step)

    def reference(self, state, grad, selection):
        return encode_reference(state["residual"], grad, selection.k, selection.sample)
