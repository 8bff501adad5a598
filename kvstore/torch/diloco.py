"""``DiLoCo``: local inner steps, an outer optimizer on the servers (Douillard et al. 2023,
"DiLoCo: Distributed Low-Communication Training of Language Models").

Every worker trains its own copy of the model with any torch optimizer (the *inner* optimizer,
whose state never leaves the worker). Every ``sync_every`` inner steps the workers take one
*outer* step together:

- each worker pushes its pseudo-gradient ``Δ = θ - θ_local`` (``θ``: the outer weights it last
  pulled; ``θ_local``: its parameters after the inner steps), compressed by the keys' push codec
  with that codec's error feedback;
- the servers apply the outer optimizer (MXNet formulas, :mod:`kvstore.server.optimizers`) to
  the mean over workers (``rescale_grad = 1 / num_workers``) once per round (``dist_sync``), or
  to each worker's ``Δ / num_workers`` on its arrival (``dist_async``);
- each worker pulls the new ``θ`` (through the store's pull compression, if any) into its
  parameters and keeps it as the start of the next ``Δ``.

On a ``dist_async`` store this is asynchronous local SGD: a worker's sync waits for nothing but
its own push (the pull returns the latest ``θ``, with whatever the other workers pushed so far),
so a slow worker does not hold the fast ones back. The result depends on the order in which the
pushes arrive; each ``Δ`` starts from the ``θ`` its worker last pulled, however many outer
steps the others took since (it is stale by that many steps, and the outer step does not
correct for it).

The keys hold ``θ``, initialised from rank 0's parameters, so every worker starts from the same
model. Outer ``sgd`` with learning rate 1 and no momentum is plain model averaging (local SGD);
with ``sync_every=1`` and plain SGD inside, that is synchronous data-parallel SGD. The paper's
outer step is Nesterov SGD with learning rate 0.7 and momentum 0.9 (the default here); the
servers' ``nesterov=True`` is MXNet's NAG, which for ``wd=0`` is torch's
``SGD(nesterov=True, dampening=0)``.

A pseudo-gradient is a push and ``θ`` is a pull: nothing new travels on the wire, and the
servers need not know that a round is an outer step.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"):
``fragments=F`` splits the keys into F contiguous fragments in layer order, balanced by element
count, each synced every H steps at staggered steps (fragment ``f`` at the steps ``t`` with
``(t - f*H/F) % H == 0``), which divides the bytes of one sync (the peak a link carries) by
about F and keeps the total. ``overlap=τ`` pushes a fragment's ``Δ`` at its sync step and pulls
its ``θ`` τ inner steps later, while the worker trains on; the late ``θ`` is then mixed with the
fragment's local weights, ``θ_local ← (1 - α)·θ + α·θ_local`` (``mixing=α``, the paper's 0.5).

Buffers (``buffers=model.named_buffers()``: BatchNorm's running statistics) are averaged at
each sync of fragment 0 (every H steps) and at :meth:`DiLoCo.synchronize`: their keys are the
store's *averaged* keys (``kv.init(..., averaged=True)``), which the outer optimizer does not
touch; on ``dist_async`` each worker's push moves them 1/N of the way to its buffers.

On ``dist_async`` stores the outer step is staleness-aware only through the servers'
optimizer: ``("sgd", {..., "nesterov": True, "momentum_every": N})`` (delayed Nesterov: the
momentum taken once every N arrivals, plain steps in between) or ``"dcasgd"``; a resumed
asynchronous run does not repeat the original bit for bit (the arrival order decides the
result). :meth:`DiLoCo.state_dict` is refused while a fragment's round is in flight (see
:class:`DiLoCo`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from kvstore.codecs import codec_from_spec
from kvstore.errors import CodecError, UsageError
from kvstore.torch.optimizer import (
    CODEC_STATE_ENTRY,
    ServerOptimizerSpec,
    StoreWrappedOptimizer,
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

DEFAULT_MIXING = 0.5
"""Streaming DiLoCo's mixing factor α for overlapped rounds (the paper's choice)."""

DEFAULT_KEY_PREFIX = "kvt.diloco/"

STATE_ENTRY = "kvstore_diloco"
"""The entry of :meth:`DiLoCo.state_dict` that describes the wrapper and its outer weights."""

SUPPORTED_STORES = ("dist_sync", "dist_async", "local")


class DiLoCo(StoreWrappedOptimizer):
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

    On ``dist_sync`` (and ``local``) stores a sync is collective: the outer step waits for
    every worker's ``Δ``. On ``dist_async`` stores each worker's ``Δ`` is applied on arrival
    (weighted by ``rescale_grad``, ``1 / num_workers`` by default) and its sync returns the
    latest ``θ`` without waiting for the others; momentum and Adam's moments then mix the
    workers' pseudo-gradients in arrival order, unless the outer optimizer is delayed Nesterov
    (``momentum_every``) or ``dcasgd``. Codecs with several round trips per step
    (``powersgd``) are refused there, before anything is sent.

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer``), stepped on every call
            of :meth:`step`; its state stays on this worker and is kept across syncs.
        named_parameters: ``model.named_parameters()``: names for the keys, the same on every
            worker. None: names ``group{g}.{i}`` from the optimizer's parameter groups.
        kv: the store (``dist_sync``, ``dist_async`` or ``local``).
        sync_every: H, the inner steps per outer step.
        outer: the outer optimizer run by the servers, ``(name, hyperparameters)`` of
            :meth:`kvstore.KVStore.set_optimizer` (``"sgd"`` with ``momentum`` and
            ``nesterov``, or ``"adam"``); ``rescale_grad`` defaults to ``1 / num_workers``,
            making the outer gradient the mean pseudo-gradient.
        compression: the push codec of the pseudo-gradients (``{"type": "topk", "ratio":
            0.01}``), with its error feedback; None: the store's
            (:meth:`kvstore.KVStore.set_gradient_compression`).
        fragments: F, Streaming DiLoCo's number of fragments: the keys in ``named_parameters``
            order cut into F contiguous groups, the cut whose largest group (in elements) is
            smallest (:attr:`fragment_keys`). Fragment ``f`` syncs after the steps ``t`` with
            ``(t - f*H/F) % H == 0``: every key once every H steps, one fragment every H/F
            steps. H must be a multiple of F, and F at most the number of parameters.
        overlap: τ, the inner steps a fragment's round travels while the worker trains on
            (``0 <= τ < H/F``): ``Δ`` is pushed after the sync step ``t``, ``θ`` pulled after
            step ``t + τ`` (the pull waits for the round). 0: each sync completes inside the
            step that starts it.
        mixing: α, used only when ``overlap > 0``: on the late pull the fragment's parameters
            become ``(1 - α)·θ + α·θ_local`` (``θ_local``: after the τ steps; α = 0 drops them,
            α = 1 keeps only them). With ``overlap=0`` the pulled ``θ`` replaces them.
        key_prefix: prepended to the parameter and buffer names to make the keys.
        buffers: ``model.named_buffers()``: buffers averaged over the workers at each sync of
            fragment 0 and at :meth:`synchronize`, pushed dense (float buffers; integer ones,
            such as BatchNorm's ``num_batches_tracked``, stay each worker's own). None: no
            buffer is synchronized.

    Each fragment's sync is the same round as the whole model's (push ``Δ`` of its keys, the
    outer step on the servers, pull ``θ``), so the outer optimizer's per-key state is the
    same; the start of the next ``Δ`` is the pulled ``θ``, not the mixed weights.

    :meth:`state_dict` is refused while a round is in flight (after the sync step and before
    its pull, with ``overlap > 0``): save after the steps ``t`` with ``t % (H/F) >= τ``, or
    call :meth:`synchronize` first.

    Raises:
        TypeError, ValueError: bad arguments (naming them).
        UsageError: a store of another type than ``dist_sync``, ``dist_async`` or ``local``.
        CodecError: on ``dist_async``, a ``compression`` with several round trips per sync
            (``powersgd``), before anything is sent.
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
        mixing: float = DEFAULT_MIXING,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        buffers: Iterable[tuple[str, torch.Tensor]] | None = None,
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
        if sync_every % fragments != 0:
            raise ValueError(
                f"sync_every must be a multiple of fragments (one fragment syncs every "
                f"sync_every/fragments steps), got sync_every={sync_every}, fragments={fragments}"
            )
        if overlap >= sync_every // fragments:
            raise ValueError(
                f"overlap must be < sync_every/fragments = {sync_every // fragments} (a round "
                f"lands before the next fragment's starts), got overlap={overlap}"
            )
        if (
            isinstance(mixing, bool)
            or not isinstance(mixing, int | float)
            or not 0.0 <= mixing <= 1.0
        ):
            raise ValueError(f"mixing must be a number in [0, 1], got {mixing!r}")
        if not isinstance(key_prefix, str):
            raise TypeError(f"key_prefix must be a str, got {type(key_prefix).__name__}")
        if kv.type not in SUPPORTED_STORES:
            raise UsageError(
                f"DiLoCo runs on {', '.join(SUPPORTED_STORES)} stores; this store is {kv.type}"
            )
        try:
            spec = _server_spec(outer, kv.num_workers)
        except TypeError as exc:
            raise TypeError(
                f"outer must be a name or (name, hyperparameters), e.g. ('sgd', "
                f"{{'learning_rate': 0.7, 'momentum': 0.9, 'nesterov': True}}); got {outer!r}"
            ) from exc
        assert spec is not None
        if kv.type == "dist_async" and compression is not None:
            _check_async_codec(compression)
        self._optimizer = optimizer
        self._kv = kv
        self._sync_every = sync_every
        self._outer = spec
        self._compression = None if compression is None else dict(compression)
        named = _synchronized_parameters(optimizer, named_parameters)
        self._names = [name for name, _ in named]
        self._params = [param for _, param in named]
        self._keys = [key_prefix + name for name in self._names]
        self._buffers = _float_buffers(buffers, set(self._names))
        self._buffer_keys = [key_prefix + name for name, _ in self._buffers]
        if fragments > len(self._params):
            raise ValueError(
                f"fragments must be at most the number of parameters ({len(self._params)}), "
                f"got {fragments}"
            )
        self._overlap = overlap
        self._mixing = float(mixing)
        self._fragments = _contiguous_fragments([p.numel() for p in self._params], fragments)
        self._steps = 0
        # The fragment whose Δ was pushed and whose θ is not pulled yet, and the step count
        # after which it is pulled.
        self._in_flight: int | None = None
        self._pull_at = 0

        kv.set_optimizer(spec[0], **spec[1])
        kv.init(self._keys, [p.detach() for p in self._params], compression=self._compression)
        if self._buffers:
            kv.init(
                self._buffer_keys,
                [b for _, b in self._buffers],
                compression={"type": "none"},
                averaged=True,
            )
            self._pull_buffers()
        # θ as last pulled (rank 0's parameters at first): where every Δ starts from.
        self._theta = [
            torch.empty_like(p, memory_format=torch.contiguous_format) for p in self._params
        ]
        self._deltas = [torch.empty_like(theta) for theta in self._theta]
        self._pull_outer_weights()

    # the optimizer's face (the rest is StoreWrappedOptimizer's) ---------------------------------

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys, one per parameter, in the order of ``named_parameters``."""
        return tuple(self._keys)

    @property
    def buffer_keys(self) -> tuple[str, ...]:
        """The keys of the averaged buffers, in the order of ``buffers``."""
        return tuple(self._buffer_keys)

    @property
    def sync_every(self) -> int:
        """H: inner steps per outer step."""
        return self._sync_every

    @property
    def fragments(self) -> int:
        """F: the number of fragments."""
        return len(self._fragments)

    @property
    def fragment_keys(self) -> tuple[tuple[str, ...], ...]:
        """The keys of each fragment, fragment 0 first (contiguous, in parameter order)."""
        return tuple(tuple(self._keys[i] for i in fragment) for fragment in self._fragments)

    @property
    def overlap(self) -> int:
        """τ: the inner steps between a fragment's push and its pull."""
        return self._overlap

    @property
    def mixing(self) -> float:
        """α: the weight of the local parameters when a late ``θ`` is mixed in."""
        return self._mixing

    @property
    def round_in_flight(self) -> bool:
        """Whether a fragment's ``Δ`` was pushed and its ``θ`` not pulled yet."""
        return self._in_flight is not None

    @property
    def steps(self) -> int:
        """Inner steps taken (a fragment's sync follows every step whose count is a multiple
        of H/F)."""
        return self._steps

    def fragment_due(self, step: int) -> int | None:
        """The fragment whose sync starts after inner step ``step`` (counted from 1): ``f``
        with ``(step - f*H/F) % H == 0``, or None."""
        stride = self._sync_every // len(self._fragments)
        if step < 1 or step % stride != 0:
            return None
        return (step // stride) % len(self._fragments)

    @property
    def outer_weights(self) -> tuple[torch.Tensor, ...]:
        """``θ`` as last pulled, one tensor per key (the wrapper's own: do not write them)."""
        return tuple(self._theta)

    @property
    def synced(self) -> bool:
        """Whether the last step ended with the whole model's ``θ`` pulled and no round in
        flight (with one fragment, after every H-th step): :meth:`synchronize` now would push
        nothing but zeros, yet an outer optimizer with momentum would still move ``θ``."""
        whole = len(self._fragments) == 1 and self._steps % self._sync_every == 0
        return whole and self._in_flight is None

    @contextlib.contextmanager
    def outer_weights_loaded(self) -> Iterator[None]:
        """Inside the block the parameters hold ``θ`` as last pulled (the model the job agrees
        on, up to H - 1 steps behind the local weights), to evaluate it; the local weights are
        put back when the block ends."""
        with torch.no_grad():
            local = [param.detach().clone() for param in self._params]
            for param, theta in zip(self._params, self._theta, strict=True):
                param.copy_(theta)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, saved in zip(self._params, local, strict=True):
                    param.copy_(saved)

    def __repr__(self) -> str:
        return (
            f"DiLoCo({self._optimizer.__class__.__name__}, {len(self._keys)} keys, "
            f"sync_every={self._sync_every}, fragments={len(self._fragments)}, "
            f"overlap={self._overlap}, outer={self._outer[0]!r})"
        )

    # steps -------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step (the inner optimizer's ``step``); then, on the schedule, the pull of
        the round in flight and the start of a fragment's sync (collective on ``dist_sync``).
        Returns the closure's loss, if any."""
        loss = self._optimizer.step() if closure is None else self._optimizer.step(closure)
        self._steps += 1
        if self._in_flight is not None and self._steps >= self._pull_at:
            self._finish_round()
        fragment = self.fragment_due(self._steps)
        if fragment is not None:
            self._start_round(fragment)
            if self._overlap == 0:
                self._finish_round()
        return loss

    def synchronize(self) -> None:
        """An outer step of the whole model now: the round in flight, if any, lands first (its
        ``θ`` mixed in), then every key pushes ``Δ = θ - θ_local`` and pulls the servers' new
        ``θ`` into the parameters. Collective on ``dist_sync``: every worker calls it at the
        same point (after the last step of a run, it lands the last round and syncs what the
        schedule has not yet synced). On ``dist_async`` it waits for no other worker."""
        if self._in_flight is not None:
            self._finish_round()
        self._push_deltas(range(len(self._keys)))
        self._push_buffers()
        self._pull_outer_weights()
        self._pull_buffers()

    def _start_round(self, fragment: int) -> None:
        self._push_deltas(self._fragments[fragment])
        if fragment == 0:
            self._push_buffers()
        self._in_flight = fragment
        self._pull_at = self._steps + self._overlap

    def _push_buffers(self) -> None:
        if self._buffers:
            self._kv.push(self._buffer_keys, [b for _, b in self._buffers])

    def _pull_buffers(self) -> None:
        if self._buffers:
            self._kv.pull(self._buffer_keys, out=[b for _, b in self._buffers])

    def _push_deltas(self, indices: Iterable[int]) -> None:
        indices = list(indices)
        with torch.no_grad():
            for i in indices:
                torch.sub(self._theta[i], self._params[i].detach(), out=self._deltas[i])
        # The push encodes (copies) the values before it returns, and the round's pull waits
        # for this worker's pushes of the keys; a key's ``delta`` is written again only at its
        # next sync, after that pull.
        self._kv.push([self._keys[i] for i in indices], [self._deltas[i] for i in indices])

    def _finish_round(self) -> None:
        fragment = self._in_flight
        assert fragment is not None
        indices = self._fragments[fragment]
        self._kv.pull([self._keys[i] for i in indices], out=[self._theta[i] for i in indices])
        if fragment == 0:
            self._pull_buffers()
        self._in_flight = None
        with torch.no_grad():
            for i in indices:
                param, theta = self._params[i], self._theta[i]
                if self._overlap == 0:
                    param.copy_(theta)
                else:
                    # Streaming DiLoCo's mix: the outer result, late by τ steps, and the
                    # weights those τ steps reached.
                    param.mul_(self._mixing).add_(theta * (1.0 - self._mixing))

    def _pull_outer_weights(self) -> None:
        self._kv.pull(self._keys, out=self._theta)
        with torch.no_grad():
            for param, theta in zip(self._params, self._theta, strict=True):
                param.copy_(theta)

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
          outer weights ``θ`` last pulled (CPU tensors: the start of the pending ``Δ``),
          ``fragments``, ``overlap`` and ``mixing``;
        - ``"kvstore_codec_state"``: this worker's codec state of the keys (error-feedback
          residuals and the like, :meth:`kvstore.KVStore.codec_state`).

        Call it between steps on every worker. The servers' ``θ`` and outer optimizer state
        (momentum) go with ``kv.save_checkpoint(path)``; the parameters (``θ_local``) with the
        model's own state dict. Loading all three resumes a ``dist_sync`` run bit for bit, in
        this order: make the ``DiLoCo`` (collective; it pulls rank 0's parameters into the
        model), then ``model.load_state_dict``, :meth:`load_state_dict` and
        ``kv.load_checkpoint``.

        Raises:
            UsageError: a fragment's round is in flight (``overlap > 0``, between its push and
                its pull): its ``θ`` is not on this worker yet and the servers' round may be
                incomplete, so no saved state could resume it. Save after a step ``t`` with
                ``t % (H/F) >= overlap``, or after :meth:`synchronize`.
        """
        if self._in_flight is not None:
            raise UsageError(
                f"DiLoCo.state_dict: fragment {self._in_flight}'s round is in flight (pulled "
                f"after step {self._pull_at}, now {self._steps}); save after a step t with "
                f"t % {self._sync_every // len(self._fragments)} >= {self._overlap} "
                f"(overlap), or call synchronize() first"
            )
        state = self._optimizer.state_dict()
        state[STATE_ENTRY] = {
            "parameters": list(self._names),
            "sync_every": self._sync_every,
            "outer": [self._outer[0], dict(self._outer[1])],
            "compression": self._compression,
            "steps": self._steps,
            "outer_weights": [theta.detach().cpu().clone() for theta in self._theta],
            "fragments": len(self._fragments),
            "overlap": self._overlap,
            "mixing": self._mixing,
        }
        state[CODEC_STATE_ENTRY] = _as_tensors(self._kv.codec_state(self._keys))
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of :meth:`state_dict`: the inner optimizer's state, the step
        count, the outer weights and this worker's codec state (into the store). The state must
        come from a DiLoCo with the same ``fragments`` and ``overlap`` (they decide which round
        the step count leaves pending). The wrapper's ``sync_every``, ``mixing`` and outer
        optimizer are kept as constructed (a schedule changed with
        :meth:`update_outer_optimizer` is the caller's to restore: the saved hyperparameters
        are ``state_dict["kvstore_diloco"]["outer"]``). Nothing changes when a check fails.

        Raises:
            ValueError: it was not saved by a DiLoCo, or by one over other parameters or keys
                or with other fragments or overlap, or the inner optimizer refuses its part.
            UsageError: a round of this wrapper is in flight.
            CheckpointError, CodecError: the codec state is another worker's or does not fit
                the keys (from the store, naming the key).
        """
        if self._in_flight is not None:
            raise UsageError(
                f"DiLoCo.load_state_dict: fragment {self._in_flight}'s round is in flight; "
                f"load between rounds (or after synchronize())"
            )
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
        schedule = (saved.get("fragments", 1), saved.get("overlap", 0))
        if schedule != (len(self._fragments), self._overlap):
            raise ValueError(
                f"the state dict was saved with fragments={schedule[0]}, overlap={schedule[1]}; "
                f"this DiLoCo has fragments={len(self._fragments)}, overlap={self._overlap}"
            )
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


def _contiguous_fragments(sizes: list[int], count: int) -> list[list[int]]:
    """Cut ``range(len(sizes))`` into ``count`` non-empty contiguous groups whose largest sum
    of ``sizes`` is the smallest possible (the earliest cuts among equal ones)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[g][j]: the smallest largest group cutting the first j sizes into g groups; cut[g][j]
    # where the last of those groups starts.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for groups in range(1, count + 1):
        for end in range(groups, n - (count - groups) + 1):
            for start in range(groups - 1, end):
                largest = max(best[groups - 1][start], prefix[end] - prefix[start])
                if largest < best[groups][end]:
                    best[groups][end] = largest
                    cut[groups][end] = start
    bounds = [n]
    for groups in range(count, 0, -1):
        bounds.append(cut[groups][bounds[-1]])
    bounds.reverse()
    return [list(range(bounds[g], bounds[g + 1])) for g in range(count)]


def _float_buffers(
    buffers: Iterable[tuple[str, torch.Tensor]] | None, parameter_names: set[str]
) -> list[tuple[str, torch.Tensor]]:
    """The float buffers of ``named_buffers()`` (the ones a mean means something for)."""
    if buffers is None:
        return []
    found = []
    for item in buffers:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(
                f"buffers must be (name, tensor) pairs, as model.named_buffers() gives; got "
                f"{type(item).__name__}"
            )
        name, tensor = item
        if name in parameter_names:
            raise ValueError(f"buffer {name!r} has the name of a parameter")
        if tensor.is_floating_point():
            found.append((name, tensor))
    return found


def _check_async_codec(compression: Mapping[str, Any]) -> None:
    """Refuse, before the collective calls, a push codec that ``dist_async`` cannot run."""
    codec = codec_from_spec(dict(compression))
    if codec.round_trips > 1:
        raise CodecError(
            f"DiLoCo on a dist_async store: compression {codec.name!r} needs "
            f"{codec.round_trips} round trips per sync, which only dist_sync provides (each "
            f"worker's pseudo-gradient is applied on its arrival); use a one-message codec "
            f"(2bit, topk, fp16, ...) or a dist_sync store"
        )


def _check_count(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


__all__ = ["DEFAULT_MIXING", "DEFAULT_OUTER", "DiLoCo"]
