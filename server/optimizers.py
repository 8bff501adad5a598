"""Server-side optimizers: fused, compiled update kernels with their state kept on the server.

Each update is one pass over the chunk (numba, GIL released), in the weights' dtype (float32 for
float32/float16 keys, float64 for float64 keys), with MXNet's formulas. ``g`` below is the round's
aggregate (the sum of all workers' decoded pushes); ``clip(x)`` clips to
``[-clip_gradient, clip_gradient]`` and is the identity when ``clip_gradient`` is None.

``sgd`` (``momentum == 0``)::

    w = (1 - lr*wd) * w - lr * clip(rescale_grad * g)

``sgd`` with momentum::

    mom = momentum * mom - lr*wd * w - lr * clip(rescale_grad * g)
    w   = w + mom

``sgd`` with ``nesterov=True`` (MXNet's NAG)::

    g'  = clip(rescale_grad * g) + wd * w
    mom = momentum * mom + g'
    w   = w - lr * (g' + momentum * mom)

``adam`` (step count ``t`` per chunk, starting at 1)::

    g'   = clip(rescale_grad * g + wd * w)
    m    = beta1 * m + (1 - beta1) * g'
    v    = beta2 * v + (1 - beta2) * g'^2
    lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
    w    = w - lr_t * m / (sqrt(v) + epsilon)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
from numba import njit

import kvstore.codecs.numba_started  # noqa: F401  (before any function is defined)
from kvstore.errors import OptimizerError
from kvstore.optimizer_spec import OptimizerSpec

# kernels ---------------------------------------------------------------------------------------


@njit(nogil=True, cache=True, inline="always")
def _clip(x, bound, use_clip):
    if use_clip:
        if x > bound:
            return bound
        if x < -bound:
            return -bound
    return x


@njit(nogil=True, cache=True)
def _sgd(w, out, g, decay, lr, rescale, clip, use_clip):
    for i in range(w.shape[0]):
        out[i] = decay * w[i] - lr * _clip(rescale * g[i], clip, use_clip)


@njit(nogil=True, cache=True)
def _sgd_momentum(w, out, g, mom, lr, momentum, wd, rescale, clip, use_clip):
    lr_wd = lr * wd
    for i in range(w.shape[0]):
        m = momentum * mom[i] - lr_wd * w[i] - lr * _clip(rescale * g[i], clip, use_clip)
        mom[i] = m
        out[i] = w[i] + m


@njit(nogil=True, cache=True)
def _nag(w, out, g, mom, lr, momentum, wd, rescale, clip, use_clip):
    for i in range(w.shape[0]):
        gi = _clip(rescale * g[i], clip, use_clip) + wd * w[i]
        m = momentum * mom[i] + gi
        mom[i] = m
        out[i] = w[i] - lr * (gi + momentum * m)


@njit(nogil=True, cache=True)
def _adam(
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


# optimizer objects -------------------------------------------------------------------------------


class Optimizer(ABC):
    """An update rule with validated hyperparameters; its per-chunk state is kept by the caller.

    ``step`` runs on an executor thread; the server serializes steps of one chunk.
    """

    name: str

    def __init__(self, spec: OptimizerSpec) -> None:
        self.spec = spec

    @abstractmethod
    def new_state(self, numel: int, dtype: np.dtype) -> dict[str, Any]:
        """Fresh optimizer state for a chunk of ``numel`` weights."""

    @abstractmethod
    def step(
        self, weight: np.ndarray, out: np.ndarray, grad: np.ndarray, state: dict[str, Any]
    ) -> None:
        """Write the updated ``weight`` into ``out`` (which may be ``weight`` itself).

        Args:
            weight: the current weights (read only unless ``out is weight``).
            out: where the new weights go.
            grad: the round's aggregated gradient, same dtype and length.
            state: this chunk's state from :meth:`new_state`; updated in place.
        """

    def import_state(
        self,
        arrays: dict[str, np.ndarray],
        scalars: dict[str, Any],
        numel: int,
        dtype: np.dtype,
        what: str,
    ) -> dict[str, Any]:
        """Rebuild a chunk's state from a checkpoint: its arrays and integer counters (as
        ``ChunkState.checkpoint_state`` saves them; arrays are copied).

        Raises:
            OptimizerError: names, lengths or dtypes that are not this optimizer's state.
        """
        fresh = self.new_state(numel, dtype)
        unknown = (set(arrays) | set(scalars)) - set(fresh)
        if unknown:
            raise OptimizerError(f"{what}: {self.name} keeps no state named {sorted(unknown)}")
        state: dict[str, Any] = {}
        for name, default in fresh.items():
            if isinstance(default, int):  # a counter: required
                value = scalars.get(name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise OptimizerError(f"{what}: {self.name} state {name!r} is {value!r}")
                state[name] = value
                continue
            saved = arrays.get(name)
            if saved is None:
                if default is not None:  # made with the state: required
                    raise OptimizerError(f"{what}: {self.name} state {name!r} is missing")
                state[name] = None  # made on first use (SGD's momentum)
                continue
            if saved.shape != (numel,) or saved.dtype != dtype:
                raise OptimizerError(
                    f"{what}: {self.name} state {name!r} is {saved.dtype}{list(saved.shape)}, "
                    f"expected {np.dtype(dtype)}[{numel}]"
                )
            state[name] = np.array(saved, copy=True)
        return state

    def _scalars(self, dtype: np.dtype, *names: str) -> list[Any]:
        cast = dtype.type
        return [cast(self.spec[name]) for name in names]

    def _clip_args(self, dtype: np.dtype) -> tuple[Any, bool]:
        clip = self.spec["clip_gradient"]
        return dtype.type(clip if clip is not None else 0.0), clip is not None


class SGD(Optimizer):
    name = "sgd"

    def new_state(self, numel: int, dtype: np.dtype) -> dict[str, Any]:
        return {"mom": None}

    def step(
        self, weight: np.ndarray, out: np.ndarray, grad: np.ndarray, state: dict[str, Any]
    ) -> None:
        dtype = weight.dtype
        lr, wd, rescale, momentum = self._scalars(
            dtype, "learning_rate", "wd", "rescale_grad", "momentum"
        )
        clip, use_clip = self._clip_args(dtype)
        if self.spec["momentum"] == 0.0 and not self.spec["nesterov"]:
            decay = dtype.type(1) - lr * wd
            _sgd(weight, out, grad, decay, lr, rescale, clip, use_clip)
            return
        if state.get("mom") is None:
            state["mom"] = np.zeros_like(weight)
        kernel = _nag if self.spec["nesterov"] else _sgd_momentum
        kernel(weight, out, grad, state["mom"], lr, momentum, wd, rescale, clip, use_clip)


class Adam(Optimizer):
    name = "adam"

    def new_state(self, numel: int, dtype: np.dtype) -> dict[str, Any]:
        return {
            "t": 0,
            "mean": np.zeros(numel, dtype=dtype),
            "var": np.zeros(numel, dtype=dtype),
        }

    def step(
        self, weight: np.ndarray, out: np.ndarray, grad: np.ndarray, state: dict[str, Any]
    ) -> None:
        dtype = weight.dtype
        state["t"] += 1
        t = state["t"]
        beta1, beta2 = self.spec["beta1"], self.spec["beta2"]
        lr_t = self.spec["learning_rate"] * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
        b1, b2, eps, wd, rescale = self._scalars(
            dtype, "beta1", "beta2", "epsilon", "wd", "rescale_grad"
        )
        clip, use_clip = self._clip_args(dtype)
        one = dtype.type(1)
        _adam(
            weight,
            out,
            grad,
            state["mean"],
            state["var"],
            dtype.type(lr_t),
            b1,
            b2,
            one - b1,
            one - b2,
            eps,
            wd,
            rescale,
            clip,
            use_clip,
        )


_OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam}


def make_optimizer(spec: OptimizerSpec) -> Optimizer:
    """The optimizer object for a validated spec."""
    try:
        return _OPTIMIZERS[spec.name](spec)
    except KeyError:
        raise OptimizerError(f"no server implementation of optimizer {spec.name!r}") from None
