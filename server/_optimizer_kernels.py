"""The server optimizers' update kernels (numba, GIL released, cached on disk): one pass over
a chunk each, with the formulas of :mod:`kvstore.server.optimizers`. Imported when an optimizer
is set, so that a server without one never starts numba."""

from __future__ import annotations

import numpy as np
from numba import njit

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)


@njit(nogil=True, cache=True, inline="always")
def _clip(x, bound, use_clip):
    if use_clip:
        if x > bound:
            return bound
        if x < -bound:
            return -bound
    return x


@njit(nogil=True, cache=True)
def sgd(w, out, g, decay, lr, rescale, clip, use_clip):
    for i in range(w.shape[0]):
        out[i] = decay * w[i] - lr * _clip(rescale * g[i], clip, use_clip)


@njit(nogil=True, cache=True)
def sgd_momentum(w, out, g, mom, lr, momentum, wd, rescale, clip, use_clip):
    lr_wd = lr * wd
    for i in range(w.shape[0]):
        m = momentum * mom[i] - lr_wd * w[i] - lr * _clip(rescale * g[i], clip, use_clip)
        mom[i] = m
        out[i] = w[i] + m


@njit(nogil=True, cache=True)
def nag(w, out, g, mom, lr, momentum, wd, rescale, clip, use_clip):
    for i in range(w.shape[0]):
        gi = _clip(rescale * g[i], clip, use_clip) + wd * w[i]
        m = momentum * mom[i] + gi
        mom[i] = m
        out[i] = w[i] - lr * (gi + momentum * m)


@njit(nogil=True, cache=True)
def adam(
    w,
    out,
    g,
    mean,
    var,
    lr_t,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    eps,
    wd,
    rescale,
    clip,
    use_clip,
):
    for i in range(w.shape[0]):
        gi = _clip(rescale * g[i] + wd * w[i], clip, use_clip)
        m = beta1 * mean[i] + one_minus_beta1 * gi
        v = beta2 * var[i] + one_minus_beta2 * gi * gi
        mean[i] = m
        var[i] = v
        out[i] = w[i] - lr_t * m / (np.sqrt(v) + eps)
