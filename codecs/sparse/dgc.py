"""The ``dgc`` codec: Deep Gradient Compression (Lin et al., ICLR 2018) on the workers.

Per push, with float32 momentum ``u`` and velocity ``v`` (one each per key per worker, zero at
start), momentum ``m`` (float32), and ``k = max(1, ceil(density * n))`` over the whole key::

    s = clip_scale(||g||, clip_norm)               (1 without clip_norm)
    g = g * s                                      (float32)
    u = m * u + g;          v = v + u              (each product and sum rounded to float32)
      nesterov: u = m * (u + g);  v = (v + u) + g
    S = select(abs(v), k)                          (as topk: exact, or sampled with `sample`)
    send (S, v[S]) cut by chunk;  v[S] = 0;  u[S] = 0     (momentum factor masking)

*Warm-up*: during the first ``warmup_steps`` pushes the density follows the paper's schedule
0.25, 0.0625, 0.015625, 0.004 in four equal stages (push ``s`` is in stage
``4 * s // warmup_steps``), never below ``ratio``; afterwards it is ``ratio``.

*Clipping* (``clip_norm``): the gradient is scaled by ``min(1, clip_norm / ||g||)`` before the
momentum, with ``||g||`` from a deterministic reduction every implementation repeats bit for
bit (:func:`sum_of_squares_reference`: float64 squares summed in order within blocks of 4096
elements, then the block sums in order), and the scale rounded to float32.

The momentum lives on the workers, so the server must not add its own: a server optimizer with
momentum (sgd ``momentum > 0``, adam ``beta1 > 0``) is refused (:meth:`DGCCodec.check_optimizer`).
Payload, validation, server scatter-add and relay: :mod:`kvstore.codecs.sparse`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvstore.codecs.base import server_momentum
from kvstore.codecs.sparse import (
    Accumulation,
    Selection,
    SparseCodec,
    fraction_param,
    ratio_param,
)
from kvstore.codecs.sparse.topk import select_reference, top_selection
from kvstore.errors import CodecError

WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.004)
"""The paper's warm-up densities (75%, 93.75%, 98.4375%, 99.6% sparsity), in equal stages."""

NORM_BLOCK = 4096
"""Elements per block of the clipping norm's reduction."""


def density(step: int, ratio: float, warmup_steps: int) -> float:
    """The density of push ``step`` (0, 1, ...)."""
    if step >= warmup_steps:
        return ratio
    stage = len(WARMUP_DENSITIES) * step // warmup_steps
    return max(WARMUP_DENSITIES[stage], ratio)


def sum_of_squares_reference(grad: np.ndarray) -> float:
    """``sum(g**2)`` in float64: each block of :data:`NORM_BLOCK` elements summed in order
    (``np.cumsum`` is a sequential sum), then the block sums in order."""
    if grad.size == 0:
        return 0.0
    blocks = -(-grad.size // NORM_BLOCK)
    squares = np.zeros(blocks * NORM_BLOCK, dtype=np.float64)
    squares[: grad.size] = grad.astype(np.float64) ** 2  # exact: 24-bit mantissas squared
    partials = np.cumsum(squares.reshape(blocks, NORM_BLOCK), axis=1)[:, -1]
    return float(np.cumsum(partials)[-1])


def clip_scale(sum_of_squares: float, clip_norm: float | None) -> np.float32:
    """The float32 factor that brings a gradient of that squared norm down to ``clip_norm``
    (1 when it is within it, or without ``clip_norm``)."""
    if clip_norm is None:
        return np.float32(1)
    norm = math.sqrt(sum_of_squares)
    if norm <= clip_norm:
        return np.float32(1)
    return np.float32(clip_norm / norm)


def encode_reference(
    u: np.ndarray,
    v: np.ndarray,
    grad: np.ndarray,
    selection: Selection,
    accumulation: Accumulation,
) -> tuple[np.ndarray, np.ndarray]:
    """The numpy reference: update ``u`` and ``v`` in place; return (ascending int64 indices,
    float32 values) of the elements sent."""
    m = np.float32(accumulation.momentum)
    scale = clip_scale(sum_of_squares_reference(grad), accumulation.clip_norm)
    g = grad * scale if scale != 1 else grad
    if accumulation.nesterov:
        u[...] = m * (u + g)
        v[...] = (v + u) + g
    else:
        u[...] = m * u + g
        v += u
    indices = select_reference(np.abs(v), selection.k, selection.sample)
    values = v[indices]
    v[indices] = 0
    u[indices] = 0
    return indices, values


def _optional_positive(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise CodecError(f"codec 'dgc': clip_norm must be None or a number > 0, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise CodecError(
            f"codec 'dgc': clip_norm must be None or a finite number > 0, got {value!r}"
        )
    return value


class DGCCodec(SparseCodec):
    """Deep Gradient Compression: momentum correction, sampled top-k of the velocity, factor
    masking, optional local clipping and sparsity warm-up.

    Args:
        ratio: final density in (0, 1] (default 0.001).
        momentum: in [0, 1) (default 0.9).
        nesterov: bool (default False).
        sample: fraction sampled for the threshold, in [0, 1]; 0 selects exactly (default 0.01).
        clip_norm: None (default) or > 0: local gradient clipping by the key's 2-norm.
        warmup_steps: integer >= 0 (default 0): pushes of sparsity warm-up.
    """

    name = "dgc"
    param_defaults = {
        "ratio": 0.001,
        "momentum": 0.9,
        "nesterov": False,
        "sample": 0.01,
        "clip_norm": None,
        "warmup_steps": 0,
    }
    example_params = (
        {"ratio": 0.01, "warmup_steps": 4},
        {"ratio": 0.02, "nesterov": True, "clip_norm": 30.0},
    )
    state_names = ("u", "v")

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        p = self._params
        self.ratio = ratio_param(self.name, p["ratio"])
        momentum = p["momentum"]
        if isinstance(momentum, bool) or not isinstance(
            momentum, int | float | np.floating | np.integer
        ):
            raise CodecError(f"codec 'dgc': momentum must be a number in [0, 1), got {momentum!r}")
        if not 0.0 <= float(momentum) < 1.0:
            raise CodecError(f"codec 'dgc': momentum must be in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        if not isinstance(p["nesterov"], bool | np.bool_):
            raise CodecError(f"codec 'dgc': nesterov must be True or False, got {p['nesterov']!r}")
        self.nesterov = bool(p["nesterov"])
        self.sample = fraction_param(self.name, p["sample"], "sample")
        self.clip_norm = _optional_positive(p["clip_norm"])
        warmup = p["warmup_steps"]
        if isinstance(warmup, bool) or not isinstance(warmup, int | np.integer) or warmup < 0:
            raise CodecError(f"codec 'dgc': warmup_steps must be an integer >= 0, got {warmup!r}")
        self.warmup_steps = int(warmup)
        p.update(
            ratio=self.ratio,
            momentum=self.momentum,
            nesterov=self.nesterov,
            sample=self.sample,
            clip_norm=self.clip_norm,
            warmup_steps=self.warmup_steps,
        )

    def pushed_fraction(self, numel: int, dtype: str) -> float:
        return min(1.0, 2 * self.ratio)

    def accumulation(self) -> Accumulation:
        return Accumulation(np.float32(self.momentum), self.nesterov, self.clip_norm)

    def selection(self, numel: int, step: int, key_hash: int) -> Selection:
        ratio = density(step, self.ratio, self.warmup_steps)
        return top_selection(numel, ratio, self.sample, 0, key_hash, step)

    def reference(self, state, grad, selection):
        return encode_reference(state["u"], state["v"], grad, selection, self.accumulation())

    def check_optimizer(self, name: str, params: Mapping[str, Any]) -> None:
        momentum = server_momentum(name, params)
        if momentum is not None:
            raise CodecError(
                f"codec 'dgc' applies momentum on the workers (momentum correction), and the "
                f"server optimizer {name!r} with {momentum}={params[momentum]} would apply it "
                f"again (double momentum): set {momentum}=0 for the server optimizer, or use "
                f"another codec (e.g. 'topk')"
            )
