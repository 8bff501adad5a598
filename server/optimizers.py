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

``sgd`` with ``nesterov=True, momentum_every=N > 1`` (delayed Nesterov, Liu et al. 2024,
"Asynchronous Local-SGD Training for Language Modeling"; ``count`` per chunk, from 0)::

    g'     = clip(rescale_grad * g) + wd * w
    count += 1;  buf += g'
    if count % N != 0:  w = w - lr * g'                    (a momentum-free step)
    else:               mom = momentum * mom + buf;  buf = 0
                        w = w - lr * (g' + momentum * mom)

  When N updates of ``Δ_i / N`` (``rescale_grad = 1/N``) arrive, each computed from the same
  weights, the N steps together equal ONE NAG step with the mean of the ``Δ_i`` (up to
  rounding): ``dist_async`` DiLoCo takes the synchronous outer step's momentum once per N
  arrivals and plain steps in between, so a worker's pseudo-gradient is applied on arrival and
  the momentum still sees each worker's once per cycle. ``momentum_every=1`` is NAG above.

``dcasgd`` (delay-compensated ASGD, Zheng et al. ICML 2017, MXNet's formula; ``prev`` per chunk
is the weights before the previous update, equal to the weights before the first)::

    g    = clip(rescale_grad * g)
    d    = -lr * (g + wd * w + lamda * g * g * (w - prev))
    mom  = momentum * mom + d;  step = mom                 (momentum > 0; else step = d)
    prev = w
    w    = w + step

  ``g*g*(w - prev)`` is the paper's cheap Hessian approximation times the weights' move since
  the gradient's worker pulled them. Like MXNet, ``prev`` is kept per key, not per worker: it
  is the weights before the previous update, whoever sent it, where the paper uses the weights
  that this worker last pulled; the compensation is exact with one worker and an approximation
  with several (it still damps the weights' recent move in proportion to ``g*g``).

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
def _delayed_nag(w, out, g, mom, buf, lr, momentum, wd, rescale, clip, use_clip, momentum_step):
    if momentum_step:
        for i in range(w.shape[0]):
            gi = _clip(rescale * g[i], clip, use_clip) + wd * w[i]
            m = momentum * mom[i] + (buf[i] + gi)
            mom[i] = m
            buf[i] = 0
            out[i] = w[i] - lr * (gi + momentum * m)
    else:
        for i in range(w.shape[0]):
            gi = _clip(rescale * g[i], clip, use_clip) + wd * w[i]
            buf[i] += gi
            out[i] = w[i] - lr * gi


@njit(nogil=True, cache=True)
def _dcasgd(w, out, g, prev, mom, lr, momentum, lamda, wd, rescale, clip, use_clip, use_mom):
    for i in range(w.shape[0]):
        gi = _clip(rescale * g[i], clip, use_clip)
        wi = w[i]
        step = -lr * (gi + wd * wi + lamda * gi * gi * (wi - prev[i]))
        if use_mom:
            step = momentum * mom[i] + step
            mom[i] = step
        prev[i] = wi
        out[i] = wi + step


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

    def step_size(self) -> float:
        """``learning_rate * rescale_grad``: what a codec that applies the step itself scales
        its update by (:attr:`kvstore.codecs.base.Codec.applies_step_size`)."""
        return float(self.spec["learning_rate"]) * float(self.spec["rescale_grad"])

    def apply_step(self, weight: np.ndarray, out: np.ndarray, step: np.ndarray) -> None:
        """Write ``(1 - lr * wd) * weight - step`` into ``out``: the update of a codec whose
        aggregate is the step itself, learning rate included. Only plain SGD has it (the
        codec's ``check_optimizer`` refuses the others)."""
        raise OptimizerError(f"optimizer {self.name!r} cannot apply a step a codec scaled")

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

        An entry whose :meth:`new_state` default is an int is a counter the checkpoint must
        carry (Adam's ``t``); one whose default is None is made on first use, so a checkpoint
        carries it as an array or a counter only once it was made (SGD's ``mom``, its delayed
        Nesterov ``buf`` and ``count``, DCASGD's ``prev``).

        Raises:
            OptimizerError: names, lengths or dtypes that are not this optimizer's state.
        """
        fresh = self.new_state(numel, dtype)
        unknown = (set(arrays) | set(scalars)) - set(fresh)
        if unknown:
            raise OptimizerError(f"{what}: {self.name} keeps no state named {sorted(unknown)}")
        state: dict[str, Any] = {}
        for name, default in fresh.items():
            if isinstance(default, int) or (default is None and name in scalars):  # a counter
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
    """MXNet's SGD, momentum SGD and NAG, and delayed Nesterov (``momentum_every > 1``).

    State, every entry made on first use: ``mom`` (at the first update with momentum or
    Nesterov); for delayed Nesterov ``buf`` (the sum of the updates since the last momentum
    step) and the int ``count`` (the delayed updates so far), both at the first delayed update.
    A ``set_optimizer`` that changes ``momentum_every`` keeps them: the cycle goes on from
    ``count`` (whose remainder by the new ``momentum_every`` says where), and
    ``momentum_every=1`` leaves them untouched.
    """

    name = "sgd"

    def new_state(self, numel: int, dtype: np.dtype) -> dict[str, Any]:
        return {"mom": None, "buf": None, "count": None}

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
        every = self.spec["momentum_every"]
        if every > 1:  # validation allows it only with nesterov=True
            if state.get("buf") is None:
                state["buf"] = np.zeros_like(weight)
            state["count"] = (state.get("count") or 0) + 1
            momentum_step = state["count"] % every == 0
            _delayed_nag(
                weight,
                out,
                grad,
                state["mom"],
                state["buf"],
                lr,
                momentum,
                wd,
                rescale,
                clip,
                use_clip,
                momentum_step,
            )
            return
        kernel = _nag if self.spec["nesterov"] else _sgd_momentum
        kernel(weight, out, grad, state["mom"], lr, momentum, wd, rescale, clip, use_clip)

    def apply_step(self, weight: np.ndarray, out: np.ndarray, step: np.ndarray) -> None:
        if self.spec["momentum"] != 0.0 or self.spec["nesterov"]:
            raise OptimizerError("sgd with momentum cannot apply a step a codec scaled")
        dtype = weight.dtype
        lr, wd = self._scalars(dtype, "learning_rate", "wd")
        one = dtype.type(1)
        _sgd(weight, out, step, one - lr * wd, one, one, dtype.type(0), False)


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


class DCASGD(Optimizer):
    """MXNet's ``dcasgd``: delay-compensated asynchronous SGD (see the module docstring for the
    formula and for why ``prev`` per key is exact only with one worker).

    State: ``prev`` (the weights before the last update; a copy of the weights at the first
    update, since :meth:`new_state` does not see them) and ``mom`` (made at the first update
    with ``momentum > 0``).
    """

    name = "dcasgd"

    def new_state(self, numel: int, dtype: np.dtype) -> dict[str, Any]:
        return {"prev": None, "mom": None}

    def step(
        self, weight: np.ndarray, out: np.ndarray, grad: np.ndarray, state: dict[str, Any]
    ) -> None:
        dtype = weight.dtype
        lr, momentum, lamda, wd, rescale = self._scalars(
            dtype, "learning_rate", "momentum", "lamda", "wd", "rescale_grad"
        )
        clip, use_clip = self._clip_args(dtype)
        if state.get("prev") is None:
            state["prev"] = weight.copy()
        use_momentum = self.spec["momentum"] > 0.0
        if use_momentum and state.get("mom") is None:
            state["mom"] = np.zeros_like(weight)
        # Without momentum the kernel never reads ``mom``: an empty array keeps its types fixed.
        mom = state["mom"] if use_momentum else np.empty(0, dtype)
        _dcasgd(
            weight,
            out,
            grad,
            state["prev"],
            mom,
            lr,
            momentum,
            lamda,
            wd,
            rescale,
            clip,
            use_clip,
            use_momentum,
        )


_OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "dcasgd": DCASGD}


def make_optimizer(spec: OptimizerSpec) -> Optimizer:
    """The optimizer object for a validated spec."""
    try:
        return _OPTIMIZERS[spec.name](spec)
    except KeyError:
        raise OptimizerError(f"no server implementation of optimizer {spec.name!r}") from None
