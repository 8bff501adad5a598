"""Server state of one key chunk: its value, its round, its optimizer state.

A chunk (see :mod:`kvstore.topology`) is the unit of server state: every chunk has its own
``dist_sync`` round, so the chunks of one big key are received, decoded, aggregated, updated and
replied independently and overlap.

Values live in two dtypes when needed: the *wire* dtype that pushes and pulls use (the key's
dtype) and the *accumulator* dtype the server sums and updates in (float32 for float16 keys, int64
for int32 keys; see :func:`kvstore.codecs.accumulator_dtype`). When they are the same the
published array is the weights, and updates are written out of place into a spare array
(:mod:`kvstore.server.published`); otherwise a master copy in the accumulator dtype is updated in
place and cast into the spare.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvstore.codecs import Aggregator, Codec, accumulator_dtype
from kvstore.codecs.pulled import PublishedWeights
from kvstore.server.optimizers import Optimizer
from kvstore.server.published import PublishedValue
from kvstore.topology import Key
from kvstore.wire import Op


def named_with(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The checkpoint arrays whose names start with ``prefix`` (``"opt."``: the optimizer's,
    ``"agg."``: the aggregator's), under their names without it."""
    return {name[len(prefix) :]: a for name, a in arrays.items() if name.startswith(prefix)}


class PendingReply(NamedTuple):
    """Where and how to answer a request later.

    Attributes:
        identity: the worker's ROUTER routing id.
        rid: the request id.
        rank: the worker's rank.
        want_value: reply with the chunk's value (pull, pushpull) rather than an empty ack.
        op: the request's operation (what the metrics count the reply under).
        relay_max: the worker takes a relayed value of at most this many pushes (0: dense).
        pull_version: with pull compression, the version of ``w_pub`` the worker holds (-1:
            none yet; see :mod:`kvstore.codecs.pulled`); None without.
    """

    identity: bytes
    rid: int
    rank: int
    want_value: bool
    op: Op
    relay_max: int = 0
    pull_version: int | None = None  # the w_pub version the worker holds (compressed pulls)


@dataclass(frozen=True)
class ChunkSpec:
    """What a worker declares about a chunk at init; all workers must declare the same."""

    key: Key
    index: int
    start: int
    numel: int
    dtype: str
    shape: tuple[int, ...]
    codec: tuple[tuple[str, Any], ...]
    pull: tuple[tuple[str, Any], ...] = ()  # the pull compression spec; () for dense pulls
    # The chunk holds the mean of the workers' pushes, and the server optimizer never touches
    # it (kv.init(..., averaged=True)): see ChunkState.apply_average.
    averaged: bool = False

    def describe(self) -> str:
        codec = dict(self.codec)
        pull = f", pull compression {dict(self.pull)}" if self.pull else ""
        averaged = ", averaged=True" if self.averaged else ""
        return (
            f"shape {self.shape} {self.dtype}, elements [{self.start}, {self.start + self.numel}), "
            f"compression {codec}{pull}{averaged}"
        )

    @property
    def name(self) -> str:
        return f"key {self.key!r} chunk {self.index}"


@dataclass
class PullWaiter:
    """A pull that waits until ``after`` of its worker's pushes of the chunk are applied.

    ``acks`` collects the ids of that worker's pushes its value reply will acknowledge.
    """

    reply: PendingReply
    after: int
    acks: list[int] = field(default_factory=list)


@dataclass
class Deferred:
    """A push that arrived while its worker already had a push in the current round."""

    reply: PendingReply
    payloads: list[Any]


@dataclass
class ChunkState:
    """Everything a server keeps for one chunk."""

    spec: ChunkSpec
    codec: Codec
    declared: dict[int, ChunkSpec] = field(default_factory=dict)
    init_waiters: list[PendingReply] = field(default_factory=list)
    value: PublishedValue | None = None
    master: np.ndarray | None = None
    _aggregator: Aggregator | None = None
    # round bookkeeping (dist_sync)
    round_ranks: set[int] = field(default_factory=set)
    round_replies: list[PendingReply] = field(default_factory=list)
    round_error: BaseException | None = None
    accumulated: int = 0
    round_started: float = 0.0  # perf_counter() of the round's first push (with metrics only)
    round_payloads: list[Any] = field(default_factory=list)  # in the order they were summed
    # The payloads whose decoded sum (in this order) is the published value, when the codec
    # lets a worker redo that sum (a relayed pull); None when the value is anything else.
    relay: list[Any] | None = None
    deferred: deque[Deferred] = field(default_factory=deque)
    # pushes of each rank that are done (applied, or failed); a pull says how many it follows
    applied: Counter[int] = field(default_factory=Counter)
    pull_waiters: list[PullWaiter] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    optimizer_name: str | None = None
    optimizer_state: dict[str, Any] | None = None
    updates: int = 0
    # compressed pulls (kvstore.codecs.pulled): the codec, the workers' w_pub in dist_sync,
    # one per worker rank in dist_async
    pull_codec: Codec | None = None
    pull: PublishedWeights | None = None
    pull_by_rank: dict[int, PublishedWeights] = field(default_factory=dict)
    # replication (kvstore.server.replication): the rank of the chunk's primary server; the
    # rounds it had (each forwarded to its backups, or replayed from its primary); pushes of
    # each rank this server knows of (received, or in a replayed round), by which a push
    # resent after a failover is recognised; the pushes of the round being summed, in
    # order; and the frames the last round answered with (a multi-round codec's reply)
    shard: int = 0
    rounds: int = 0
    pushes_seen: Counter[int] = field(default_factory=Counter)
    round_pushes: list[tuple[int, list[Any]]] = field(default_factory=list)
    last_answer: list[bytes] | None = None
    joined: set[int] = field(default_factory=set)  # servers caught up with this chunk since
    # dist_async's per-worker w_pub changes at each pull, which is not replicated: a replica
    # that takes the chunk over starts them at a version no worker holds (a dense first reply)
    pull_base: int = 0

    @property
    def initialized(self) -> bool:
        return self.value is not None

    @property
    def aggregator(self) -> Aggregator:
        if self._aggregator is None:
            spec = self.spec
            self._aggregator = self.codec.make_chunk_aggregator(
                spec.numel, spec.dtype, shape=spec.shape, start=spec.start, key=spec.key
            )
        return self._aggregator

    def set_initial_value(self, values: np.ndarray, mode: str | None) -> None:
        """Store rank 0's init value (copied: the frame's memory belongs to ZeroMQ); with
        compressed pulls in ``dist_sync``, the workers' ``w_pub`` too (``dist_async`` makes one
        per worker at its first pull)."""
        wire = np.array(values, dtype=np.dtype(self.spec.dtype), copy=True)
        self.relay = None
        acc = accumulator_dtype(self.spec.dtype)
        self.master = None if wire.dtype == acc else wire.astype(acc)
        self.value = PublishedValue(wire)
        self.pull_by_rank = {}
        if self.pull_codec is not None and mode != "dist_async":
            self.pull = PublishedWeights(self.pull_codec, self.spec.key, wire)

    def pulled_weights(self, rank: int) -> PublishedWeights:
        """The ``w_pub`` a compressed pull of worker ``rank`` is answered from: the one of all
        workers in ``dist_sync``; in ``dist_async`` the worker's own (the current value at its
        first pull), moved on to the current value when the worker holds its version."""
        assert self.value is not None and self.pull_codec is not None
        if self.pull is not None:
            return self.pull
        own = self.pull_by_rank.get(rank)
        if own is None:
            own = PublishedWeights(self.pull_codec, self.spec.key, self.value.current)
            own.version = self.pull_base
            self.pull_by_rank[rank] = own
        return own

    def busy(self, locked_here: bool = False) -> str | None:
        """What is in flight on this chunk (a round, deferred pushes, waiting requests, work
        holding its lock), or None when it is quiescent: its state is then what the next round
        starts from, which is what a checkpoint saves."""
        if self.round_ranks or self.accumulated or self.deferred:
            ranks = sorted(self.round_ranks | {d.reply.rank for d in self.deferred})
            return f"{self.spec.name} has a round in flight (pushes of rank(s) {ranks})"
        if self.init_waiters:
            return f"{self.spec.name} is being initialised"
        if self.pull_waiters:
            return f"{self.spec.name} has pulls waiting for pushes"
        if self.lock.locked() and not locked_here:  # (held by the caller: not busy for it)
            return f"{self.spec.name} is being updated"
        return None

    def checkpoint_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The chunk's state for a checkpoint: arrays (the live ones, not copies: save while the
        chunk's lock is held) and JSON metadata.

        Arrays: ``value`` (the published value, the key's dtype), ``master`` (the accumulator
        copy of a float16 key), ``pull.w_pub`` (with compressed pulls in ``dist_sync``: the
        weights the workers hold), ``opt.NAME`` (the optimizer's arrays), ``agg.NAME`` (what the
        codec's aggregator carries from one round to the next: the sketch codec's tables; most
        aggregators carry nothing).
        """
        assert self.value is not None
        arrays = {"value": self.value.current}
        if self.master is not None:
            arrays["master"] = self.master
        if self.pull is not None:  # what the workers hold (dist_sync)
            arrays["pull.w_pub"] = self.pull.w_pub
        meta: dict[str, Any] = {"updates": self.updates, "optimizer": None, "scalars": {}}
        if self.pull is not None:
            meta["pull_version"] = self.pull.version
        if self._aggregator is not None:  # a codec's server state (the sketch's tables)
            arrays.update({f"agg.{n}": a for n, a in self._aggregator.state().items()})
        if self.optimizer_name is not None and self.optimizer_state is not None:
            # Arrays and integer counters (Adam's step count); entries not made yet (SGD's
            # momentum before its first update with momentum) are None and left out.
            meta["optimizer"] = self.optimizer_name
            for name, entry in self.optimizer_state.items():
                if isinstance(entry, np.ndarray):
                    arrays[f"opt.{name}"] = entry
                elif isinstance(entry, int):
                    meta["scalars"][name] = entry
        return arrays, meta

    def restore(
        self,
        arrays: dict[str, np.ndarray],
        state: dict[str, Any] | None,
        meta: dict[str, Any],
        out: np.ndarray,
    ) -> None:
        """Make the chunk's state the saved one (after :meth:`busy` said it is quiescent, with
        its lock held; runs on an executor thread). ``arrays`` were checked against the spec;
        ``state`` is the optimizer state rebuilt by ``Optimizer.import_state`` (None: none).

        The saved value goes into ``out``, a spare from ``value.spare()`` that the caller
        publishes afterwards on the loop thread (a reply in flight keeps reading the old one);
        the master copy is overwritten in place.
        """
        np.copyto(out, arrays["value"], casting="no")
        if self.master is not None:
            np.copyto(self.master, arrays["master"], casting="no")
        self.relay = None  # the value is no longer the sum of the last round's pushes
        # Compressed pulls: the workers forget what they held when they load a checkpoint, so
        # the next pull sends each of them w_pub whole (the saved one, or the value).
        self.pull_by_rank = {}
        if self.pull is not None:
            saved = arrays.get("pull.w_pub")
            held = saved if saved is not None and saved.shape == out.shape else out
            self.pull.restore(np.asarray(held, dtype=np.float32), meta.get("pull_version", 0))
        self.aggregator.load_state(named_with(arrays, "agg.") or None)
        self.optimizer_name = meta["optimizer"] if state is not None else None
        self.optimizer_state = state
        self.updates = int(meta["updates"])

    def apply_update(self, grad: np.ndarray, optimizer: Optimizer | None, out: np.ndarray) -> None:
        """Write the value after this round into ``out`` (runs on an executor thread).

        Without an optimizer the new value is the round's aggregate itself; with one, the
        optimizer's update of the current weights by the aggregate.
        """
        assert self.value is not None
        # a float16 key's update runs on its float32 master copy, in place
        weights = self.value.current if self.master is None else self.master
        target = out if self.master is None else self.master
        if optimizer is None:
            np.copyto(target, grad)
        elif self.codec.applies_step_size:  # the aggregate is the step, learning rate included
            optimizer.apply_step(weights, target, grad)
        else:
            optimizer.step(weights, target, grad, self._optimizer_state(optimizer))
        if self.master is not None:
            np.copyto(out, self.master, casting="unsafe")
        self.updates += 1

    def apply_average(
        self,
        pushed: np.ndarray,
        num_workers: int,
        running: bool,
        out: np.ndarray,
        workers_per_push: int = 1,
    ) -> None:
        """Write the value of an averaged chunk after this update into ``out`` (runs on an
        executor thread); the server optimizer plays no part.

        ``running=False`` (``dist_sync`` and ``local``; ``pushed`` is the sum of the round's N
        decoded pushes): the mean, ``sum / N``. ``running=True`` (``dist_async``; ``pushed``
        is one worker's decoded push): the value moves 1/N of the way to it,
        ``w + (push - w) / N``, a running mean of the workers' pushes; a push that sums a
        host's ``workers_per_push`` workers (hierarchical aggregation) counts as theirs,
        ``w + (push - k w) / N``. Both are computed in the accumulator dtype (into the master
        copy of a float16 chunk), in that order of operations, so a test can compute the same
        bits.
        """
        assert self.value is not None
        target = out if self.master is None else self.master
        if running:
            current = self.value.current if self.master is None else self.master
            counted = current if workers_per_push == 1 else current * workers_per_push
            step = np.subtract(pushed, counted, out=out if self.master is None else None)
            step /= num_workers
            np.add(current, step, out=target)
        else:
            np.copyto(target, pushed)
            target /= num_workers
        if self.master is not None:
            np.copyto(out, self.master, casting="unsafe")
        self.updates += 1

    def _optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The chunk's state of ``optimizer``, made at its first update by it."""
        if self.optimizer_name != optimizer.name or self.optimizer_state is None:
            weights_dtype = accumulator_dtype(self.spec.dtype)
            self.optimizer_state = optimizer.new_state(self.spec.numel, weights_dtype)
            self.optimizer_name = optimizer.name
        return self.optimizer_state
