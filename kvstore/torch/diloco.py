"""``DiLoCo``: local inner steps, an outer optimizer on the servers (Douillard et al. 2023,
"DiLoCo: Distributed Low-Communication Training of Language Models").

Every worker trains its own copy of the model with any torch optimizer (the *inner* optimizer,
whose state never leaves the worker). Every ``sync_every`` inner steps the workers take one
*outer* step together:

- each worker pushes its pseudo-gradient ``Δ = θ - θ_local`` (``θ``: the outer weights it last
  pulled; ``θ_local``: its parameters after the inner steps), compressed by the keys' push codec
  with that codec's error feedback;
- the servers apply the outer optimizer (MXNet formulas, :mod:`kvstore.server.optimizers`) to
  the mean over workers (``rescale_grad = 1 / num_workers``) once per round (``dist_sync``);
- each worker pulls the new ``θ`` (through the store's pull compression, if any) into its
  parameters and keeps it as the start of the next ``Δ``.

The keys hold ``θ``, initialised from rank 0's parameters, so every worker starts from the same
model. Outer ``sgd`` with learning rate 1 and no momentum is plain model averaging (local SGD);
with ``sync_every=1`` and plain SGD inside, that is synchronous data-parallel SGD. The paper's
outer step is Nesterov SGD with learning rate 0.7 and momentum 0.9 (the default here); the
servers' ``nesterov=True`` is MXNet's NAG, which for ``wd=0`` is torch's
``SGD(nesterov=True, dampening=0)``.

A pseudo-gradient is a push and ``θ`` is a pull: nothing new travels on the wire, and the
servers need not know that a round is an outer step.

Limits of this module: ``dist_sync`` (and ``local``) stores only; the whole model syncs at once
(``fragments=1``, ``overlap=0``); buffers (BatchNorm statistics) are not synchronized (see
:class:`DiLoCo`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from kvstore.errors import UsageError
from kvstore.torch.optimizer import (
    CODEC_STATE_ENTRY,
    ServerOptimizerSpec,
    _as_arrays,
    _as_tensors,
    _keys_of,
    _server_spec,
    _short,
    _synchronized_parameters,
)

DEFAULT_OUTER: ServerOptimizerSpec = (
    "sgd",
    {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True},
)
"""The paper's outer optimizer: Nesterov SGD, learning rate 0.7, momentum 0.9."""

DEFAULT_KEY_PREFIX = "kvt.diloco/"

STATE_ENTRY = "kvstore_diloco"
"""The entry of :meth:`DiLoCo.state_dict` that describes the wrapper and its outer weights."""

SUPPORTED_STORES = ("dist_sync", "local")


class DiLoCo(torch.optim.Optimizer):
    """Runs ``optimizer`` locally; every ``sync_every`` steps, an outer step on the servers.

    Example::

        kv = kvstore.create("dist_sync")
        opt = kvt.DiLoCo(torch.optim.AdamW(model.parameters(), lr=4e-4),
                         model.named_parameters(), kv=kv, sync_every=100,
                         outer=("sgd", {"learning_rate": 0.7, "momentum": 0.9,
                                        "nesterov": True}),
                         compression={"type": "topk", "ratio": 0.01})
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()   # one inner step; every 100th also pushes Δ and pulls θ

    Construction is collective (every worker makes the same wrapper): it sets the store's
    optimizer to ``outer``, initialises the keys with rank 0's parameters and pulls them into
    every worker's parameters. The store's optimizer applies to every key of the store, so a
    store used by a ``DiLoCo`` should hold no other keys that expect plain sums.

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer``), stepped on every call
            of :meth:`step`; its state stays on this worker and is kept across syncs.
        named_parameters: ``model.named_parameters()``: names for the keys, the same on every
            worker. None: names ``group{g}.{i}`` from the optimizer's parameter groups.
        kv: the store (``dist_sync`` or ``local``).
        sync_every: H, the inner steps per outer step.
        outer: the outer optimizer run by the servers, ``(name, hyperparameters)`` of
            :meth:`kvstore.KVStore.set_optimizer` (``"sgd"`` with ``momentum`` and
            ``nesterov``, or ``"adam"``); ``rescale_grad`` defaults to ``1 / num_workers``,
            making the outer gradient the mean pseudo-gradient.
        compression: the push codec of the pseudo-gradients (``{"type": "topk", "ratio":
            0.01}``), with its error feedback; None: the store's
            (:meth:`kvstore.KVStore.set_gradient_compression`).
        fragments: Streaming DiLoCo's number of fragments; only 1 (the whole model synced at
            once) is supported by this class.
        overlap: Streaming DiLoCo's inner steps overlapped with a sync; only 0 (each sync
            completes inside the step that starts it) is supported by this class.
        key_prefix: prepended to the parameter names to make the keys.

    Buffers (BatchNorm running statistics) are not synchronized: the store's optimizer applies
    to every key, and averaging buffers needs keys that it does not update.

    Raises:
        TypeError, ValueError: bad arguments (naming them).
        UsageError: a store of another type than ``dist_sync`` or ``local``.
        CodecError, OptimizerError: from the store, for a bad codec or outer optimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        *,
        kv: Any,
        sync_every: int = 100,
        outer: ServerOptimizerSpec = DEFAULT_OUTER,
        compression: Mapping[str, Any] | None = None,
        fragments: int = 1,
        overlap: int = 0,
        key_prefix: str = DEFAULT_KEY_PREFIX,
    ) -> None:
        # (torch.optim.Optimizer.__init__ is not called: the inner optimizer owns the parameter
        # groups and the state, which the properties below hand out.)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DiLoCo):
            raise TypeError("the optimizer is already a DiLoCo")
        _check_count("sync_every", sync_every, minimum=1)
        _check_count("fragments", fragments, minimum=1)
        _check_count("overlap", overlap, minimum=0)
        if fragments != 1 or overlap != 0:
            raise ValueError(
                f"DiLoCo syncs the whole model at once without overlap: it supports "
                f"fragments=1 and overlap=0 only, got fragments={fragments}, overlap={overlap}"
            )
        if not isinstance(key_prefix, str):
            raise TypeError(f"key_prefix must be a str, got {type(key_prefix).__name__}")
        if kv.type not in SUPPORTED_STORES:
            raise UsageError(
                f"DiLoCo runs on {' or '.join(SUPPORTED_STORES)} stores (one outer step per "
                f"round of all workers); this store is {kv.type}"
            )
        try:
            spec = _server_spec(outer, kv.num_workers)
        except TypeError as exc:
            raise TypeError(
                f"outer must be a name or (name, hyperparameters), e.g. ('sgd', "
                f"{{'learning_rate': 0.7, 'momentum': 0.9, 'nesterov': True}}); got {outer!r}"
            ) from exc
        assert spec is not None
        self._optimizer = optimizer
        self._kv = kv
        self._sync_every = sync_every
        self._outer = spec
        self._compression = None if compression is None else dict(compression)
        named = _synchronized_parameters(optimizer, named_parameters)
        self._names = [name for name, _ in named]
        self._params = [param for _, param in named]
        self._keys = [key_prefix + name for name in self._names]
        self._steps = 0

        kv.set_optimizer(spec[0], **spec[1])
        kv.init(self._keys, [p.detach() for p in self._params], compression=self._compression)
        # θ as last pulled (rank 0's parameters at first): where every Δ starts from.
        self._theta = [
            torch.empty_like(p, memory_format=torch.contiguous_format) for p in self._params
        ]
        self._deltas = [torch.empty_like(theta) for theta in self._theta]
        self._pull_outer_weights()

    # the optimizer's face ----------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer."""
        return self._optimizer

    @property
    def kv(self) -> Any:
        """The store."""
        return self._kv

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys, one per parameter, in the order of ``named_parameters``."""
        return tuple(self._keys)

    @property
    def sync_every(self) -> int:
        """H: inner steps per outer step."""
        return self._sync_every

    @property
    def steps(self) -> int:
        """Inner steps taken (a sync follows every step whose count is a multiple of H)."""
        return self._steps

    @property
    def outer_weights(self) -> tuple[torch.Tensor, ...]:
        """``θ`` as last pulled, one tensor per key (the wrapper's own: do not write them)."""
        return tuple(self._theta)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UsageError(
            "a DiLoCo's parameters are fixed when it is made (they are its keys): add the "
            "group to the inner optimizer before wrapping it"
        )

    def __repr__(self) -> str:
        return (
            f"DiLoCo({self._optimizer.__class__.__name__}, {len(self._keys)} keys, "
            f"sync_every={self._sync_every}, outer={self._outer[0]!r})"
        )

    # steps -------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step (the inner optimizer's ``step``); after every ``sync_every``-th,
        :meth:`synchronize` (collective). Returns the closure's loss, if any."""
        loss = self._optimizer.step() if closure is None else self._optimizer.step(closure)
        self._steps += 1
        if self._steps % self._sync_every == 0:
            self.synchronize()
        return loss

    def synchronize(self) -> None:
        """The outer step: push ``Δ = θ - θ_local`` of every key, pull the servers' new ``θ``
        into the parameters (collective: :meth:`step` calls it every ``sync_every`` steps; a
        call of one's own must be made by every worker at the same point)."""
        with torch.no_grad():
            for theta, param, delta in zip(self._theta, self._params, self._deltas, strict=True):
                torch.sub(theta, param.detach(), out=delta)
        # The pull waits for this worker's pushes of the keys, so ``delta`` is not written
        # again before the store is done with it.
        self._kv.push(self._keys, self._deltas)
        self._pull_outer_weights()

    def _pull_outer_weights(self) -> None:
        self._kv.pull(self._keys, out=self._theta)
        with torch.no_grad():
            for param, theta in zip(self._params, self._theta, strict=True):
                param.copy_(theta)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (the inner optimizer's ``zero_grad``)."""
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def update_outer_optimizer(self, **hyperparameters: Any) -> None:
        """Change hyperparameters of the outer optimizer (a schedule of the outer learning
        rate); collective, between steps: every worker calls it with the same values.

        Raises:
            OptimizerError: bad hyperparameters (from the store).
        """
        name, current = self._outer
        merged = {**current, **hyperparameters}
        self._kv.set_optimizer(name, **merged)
        self._outer = (name, merged)

    # checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, plus:

        - ``"kvstore_diloco"``: the parameter names (checked by :meth:`load_state_dict`),
          ``sync_every``, the outer optimizer, the compression, the inner steps taken and the
          outer weights ``θ`` last pulled (CPU tensors: the start of the pending ``Δ``);
        - ``"kvstore_codec_state"``: this worker's codec state of the keys (error-feedback
          residuals and the like, :meth:`kvstore.KVStore.codec_state`).

        Call it between steps on every worker. The servers' ``θ`` and outer optimizer state
        (momentum) go with ``kv.save_checkpoint(path)``; the parameters (``θ_local``) with the
        model's own state dict. Loading all three resumes a ``dist_sync`` run bit for bit, in
        this order: make the ``DiLoCo`` (collective; it pulls rank 0's parameters into the
        model), then ``model.load_state_dict``, :meth:`load_state_dict` and
        ``kv.load_checkpoint``.
        """
        state = self._optimizer.state_dict()
        state[STATE_ENTRY] = {
            "parameters": list(self._names),
            "sync_every": self._sync_every,
            "outer": [self._outer[0], dict(self._outer[1])],
            "compression": self._compression,
            "steps": self._steps,
            "outer_weights": [theta.detach().cpu().clone() for theta in self._theta],
        }
        state[CODEC_STATE_ENTRY] = _as_tensors(self._kv.codec_state(self._keys))
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of :meth:`state_dict`: the inner optimizer's state, the step
        count, the outer weights and this worker's codec state (into the store). The wrapper's
        ``sync_every`` and outer optimizer are kept as constructed (a schedule changed with
        :meth:`update_outer_optimizer` is the caller's to restore: the saved hyperparameters
        are ``state_dict["kvstore_diloco"]["outer"]``). Nothing changes when a check fails.

        Raises:
            ValueError: it was not saved by a DiLoCo, or by one over other parameters or keys,
                or the inner optimizer refuses its part.
            CheckpointError, CodecError: the codec state is another worker's or does not fit
                the keys (from the store, naming the key).
        """
        state = dict(state_dict)
        saved = state.pop(STATE_ENTRY, None)
        codec_state = state.pop(CODEC_STATE_ENTRY, None)
        if not isinstance(saved, Mapping):
            raise ValueError(f"the state dict has no {STATE_ENTRY!r} entry: not a DiLoCo's")
        if saved.get("parameters") != self._names:
            raise ValueError(
                "the state dict was saved by a DiLoCo over other parameters: saved "
                f"{_short(saved.get('parameters'))}, here {_short(self._names)}"
            )
        weights = saved.get("outer_weights")
        if not isinstance(weights, list | tuple) or len(weights) != len(self._theta):
            raise ValueError("the state dict's outer weights do not match the parameters")
        for name, weight, theta in zip(self._names, weights, self._theta, strict=True):
            if not isinstance(weight, torch.Tensor) or weight.shape != theta.shape:
                raise ValueError(f"the state dict's outer weight of {name!r} has another shape")
        steps = saved.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"the state dict's step count is not a count: {steps!r}")
        if codec_state is not None:
            saved_keys = _keys_of(codec_state)
            if saved_keys is not None and saved_keys != self._keys:
                raise ValueError(
                    "the state dict's codec state is of other keys (another key_prefix?): "
                    f"saved {_short(saved_keys)}, here {_short(self._keys)}"
                )
            codec_state = _as_arrays(codec_state)
        # The store checks everything before it changes anything; the inner optimizer's state
        # is put back if it refuses.
        previous = self._optimizer.state_dict()
        self._optimizer.load_state_dict(state)
        if codec_state is not None:
            try:
                self._kv.load_codec_state(codec_state)
            except BaseException:
                self._optimizer.load_state_dict(previous)
                raise
        with torch.no_grad():
            for weight, theta in zip(weights, self._theta, strict=True):
                theta.copy_(weight)
        self._steps = steps


def _check_count(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


__all__ = ["DEFAULT_OUTER", "DiLoCo"]
