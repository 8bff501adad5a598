"""``DistributedOptimizer``: any torch optimizer, its gradients averaged through the store.

Every synchronized parameter belongs to one bucket of the bucket plan (:mod:`.buckets`), and
every bucket is one key. A ``register_post_accumulate_grad_hook`` hook on each parameter sees its
gradient arrive during backward; when the last gradient of a bucket is in (on the last of
``backward_passes_per_step`` passes), the bucket is pushed at once, so the pushes of the layers
near the output travel while backward still computes the layers near the input. ``step()`` then
pushes what backward did not produce (see *unused parameters*), pulls every key in one call and
either runs the wrapped optimizer on the mean gradient, or, with a server optimizer, copies the
weights the servers computed into the parameters.

Semantics (docs/torch.md has the user's guide):

- **Mean.** The servers sum the workers' pushes; the wrapper divides the pulled sum by the
  number of workers. With a server optimizer, ``rescale_grad`` defaults to ``1 / num_workers``.
- **Frozen parameters** (``requires_grad`` False when the wrapper is made) are never keys and
  are left to the wrapped optimizer, which skips them as they have no gradient.
- **Unused parameters** (no gradient this step) still take part in the round: every worker
  pushes every key every step in ``dist_sync``, so a parameter without a gradient is pushed as
  zeros. After the step its gradient is the mean over workers, zeros if no worker used it, on
  every worker alike; the wrapped optimizer then applies weight decay and momentum to it as to
  any zero gradient (freeze a parameter that is never used).
- **Gradient accumulation.** With ``backward_passes_per_step=k`` a parameter is pushed when its
  k-th gradient of the step has been accumulated; gradients are summed over the passes, as
  torch does (scale the loss by ``1/k`` for a mean). A (k+1)-th pass before ``step()`` raises.
- **Server optimizer** (``server_optimizer=("sgd", {...})``, MXNet's update_on_kvstore): the
  keys hold the weights, initialised with rank 0's parameters (so every worker starts from them);
  the servers apply the optimizer once per round and ``step()`` pulls the weights into the
  parameters. The wrapped optimizer's own update never runs then: it only names the parameters
  to train, clears gradients (``zero_grad``) and carries ``state_dict``; its learning rate is not
  used (change the servers' with :meth:`DistributedOptimizer.update_server_optimizer`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstore.errors import UsageError
from kvstore.torch import buckets as plans

ServerOptimizerSpec = str | tuple[str, Mapping[str, Any]]
"""``"sgd"`` or ``("sgd", {"learning_rate": 0.1, "momentum": 0.9, ...})``: the name and
hyperparameters of :meth:`kvstore.KVStore.set_optimizer`."""

DEFAULT_KEY_PREFIX = "kvt.param/"

CODEC_STATE_ENTRY = "kvstore_codec_state"
"""The entry of :meth:`DistributedOptimizer.state_dict` that holds the store's codec state."""


@dataclass(eq=False)
class _Slot:
    """One synchronized parameter and where its gradient goes."""

    name: str
    param: torch.Tensor
    bucket: _Bucket | None = None
    offset: int = 0  # in the bucket's flat buffer
    passes: int = 0  # backward passes that reached it since the last step
    ready: bool = False  # its gradient of this step is in the bucket (or pushed)


@dataclass(eq=False)
class _Bucket:
    """One key: one parameter (pushed from its own gradient) or several (a flat buffer)."""

    key: str
    slots: list[_Slot]
    priority: int
    flat: torch.Tensor | None  # None: a one-parameter bucket, pushed and pulled as it is
    waiting: int = 0  # gradients not ready yet this step
    pushed: bool = False
    names: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.waiting = len(self.slots)
        self.pushed = False
        for slot in self.slots:
            slot.passes = 0
            slot.ready = False


class StoreWrappedOptimizer(torch.optim.Optimizer):
    """What the optimizers that wrap a torch optimizer over a store share: the wrapped one owns
    the parameter groups, the state and the defaults, which these properties hand out, and the
    parameters are fixed when the wrapper is made (they are its keys). A subclass sets
    ``_optimizer`` and ``_kv``; ``torch.optim.Optimizer.__init__`` is not called."""

    _optimizer: torch.optim.Optimizer
    _kv: Any

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
        """The wrapped optimizer."""
        return self._optimizer

    @property
    def kv(self) -> Any:
        """The store."""
        return self._kv

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UsageError(
            f"a {type(self).__name__}'s parameters are fixed when it is made (they are its "
            "keys): add the group to the wrapped optimizer before wrapping it"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (the wrapped optimizer's ``zero_grad``)."""
        self._optimizer.zero_grad(set_to_none=set_to_none)


class DistributedOptimizer(StoreWrappedOptimizer):
    """Wraps a torch optimizer: gradients are averaged over workers through the store.

    Example::

        kv = kvstore.create("dist_sync")
        kvt.broadcast_parameters(model, kv)
        opt = kvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), kv=kv,
                                       compression={"type": "2bit", "threshold": 0.5})
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()  # pushes start here
            opt.step()                       # waits for the mean, then steps

    Construction is collective (every worker makes the same wrapper: it initialises the keys).

    Args:
        optimizer: the torch optimizer to wrap (any ``torch.optim.Optimizer``).
        named_parameters: ``model.named_parameters()``: names for the keys, the same on every
            worker, and the registration order whose reverse is taken as backward order. None:
            names ``group{g}.{i}`` from the optimizer's parameter groups.
        kv: the store (``kvstore.create(...)``).
        compression: the codec of the wrapper's keys (``{"type": "2bit", "threshold": 0.5}``);
            None: the store's (:meth:`kvstore.KVStore.set_gradient_compression`).
        bucket_plan: ``"none"``, ``{"bucket_bytes": B}``, ``"mgs"`` or a planner function
            (see :mod:`kvstore.torch.buckets`).
        server_optimizer: run this optimizer on the servers and pull weights (see the module
            docstring); None: pull the mean gradient and run ``optimizer``.
        backward_passes_per_step: backward passes accumulated before each step.
        key_prefix: prepended to the parameter names to make the keys; give two wrappers that
            share a store different prefixes.

    Raises:
        TypeError, ValueError: bad arguments (naming them).
        UsageError: the store's setup cannot work with the wrapper (``dist_async`` without a
            server optimizer, or a store that already runs an optimizer when none is given).
        CodecError, OptimizerError: from the store, for a bad codec or server optimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        *,
        kv: Any,
        compression: Mapping[str, Any] | None = None,
        bucket_plan: plans.BucketPlanSpec = "none",
        server_optimizer: ServerOptimizerSpec | None = None,
        backward_passes_per_step: int = 1,
        key_prefix: str = DEFAULT_KEY_PREFIX,
    ) -> None:
        # (torch.optim.Optimizer.__init__ is not called: the wrapped optimizer owns the
        # parameter groups and the state, which the properties below hand out.)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already a DistributedOptimizer")
        if (
            isinstance(backward_passes_per_step, bool)
            or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step < 1
        ):
            raise ValueError(
                f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
            )
        if not isinstance(key_prefix, str):
            raise TypeError(f"key_prefix must be a str, got {type(key_prefix).__name__}")
        self._optimizer = optimizer
        self._kv = kv
        self._passes_per_step = backward_passes_per_step
        self._compression = None if compression is None else dict(compression)
        self._server = _server_spec(server_optimizer, kv.num_workers)
        _check_store(kv, self._server)

        named = _synchronized_parameters(optimizer, named_parameters)
        backward = list(reversed(named))  # the last registered layer's gradient comes first
        names = [name for name, _ in backward]
        plan = plans.make_plan(bucket_plan, [p for _, p in backward], names)
        self._buckets = [
            self._make_bucket(key_prefix, index, [_Slot(*backward[i]) for i in members])
            for index, members in enumerate(plan)
        ]
        self._synchronized = False

        if self._server is not None:
            name, hyperparameters = self._server
            kv.set_optimizer(name, **hyperparameters)
        kv.init(
            [b.key for b in self._buckets],
            [self._initial_value(b) for b in self._buckets],
            compression=self._compression,
        )
        if self._server is not None:  # every worker starts from rank 0's weights
            self._pull_weights()
        owner = weakref.ref(self)  # the hooks must not keep the wrapper alive
        self._hooks = [
            slot.param.register_post_accumulate_grad_hook(_hook(owner, slot))
            for bucket in self._buckets
            for slot in bucket.slots
        ]

    # construction ------------------------------------------------------------------------------

    @staticmethod
    def _make_bucket(prefix: str, index: int, slots: list[_Slot]) -> _Bucket:
        names = [slot.name for slot in slots]
        key = prefix + (names[0] if len(slots) == 1 else f"{names[0]}..{names[-1]}")
        flat = None
        if len(slots) > 1:
            first = slots[0].param
            offset = 0
            for slot in slots:
                slot.offset = offset
                offset += slot.param.numel()
            flat = torch.zeros(offset, dtype=first.dtype, device=first.device)
        # Buckets later in backward order hold the layers the next forward needs first.
        bucket = _Bucket(key=key, slots=slots, priority=index, flat=flat, names=names)
        for slot in slots:
            slot.bucket = bucket
        bucket.reset()
        return bucket

    def _initial_value(self, bucket: _Bucket) -> torch.Tensor:
        """What the bucket's key starts with: the weights (rank 0's win) with a server
        optimizer, else zeros (a round's sum replaces them)."""
        params = [slot.param.detach() for slot in bucket.slots]
        if self._server is not None:
            if bucket.flat is None:
                return params[0]
            return torch.cat([p.reshape(-1) for p in params])
        # (on the parameters' device: a host's workers sum GPU keys on their GPUs)
        first = params[0] if bucket.flat is None else bucket.flat
        return torch.zeros(first.shape, dtype=first.dtype, device=first.device)

    # the optimizer's face (the rest is StoreWrappedOptimizer's) ---------------------------------

    @property
    def keys(self) -> tuple[str, ...]:
        """The wrapper's keys, in backward order (one per bucket)."""
        return tuple(bucket.key for bucket in self._buckets)

    @property
    def buckets(self) -> tuple[tuple[str, ...], ...]:
        """The parameter names of each bucket, in backward order."""
        return tuple(tuple(bucket.names) for bucket in self._buckets)

    def __repr__(self) -> str:
        server = "" if self._server is None else f", server_optimizer={self._server[0]!r}"
        return (
            f"DistributedOptimizer({self._optimizer.__class__.__name__}, "
            f"{len(self._buckets)} keys, backward_passes_per_step={self._passes_per_step}"
            f"{server})"
        )

    # backward ----------------------------------------------------------------------------------

    def _on_gradient(self, slot: _Slot) -> None:
        """A backward pass accumulated ``slot``'s gradient (runs inside backward)."""
        slot.passes += 1
        if slot.passes > self._passes_per_step:
            raise UsageError(
                f"parameter {slot.name!r} received gradients from {slot.passes} backward passes "
                f"without a step(), but backward_passes_per_step={self._passes_per_step}: call "
                f"step() (or zero_grad() to drop the step) after that many passes"
            )
        if slot.passes < self._passes_per_step:
            return
        grad = slot.param.grad
        if grad is not None and grad.layout != torch.strided:
            raise UsageError(
                f"parameter {slot.name!r} has a {grad.layout} gradient; DistributedOptimizer "
                f"pushes dense gradients only"
            )
        self._gradient_ready(slot)

    def _gradient_ready(self, slot: _Slot) -> None:
        bucket = slot.bucket
        assert bucket is not None
        if bucket.flat is not None:
            self._fill(bucket, slot)
        slot.ready = True
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._push(bucket)

    @staticmethod
    def _fill(bucket: _Bucket, slot: _Slot) -> None:
        """Copy ``slot``'s gradient (zeros without one) into the bucket's flat buffer."""
        assert bucket.flat is not None
        param = slot.param
        region = bucket.flat[slot.offset : slot.offset + param.numel()].view(param.shape)
        with torch.no_grad():
            if param.grad is None:
                region.zero_()
            else:
                region.copy_(param.grad)

    def _push(self, bucket: _Bucket) -> None:
        if bucket.flat is not None:
            value = bucket.flat
        else:
            param = bucket.slots[0].param
            value = param.grad if param.grad is not None else torch.zeros_like(param)
        self._kv.push(bucket.key, value, priority=bucket.priority)
        bucket.pushed = True

    # step --------------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Finish this step's round: push what backward did not, pull every key, and leave the
        mean gradient in every synchronized parameter's ``.grad`` (with a server optimizer: the
        servers' weights in the parameters).

        ``step()`` calls it; call it yourself to work on the mean gradient before the step
        (clipping, ``GradScaler.unscale_``); ``step()`` then does not synchronize again.
        """
        if self._synchronized:
            return
        for bucket in self._buckets:
            if bucket.pushed:
                continue
            # Parameters that backward did not reach (often enough) this step: every worker
            # pushes every key in a round, so they go with what they have (or zeros).
            for slot in bucket.slots:
                if not slot.ready and bucket.flat is not None:
                    self._fill(bucket, slot)
                slot.ready = True
            bucket.waiting = 0
            self._push(bucket)
        if self._server is not None:
            self._pull_weights()
        else:
            self._pull_mean_gradients()
        for bucket in self._buckets:
            bucket.reset()
        self._synchronized = True

    def _pull_mean_gradients(self) -> None:
        outs = []
        for bucket in self._buckets:
            if bucket.flat is not None:
                outs.append(bucket.flat)
                continue
            param = bucket.slots[0].param
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            outs.append(param.grad)
        self._kv.pull(list(self.keys), out=outs)
        workers = self._kv.num_workers
        with torch.no_grad():
            for bucket, out in zip(self._buckets, outs, strict=True):
                if workers > 1:
                    out.div_(workers)
                if bucket.flat is None:
                    continue
                for slot in bucket.slots:
                    param = slot.param
                    mean = bucket.flat[slot.offset : slot.offset + param.numel()]
                    if param.grad is None:
                        param.grad = mean.view(param.shape).clone()
                    else:
                        param.grad.copy_(mean.view(param.shape))

    def _pull_weights(self) -> None:
        outs = [
            bucket.slots[0].param.detach() if bucket.flat is None else bucket.flat
            for bucket in self._buckets
        ]
        self._kv.pull(list(self.keys), out=outs)
        with torch.no_grad():
            for bucket in self._buckets:
                if bucket.flat is None:
                    continue
                for slot in bucket.slots:
                    param = slot.param
                    weights = bucket.flat[slot.offset : slot.offset + param.numel()]
                    param.copy_(weights.view(param.shape))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize (unless :meth:`synchronize` already did) and run the wrapped
        optimizer's step (not with a server optimizer, whose servers already updated the
        weights).

        ``closure`` is evaluated once, before the synchronization (it runs backward, whose
        hooks push); optimizers that evaluate it several times (LBFGS) are not supported.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        self._synchronized = False  # the next step synchronizes again
        if self._server is None:
            self._optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (the wrapped optimizer's ``zero_grad``).

        Called between a backward and its step, it drops the step: gradients pushed already
        form a round that nobody pulls, and every worker must drop the same steps.
        """
        self._optimizer.zero_grad(set_to_none=set_to_none)
        if not self._synchronized:
            for bucket in self._buckets:
                bucket.reset()

    def update_server_optimizer(self, **hyperparameters: Any) -> None:
        """Change hyperparameters of the server optimizer (a learning-rate schedule);
        collective, between steps: every worker calls it with the same values.

        Raises:
            UsageError: the wrapper has no server optimizer.
            OptimizerError: bad hyperparameters (from the store).
        """
        if self._server is None:
            raise UsageError(
                "this DistributedOptimizer runs its optimizer on the workers: change the "
                "wrapped optimizer's param_groups instead"
            )
        name, current = self._server
        merged = {**current, **hyperparameters}
        self._kv.set_optimizer(name, **merged)
        self._server = (name, merged)

    # checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, plus a ``"kvstore"`` entry describing the
        wrapper (parameters in backward order, buckets, passes per step, compression, server
        optimizer), which :meth:`load_state_dict` checks, and a ``"kvstore_codec_state"``
        entry: this worker's codec state of the wrapper's keys (:meth:`kvstore.KVStore.
        codec_state`: residuals, DGC's momentum and velocity, PowerSGD's error and factor,
        push counts), its arrays as CPU tensors so that ``torch.load`` with its default
        ``weights_only=True`` reads it.

        Call it between steps, on every worker (the codec state is each worker's own). A
        server optimizer's state and the keys' values live on the servers:
        ``kv.save_checkpoint(path)`` / ``kv.load_checkpoint(path)`` (collective) save and
        restore them (docs/torch.md, "Checkpoints").
        """
        state = self._optimizer.state_dict()
        state["kvstore"] = {
            "buckets": [list(bucket.names) for bucket in self._buckets],
            "backward_passes_per_step": self._passes_per_step,
            "compression": self._compression,
            "server_optimizer": None
            if self._server is None
            else [self._server[0], dict(self._server[1])],
        }
        state[CODEC_STATE_ENTRY] = _as_tensors(self._kv.codec_state(list(self.keys)))
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of :meth:`state_dict` (or of the wrapped optimizer alone).

        The codec state, where the state dict has one, must be this worker's, of the same
        keys, compression and chunk plan; it is restored into the store
        (:meth:`kvstore.KVStore.load_codec_state`), so the next pushes encode as the saving
        run's did. A state dict without one leaves the store's codec state as it is.
        Nothing changes when a check fails.

        Raises:
            ValueError: it was saved by a wrapper over other parameters, buckets or keys, or
                the wrapped optimizer refuses its part.
            CheckpointError, CodecError: the codec state is another worker's or does not fit
                the wrapper's keys (from the store, naming the key).
        """
        state = dict(state_dict)
        saved = state.pop("kvstore", None)
        codec_state = state.pop(CODEC_STATE_ENTRY, None)
        if saved is not None:
            mine = [list(bucket.names) for bucket in self._buckets]
            if saved.get("buckets") != mine:
                raise ValueError(
                    "the state dict was saved by a DistributedOptimizer over other parameters "
                    f"or buckets: saved {_short(saved.get('buckets'))}, here {_short(mine)}"
                )
        if codec_state is None:
            self._optimizer.load_state_dict(state)
            return
        saved_keys = _keys_of(codec_state)
        if saved_keys is not None and saved_keys != list(self.keys):
            raise ValueError(
                "the state dict's codec state is of other keys (another key_prefix?): saved "
                f"{_short(saved_keys)}, here {_short(list(self.keys))}"
            )
        codec_state = _as_arrays(codec_state)
        # The store checks everything before it changes anything; the wrapped optimizer's
        # state is put back if it refuses.
        previous = self._optimizer.state_dict()
        self._optimizer.load_state_dict(state)
        try:
            self._kv.load_codec_state(codec_state)
        except BaseException:
            self._optimizer.load_state_dict(previous)
            raise

    def remove_hooks(self) -> None:
        """Stop pushing from backward (the keys stay in the store)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _hook(owner: weakref.ref[DistributedOptimizer], slot: _Slot) -> Callable[[Any], None]:
    def on_gradient(_param: Any) -> None:
        wrapper = owner()
        if wrapper is not None:
            wrapper._on_gradient(slot)

    return on_gradient


def _keys_of(codec_state: Any) -> list[Any] | None:
    """The keys a saved codec state describes, in order (None: it is malformed; the store
    says how)."""
    keys = codec_state.get("keys") if isinstance(codec_state, Mapping) else None
    if not isinstance(keys, list | tuple) or not all(isinstance(k, Mapping) for k in keys):
        return None
    return [k.get("key") for k in keys]


def _as_tensors(value: Any) -> Any:
    """``value`` with every numpy array replaced by a CPU tensor (sharing its memory: the
    store's codec state hands out copies)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, Mapping):
        return {k: _as_tensors(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_tensors(v) for v in value]
    return value


def _as_arrays(value: Any) -> Any:
    """The inverse of :func:`_as_tensors` (tensors on any device come back as host arrays;
    numpy arrays, from a state dict that never went through torch, stay)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, Mapping):
        return {k: _as_arrays(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_arrays(v) for v in value]
    return value


def _short(buckets: Any) -> str:
    text = repr(buckets)
    return text if len(text) <= 200 else text[:197] + "..."


def _server_spec(
    spec: ServerOptimizerSpec | None, num_workers: int
) -> tuple[str, dict[str, Any]] | None:
    """``(name, hyperparameters)`` with ``rescale_grad`` defaulting to ``1 / num_workers``."""
    if spec is None:
        return None
    if isinstance(spec, str):
        name, hyperparameters = spec, {}
    elif (
        isinstance(spec, tuple | list)
        and len(spec) == 2
        and isinstance(spec[0], str)
        and isinstance(spec[1], Mapping)
    ):
        name, hyperparameters = spec[0], dict(spec[1])
    else:
        raise TypeError(
            f"server_optimizer must be a name or (name, hyperparameters), e.g. "
            f"('sgd', {{'learning_rate': 0.1}}); got {spec!r}"
        )
    hyperparameters.setdefault("rescale_grad", 1.0 / num_workers)
    return name, hyperparameters


def _check_store(kv: Any, server: tuple[str, dict[str, Any]] | None) -> None:
    if server is not None:
        return
    if kv.type == "dist_async":
        raise UsageError(
            "dist_async applies every push on arrival and pulls weights: give the "
            "DistributedOptimizer a server_optimizer"
        )
    if kv.optimizer is not None:
        raise UsageError(
            f"the store runs {kv.optimizer!r} on the servers, so its pulls are weights, not "
            f"gradient sums: pass server_optimizer=... to the DistributedOptimizer instead of "
            f"calling kv.set_optimizer"
        )


def _synchronized_parameters(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None
) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's trainable parameters with their names, in registration order.

    Raises:
        ValueError: a name is used for two tensors, or a parameter of the optimizer has none.
        TypeError: ``named_parameters`` is not (name, tensor) pairs.
    """
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named: list[tuple[str, torch.Tensor]] = [
            (f"group{g}.{i}", p)
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        ]
    else:
        named = list(named_parameters)
    wanted = {id(p) for p in in_optimizer}
    chosen: list[tuple[str, torch.Tensor]] = []
    ids: set[int] = set()
    names: set[str] = set()
    for item in named:
        if not (
            isinstance(item, tuple | list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise TypeError(
                f"named_parameters must give (name, tensor) pairs, like "
                f"model.named_parameters(); got {type(item).__name__}"
            )
        name, param = item
        if id(param) not in wanted or id(param) in ids:
            continue  # not trained by this optimizer, or a second name of a shared tensor
        if name in names:
            raise ValueError(f"two parameters are named {name!r}; keys need distinct names")
        ids.add(id(param))
        names.add(name)
        chosen.append((name, param))
    unnamed = [p for p in in_optimizer if id(p) not in ids]
    if unnamed:
        shapes = [tuple(p.shape) for p in unnamed[:3]]
        raise ValueError(
            f"{len(unnamed)} parameter(s) of the optimizer (shapes {shapes}) are not in "
            f"named_parameters; pass the model's named_parameters() that the optimizer trains"
        )
    trainable = [(name, p) for name, p in chosen if p.requires_grad]
    if not trainable:
        raise ValueError("the optimizer has no parameter that requires a gradient")
    for name, param in trainable:
        if math.prod(param.shape) == 0:
            raise ValueError(f"parameter {name!r} is empty; a key needs at least one element")
    return trainable


__all__ = ["DistributedOptimizer", "ServerOptimizerSpec"]
