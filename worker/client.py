"""The worker-side client: :class:`KVStore`, with MXNet's ``push``/``pull`` vocabulary.

:class:`KVStore` checks each call's arguments and hands the work to its parts, which share the
store's job, settings, keys, counters and connection
(:class:`~kvstore.worker.store_state.StoreState`):

=============================================  ===============================================
:mod:`~kvstore.worker.keys`                    what the client keeps per key; key arguments
:mod:`~kvstore.worker.pushes`                  encoding and sending pushes, waiting for them
:mod:`~kvstore.worker.pulls`                   pull requests, and the wait for their values
:mod:`~kvstore.worker.landing`                 the replies put into ``out``
:mod:`~kvstore.worker.checkpoint_protocol`     checkpoints and the codec state
:mod:`~kvstore.worker.session`                 the handshake and the goodbyes
:mod:`~kvstore.worker.transport`               the sockets and the I/O thread
=============================================  ===============================================

Ordering: ``push`` returns once the values are encoded, without waiting for the network; a
pull request carries how many pushes of the chunk this worker sent so far, and each server
answers it only after that many were applied (in ``dist_sync``: after the whole round), so
``push`` followed by ``pull`` returns the round's result even though pulls travel on a
connection of their own. Errors of a push are raised by the next call that waits on it: a
later push or pull of the same key, ``barrier`` or ``close``.

Optional speed-ups live beside that path, each in a module of its own: pushes that prefetch
the round's value (:mod:`~kvstore.worker.prefetch`), relayed pulls
(:mod:`~kvstore.worker.relayed_pulls`), the push lead (:mod:`~kvstore.worker.push_lead`), the
send window (:mod:`~kvstore.worker.send_window`), the kernel's unsent-bytes limit
(:mod:`~kvstore.worker.connections`), and sends without copies (:mod:`kvstore.zerocopy`;
``borrow=True`` for the caller's own memory).

With ``KVSTORE_METRICS_PORT`` (``options.metrics``) the store serves Prometheus metrics
(:mod:`kvstore.metrics`) until it closes: the transport counts the traffic, and on one push of a
key in ``KVSTORE_METRICS_EVERY`` the encoders measure the key's residual norm and the density
sent (:meth:`~kvstore.codecs.Encoder.quality`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvstore._malloc import tune_malloc
from kvstore.codecs import Codec, codec_from_spec
from kvstore.codecs.identity import IdentityCodec
from kvstore.codecs.pulled import pull_codec_from_spec
from kvstore.config import ClusterConfig, WorkerOptions, check_replicas
from kvstore.errors import (
    CodecError,
    DuplicateInitError,
    KVStoreError,
    OptimizerError,
    ServerLostError,
    UsageError,
    ValueMismatchError,
)
from kvstore.metrics import WorkerMetrics
from kvstore.optimizer_spec import OptimizerSpec, make_optimizer_spec
from kvstore.topology import Key, replica_servers
from kvstore.wire import BarrierFields, InitFields, Op, SetOptimizerFields
from kvstore.worker import prefetch
from kvstore.worker import values as vals
from kvstore.worker.checkpoint_protocol import CheckpointProtocol
from kvstore.worker.compressed_pulls import ask_for_compressed_pulls, held_weights
from kvstore.worker.host_group import HostGroup
from kvstore.worker.keys import (
    KeyArg,
    KeyState,
    key_pairs,
    normalize_key,
    plan_key,
    servers_on_this_host,
)
from kvstore.worker.landing import Landing
from kvstore.worker.pulls import Pulls
from kvstore.worker.pushes import Pushes
from kvstore.worker.relayed_pulls import relay_limit
from kvstore.worker.request import Deadline, wait_all
from kvstore.worker.session import handshake, say_goodbye
from kvstore.worker.stats import TrafficStats
from kvstore.worker.store_state import StoreState
from kvstore.worker.transport import Transport


class KVStore:
    """A connection to the parameter servers (or, in ``local`` mode, to an in-process one).

    Create one with :func:`kvstore.create`; it is a context manager that closes itself.

    Attributes:
        type: ``"dist_sync"``, ``"dist_async"`` or ``"local"``.
        rank: this worker's rank.
        num_workers: the number of workers N.
        num_servers: the number of servers S.
    """

    def __init__(
        self,
        mode: str,
        cluster: ClusterConfig,
        options: WorkerOptions | None = None,
        *,
        context: Any = None,
        on_close: Any = None,
    ) -> None:
        self.type = mode
        self.rank = cluster.rank
        self.num_workers = cluster.num_workers
        self.num_servers = cluster.num_servers
        # Settings left to the job's size (push lead, TOS) are fixed here, once.
        self._options = (options or WorkerOptions()).for_job(cluster.num_workers)
        check_replicas(self._options.replicas, cluster.num_servers)
        self._codec: Codec = IdentityCodec()
        self._pull_codec: Codec | None = None  # compressed pulls (set_pull_compression)
        # Every worker reads the same addresses, so every worker plans the same chunks.
        self._servers_on_this_host = servers_on_this_host(cluster.servers)
        self._api_lock = threading.RLock()
        self._closed = False
        self._on_close = on_close
        tune_malloc()  # ZeroMQ's receive buffers get reused instead of page-faulted back
        identity = f"w{cluster.rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        metrics_config = self._options.metrics
        metrics: WorkerMetrics | None = None
        if metrics_config is not None:  # before the transport, which counts into it
            metrics = WorkerMetrics(metrics_config, cluster.rank, cluster.num_servers)
        lead, tos = self._options.push_lead, self._options.push_tos
        assert lead is not None and tos is not None  # (for_job filled them in)
        try:
            transport = Transport(
                cluster.servers,
                identity,
                context,
                window_bytes=2 * self._options.partition_bytes,
                lead_chunks=lead,
                tos=tos,
                queue_seconds=self._options.send_queue_ms / 1000,
                metrics=metrics,
                curve=self._options.curve,
                heartbeat_timeout=self._options.heartbeat_timeout,
                native_sends=self._options.native_sends,
                replicas=self._options.replicas,
            )
        except BaseException:
            if metrics is not None:
                metrics.close()
            raise
        # The host's other workers, where they aggregate first (kvstore.worker.host_group).
        self._host: HostGroup | None = None
        if mode != "local" and cluster.local_size > 1 and self._options.hierarchy:
            try:
                self._host = HostGroup(cluster, self._options.connect_timeout)
            except BaseException:
                transport.close()
                if metrics is not None:
                    metrics.close()
                raise
        # What the parts share.
        self._shared = StoreState(
            mode,
            cluster.rank,
            cluster.num_workers,
            cluster.num_servers,
            self._options,
            transport,
            TrafficStats(),
            {},
            metrics,
            workers_per_push=cluster.local_size if self._host is not None else 1,
        )
        self._pushes = Pushes(self._shared)
        self._pulls = Pulls(self._shared, self._pushes)
        self._checkpoints = CheckpointProtocol(self._shared, self._pushes)
        if metrics is not None:
            stats = self._shared.stats
            metrics.watch(
                lambda: (stats.pushed_bytes, stats.pushed_raw_bytes), transport.queue_depths
            )
        try:
            handshake(self._shared, cluster.servers)
        except BaseException:
            self._shutdown_transport()
            raise

    # lifecycle ---------------------------------------------------------------------------------

    def _shutdown_transport(self) -> None:
        try:
            self._shared.transport.close()
            if self._host is not None:
                self._host.close()
        finally:
            self._close_metrics()
            if self._on_close is not None:
                on_close, self._on_close = self._on_close, None
                on_close()

    def _close_metrics(self) -> None:
        metrics, self._shared.metrics = self._shared.metrics, None
        if metrics is not None:
            metrics.close()

    def close(self) -> None:
        """Wait for this worker's pushes to finish, say goodbye to the servers, release sockets.

        Idempotent. Raises the error of a failed push that nothing else reported.
        """
        with self._api_lock:
            if self._closed:
                return
            self._closed = True
        error: BaseException | None = None
        deadline = self._deadline()
        try:
            self._pushes.wait_all(deadline=deadline)
        except KVStoreError as exc:
            error = exc
        say_goodbye(self._shared, deadline)
        self._shutdown_transport()
        if error is not None:
            raise error

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("this KVStore is closed")

    def _deadline(self) -> Deadline:
        """The deadline of a blocking call starting now (see :meth:`StoreState.deadline`)."""
        return self._shared.deadline()

    # configuration -----------------------------------------------------------------------------

    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress the pushes of every key initialised after this call.

        Args:
            compression_params: ``{"type": name, **params}``, e.g.
                ``{"type": "2bit", "threshold": 0.5}``; ``{"type": "none"}`` turns it off.

        Raises:
            UsageError: a key was already initialised (the codec is fixed at init).
            CodecError: unknown codec type or bad parameters, a codec the optimizer already
                set cannot work with (DGC and momentum), or a codec with several round trips
                per step (PowerSGD) in ``dist_async``.
        """
        self._check_open()
        with self._api_lock:
            self._check_before_init("set_gradient_compression")
            codec = codec_from_spec(compression_params)
            self._check_codec(codec)
            self._codec = codec

    def set_pull_compression(self, spec: dict[str, Any]) -> None:
        """Compress what the servers send back to this worker: the pulls of every float32 key
        initialised after this call (collective: call it on every worker with the same spec,
        before ``init``; workers that disagree are refused at ``init``).

        The servers keep the weights the workers hold, ``w_pub``, and answer a pull with the
        compressed difference to the current value; both sides add its decoded form to
        ``w_pub``, and ``out`` receives ``w_pub``. What one pull leaves out travels with the
        next (error feedback on the downlink), and in ``dist_sync`` every worker holds
        bit-identical weights, encoded once per round for all of them. Pick the codec's
        parameters for weight differences: a 2-bit threshold near one step's change, not a
        gradient's.

        Args:
            spec: ``{"type": name, **params}`` with name ``fp16``, ``bf16``, ``2bit``, ``topk``,
                ``topk2bit`` or ``threshold``; ``{"type": "none"}`` (the default) pulls dense
                values.

        Raises:
            UsageError: a key was already initialised.
            CodecError: the spec is invalid or its codec cannot compress pulls.
        """
        self._check_open()
        with self._api_lock:
            self._check_before_init("set_pull_compression")
            self._pull_codec = pull_codec_from_spec(spec)

    def _check_before_init(self, call: str) -> None:
        """Refuse ``call`` (a setting fixed at init) once a key is initialised."""
        if self._shared.keys:
            some = ", ".join(repr(k) for k in list(self._shared.keys)[:5])
            raise UsageError(f"{call} must be called before init; keys already initialised: {some}")

    def _check_codec(self, codec: Codec) -> None:
        """Refuse a codec with several round trips per step in ``dist_async``, or one the
        optimizer already set cannot work with (e.g. DGC under server momentum)."""
        if codec.round_trips > 1 and self.type == "dist_async":
            raise CodecError(
                f"codec {codec.name!r} needs {codec.round_trips} round trips per step, which "
                f"only dist_sync provides (dist_async applies each push on arrival)"
            )
        optimizer = self._shared.optimizer
        if optimizer is not None:
            codec.check_optimizer(optimizer.name, optimizer.params)

    def set_optimizer(self, name: str, **hyperparameters: Any) -> None:
        """Run an optimizer on the servers; pulls then return updated weights.

        Collective: every worker calls it with the same arguments, and it returns once all
        have. Calling it again replaces the hyperparameters (and keeps the optimizer state when
        the name is unchanged), e.g. for a learning-rate schedule.

        Args:
            name: ``"sgd"``, ``"adam"`` or ``"dcasgd"``.
            **hyperparameters: see :mod:`kvstore.optimizer_spec` (``learning_rate``,
                ``momentum``, ``nesterov``, ``momentum_every``, ``wd``, ``rescale_grad``,
                ``clip_gradient``, ``beta1``, ``beta2``, ``epsilon``, ``lamda``).

        Raises:
            OptimizerError: unknown optimizer or bad hyperparameters (before anything is sent),
                an optimizer the compression cannot work with (DGC and momentum), or workers
                that disagree.
        """
        self._check_open()
        spec = make_optimizer_spec(name, hyperparameters)
        for codec in {self._codec, *(state.codec for state in self._shared.keys.values())}:
            try:  # e.g. momentum on the servers for DGC, which applies it on the workers
                codec.check_optimizer(spec.name, spec.params)
            except CodecError as exc:
                raise OptimizerError(str(exc)) from exc
        requests = [
            self._shared.transport.submit(
                s,
                SetOptimizerFields(spec.name, dict(spec.params)),
                what=f"set_optimizer({spec!r})",
            )
            for s in range(self.num_servers)
        ]
        wait_all(requests, self._options.timeout)
        self._shared.optimizer = spec

    # init ----------------------------------------------------------------------------------------

    def init(
        self,
        key: KeyArg,
        value: Any,
        *,
        compression: dict[str, Any] | None = None,
        averaged: bool = False,
    ) -> None:
        """Initialise keys; collective (every worker calls it), rank 0's values win.

        Returns once every server stored rank 0's value, so no pull can see an uninitialised
        key.

        An *averaged* key holds the mean of what the workers push, and the server optimizer
        never touches it (e.g. BatchNorm statistics next to weights that an outer optimizer
        updates): in ``dist_sync`` and ``local`` each round's value is the mean of the N
        workers' decoded pushes (their sum divided by N); in ``dist_async`` each decoded push
        moves the value 1/N of the way to it, ``w + (push - w) / N`` (a running mean of the
        workers' pushes), and it may be pushed without an optimizer. Any push codec works
        (the servers decode, then average) and pull compression applies as for any key.

        Args:
            key: an int or str key, or a list of them.
            value: an array/tensor per key (a list for a list of keys).
            compression: the codec of these keys (a spec as for
                :meth:`set_gradient_compression`) instead of the store's, e.g.
                ``{"type": "none"}`` for values that must travel exactly; None: the store's.
            averaged: the keys hold the mean of the pushes (see above); float keys only.
                Part of the key's spec: every worker must pass the same.

        Raises:
            DuplicateInitError: a key was already initialised.
            CodecError: the value's dtype does not suit the compression, or ``compression``
                is not a valid spec or cannot work with the optimizer already set.
            ValueMismatchError: another worker declared a different shape, dtype, codec or
                ``averaged``, or an averaged key is not a float key.
        """
        self._check_open()
        if not isinstance(averaged, bool):
            raise TypeError(f"expected bool for `averaged`, got {type(averaged).__name__}")
        pairs = key_pairs(key, value, "value")
        with self._api_lock:
            codec, pull_codec = self._codec, self._pull_codec
            if compression is not None:
                codec = codec_from_spec(compression)
                self._check_codec(codec)
            states = []
            for k, v in pairs:
                if k in self._shared.keys:
                    raise DuplicateInitError(
                        f"key {k!r} is already initialised; call kv.init once per key"
                    )
                state = plan_key(
                    k,
                    vals.describe(v),
                    codec,
                    self._options,
                    self.num_servers,
                    self._servers_on_this_host,
                )
                if averaged and not state.dtype.startswith("float"):
                    raise ValueMismatchError(
                        f"key {k!r} is {state.dtype}: averaged keys hold a mean, so they must "
                        f"be float keys"
                    )
                state.averaged = averaged
                state.held = held_weights(pull_codec, state.dtype, state.chunks)
                if self._host is not None:  # this worker's share of its host's chunks
                    state.exchanged = frozenset(
                        self._host.plan(
                            k,
                            state.chunks,
                            np.dtype(state.dtype).itemsize,
                            state.codec.encodes_whole_key,
                        )
                    )
                states.append((state, v))
            if self._host is not None:
                deadline = self._deadline()
                for state, v in states:  # (GPU values are summed on the GPUs where they can)
                    device = vals.cuda_device_index(v)
                    self._host.add_key(state.key, state.numel, state.dtype, deadline, device)
            requests: list[Any] = []
            backups: list[Any] = []  # INITs of the chunks' backups (with replication)
            replicas = self._options.replicas
            for state, v in states:
                source = vals.host_copy(vals.flat_source(v)) if self.rank == 0 else None
                for chunk in state.chunks:
                    init = InitFields(
                        key=state.key,
                        chunk=chunk.index,
                        offset=chunk.start,
                        numel=chunk.numel,
                        dtype=state.dtype,
                        shape=list(state.shape),
                        codec=state.codec.name,
                        codec_params=state.codec.params(),
                        averaged=True if state.averaged else None,  # (None: left off the wire)
                    )
                    if state.held is not None and pull_codec is not None:
                        ask_for_compressed_pulls(init, pull_codec)
                    payloads = [source[chunk.start : chunk.stop]] if source is not None else []
                    if replicas > 1:  # every live replica of its shard starts from it
                        init.shard = chunk.server
                    transport = self._shared.transport
                    # (a lost replica's replacement is caught up with it; with none live, the
                    # primary's INIT fails, naming it)
                    replicas_of = replica_servers(chunk.server, self.num_servers, replicas)
                    live = [s for s in replicas_of if not transport.is_lost(s)]
                    for server in live or [chunk.server]:
                        first = server == (live or [chunk.server])[0]  # (the one it needs)
                        request = transport.submit(
                            server,
                            init,
                            payloads,
                            what=f"init of key {state.key!r} chunk {chunk.index}",
                            routed=server == chunk.server,
                        )
                        (requests if first else backups).append(request)
            wait_all(requests, self._options.timeout)
            for request in backups:  # (a backup lost meanwhile: its replacement is caught up)
                try:
                    request.wait(self._options.timeout)
                except ServerLostError:
                    pass
            pushes_per_round = self.num_workers // self._shared.workers_per_push
            for state, _ in states:
                # (an averaged key's value is the mean, not the sum a relayed pull redoes)
                relays = self._options.pull_relay and not state.averaged
                state.ready(
                    [relay_limit(relays, pushes_per_round, state, chunk) for chunk in state.chunks]
                )
                self._shared.keys[state.key] = state

    # push / pull -------------------------------------------------------------------------------

    def _state(self, key: Key) -> KeyState:
        return self._shared.key_state(key)

    def _require_optimizer_for_async(self, states: Iterable[KeyState]) -> None:
        """In dist_async a push is applied on arrival by the optimizer: refuse pushes of keys
        that are not averaged (which take none) before one is set."""
        if (
            self.type == "dist_async"
            and self._shared.optimizer is None
            and any(not state.averaged for state in states)
        ):
            raise UsageError(
                "dist_async applies every push on arrival and needs an optimizer: call "
                "kv.set_optimizer(...) on every worker before pushing"
            )

    def push(self, key: KeyArg, value: Any, priority: int = 0, *, borrow: bool = False) -> None:
        """Push gradients: the servers sum them over workers (not the mean).

        Returns once the values are encoded (their memory is free to reuse), without waiting
        for the network. Lists of keys are encoded and sent one after another and overlap.

        ``borrow=True`` skips the copy of uncompressed host values (numpy arrays, CPU
        tensors): their memory is sent as it is, so it must stay unchanged until a pull of
        the key returns (after a call that raised, pushes of it may still be queued: until
        :meth:`close`). The usual loop (backward, push, pull, the next backward writes the
        gradients again) keeps that by itself, and each step then saves a copy of every
        gradient, made just when the servers need the cores for the round's first chunks
        (docs/performance.md measures it). GPU values and compressed pushes are encoded as usual.

        In ``dist_sync``, once a key's push was followed by a pull, its later pushes also ask
        the servers for the round's value (a pushpull whose reply the client keeps until the
        pull): the values start coming back as each chunk's round completes, while the rest
        of a long list is still being encoded, instead of after ``pull`` is called, and a
        chunk costs one request instead of two. The pull that follows then only copies them
        into ``out``. A push whose values were not pulled before the key's next push turns
        this off for the key until a pull follows a push again, so jobs that push without
        pulling do not receive values they never read.

        Args:
            key: a key or a list of keys (each initialised).
            value: an array/tensor per key, of the key's shape and dtype; GPU values are
                encoded on the GPU.
            priority: higher-priority messages are sent first.
            borrow: send dense host values from their own memory (see above).
        """
        self._check_open()
        pairs = key_pairs(key, value, "value")
        work = [(self._state(k), v) for k, v in pairs]
        self._require_optimizer_for_async(state for state, _ in work)
        for state, v in work:
            state.check_value(v, "value")
        self._pushes.refuse_nonfinite([(state, v) for state, v in work])
        deadline = self._deadline()  # (for the chunks' previous pushes, over the whole call)
        if self._host is not None:
            self._push_for_host(work, priority, deadline)
            return
        for state, v in work:
            # (see kvstore.worker.prefetch; KVSTORE_VALUE_PREFETCH=0 turns it off)
            ask = prefetch.asks_for_values(state, self.type) and self._options.value_prefetch
            op = Op.PUSHPULL if ask else Op.PUSH
            requests = self._pushes.send(state, v, op, priority, borrow=borrow, deadline=deadline)
            prefetch.pushed(state, requests if ask else None)

    def pull(self, key: KeyArg, out: Any = None, priority: int = 0) -> None:
        """Pull values into ``out`` in place (same shape, dtype and type as at init).

        Returns when ``out`` holds the value that includes this worker's earlier pushes of
        the key (in ``dist_sync``: the whole round's result).

        Args:
            key: a key or a list of keys.
            out: an array/tensor per key to fill (required).
            priority: higher-priority messages are sent first.
        """
        self._check_open()
        if out is None:
            raise TypeError("pull needs `out`: the array or tensor to fill")
        pairs = key_pairs(key, out, "out")
        work = [(self._state(k), o) for k, o in pairs]
        for state, o in work:
            state.check_value(o, "out")
        deadline = self._deadline()
        if self._host is not None:
            self._pull_for_host(work, priority, deadline)
            return
        pending = []
        for state, o in work:
            landing = Landing(state, o, self._shared.stats)
            pending.append((landing, self._pulls.requests(state, landing, priority)))
        self._pulls.receive(pending, deadline)

    def _push_for_host(
        self, work: list[tuple[KeyState, Any]], priority: int, deadline: Deadline
    ) -> None:
        """A push with hierarchical aggregation: the host's sum of each key, of which this
        worker encodes and sends its share of the chunks (:mod:`kvstore.worker.host_group`)."""
        assert self._host is not None
        totals = self._host.host_sums([(state.key, v) for state, v in work], deadline)
        for (state, value), total in zip(work, totals, strict=True):
            # (a sum on a GPU is encoded on its device, on the stream of the value it came from)
            with vals.device_stream(value):
                self._pushes.send(state, total, Op.PUSH, priority, deadline=deadline)

    def _pull_for_host(
        self, work: list[tuple[KeyState, Any]], priority: int, deadline: Deadline
    ) -> None:
        """A pull with hierarchical aggregation: this worker fetches its share of the host's
        chunks into the host's shared result, and once every share landed copies the whole
        key into ``out`` (:mod:`kvstore.worker.host_group`)."""
        assert self._host is not None
        keys = [state.key for state, _ in work]
        pending = []
        for (state, _), shared in zip(work, self._host.pull_into(keys, deadline), strict=True):
            landing = Landing(state, shared, self._shared.stats)
            pending.append((landing, self._pulls.submit(state, landing, priority)))
        failed: KVStoreError | None = None
        try:
            self._pulls.receive(pending, deadline)
        except KVStoreError as exc:  # the host's other workers are told, then it is raised
            failed = exc
        self._host.pulled(keys, [o for _, o in work], deadline, failed)

    def pushpull(
        self, key: KeyArg, value: Any, out: Any = None, priority: int = 0, *, borrow: bool = False
    ) -> None:
        """Push then pull in one round trip per chunk; ``out`` defaults to ``value``.

        ``borrow=True`` sends dense host values from their own memory, as :meth:`push` does;
        the call returns after every push was answered, so only a call that raised leaves
        ``value`` in use (until :meth:`close`)."""
        self._check_open()
        pairs = key_pairs(key, value, "value")
        outs = [v for _, v in pairs] if out is None else [o for _, o in key_pairs(key, out, "out")]
        work = [(self._state(k), v, o) for (k, v), o in zip(pairs, outs, strict=True)]
        self._require_optimizer_for_async(state for state, _, _ in work)
        for state, v, o in work:
            state.check_value(v, "value")
            state.check_value(o, "out")
        self._pushes.refuse_nonfinite([(state, v) for state, v, _ in work])
        deadline = self._deadline()
        if self._host is not None:  # the host's push, then its pull
            self._push_for_host([(state, v) for state, v, _ in work], priority, deadline)
            self._pull_for_host([(state, o) for state, _, o in work], priority, deadline)
            return
        pending = []
        for state, v, o in work:
            prefetch.reset(state)  # a pushpull is a push, and its own pull
            landing = Landing(state, o, self._shared.stats)
            if state.codec.round_trips > 1:
                # The last round's reply carries the codec's factors, not the value: push,
                # then pull (answered once the push's last round is applied).
                self._pushes.send(state, v, Op.PUSH, priority, borrow=borrow, deadline=deadline)
                requests = self._pulls.submit(state, landing, priority)
            else:
                requests = self._pushes.send(
                    state, v, Op.PUSHPULL, priority, landing, borrow, deadline=deadline
                )
            pending.append((landing, requests))
        self._pulls.receive(pending, deadline)

    def wait(self, key: KeyArg | None = None) -> None:
        """Block until this worker's pushes (of ``key``, or of all keys) were applied."""
        self._check_open()
        if key is None:
            self._pushes.wait_all()
        else:
            keys = key if isinstance(key, list | tuple) else [key]
            self._pushes.wait_all([self._state(normalize_key(k)) for k in keys])

    def barrier(self) -> None:
        """Wait until every worker reached its barrier, after this worker's pushes were applied.

        So once any worker returns from ``barrier``, every worker's earlier pushes are applied.
        """
        self._check_open()
        deadline = self._deadline()
        self._pushes.wait_all(deadline=deadline)
        request = self._shared.transport.submit(0, BarrierFields(), what="barrier")
        request.wait(deadline)

    # checkpoints -------------------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Save the job's state into the directory ``path``; collective (every worker calls it,
        between steps).

        Every server writes its shard (values, optimizer state, update counts) and every worker
        its codec state (2-bit residuals) into a staging directory beside ``path``; rank 0
        then writes ``manifest.json`` with every file's sha256 and renames the directory to
        ``path`` (replacing an older checkpoint there). Returns on every worker once the
        checkpoint is complete. A save that fails or is interrupted leaves nothing at ``path``
        that loads (:mod:`kvstore.checkpoint`). ``path`` (made absolute here) must be the same
        directory on every worker and server, e.g. on a shared file system.

        In ``dist_sync`` call it after a step's pulls; it first waits for this worker's
        pushes, like :meth:`barrier`.

        Raises:
            CheckpointError: a part could not be written (naming the process and the reason),
                or a round was in flight on a server.
        """
        self._check_open()
        with self._api_lock:
            self._checkpoints.save(path)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore the state saved by :meth:`save_checkpoint`; collective, after the same
        ``init`` calls as the saving job (and, optionally, the same ``set_optimizer``: without
        one the checkpoint's optimizer is set).

        Checks everything before anything changes: the manifest (complete, a format version
        this pskv reads), the job's shape (mode, workers, servers), the keys with their shapes,
        dtypes and compression, the optimizer, and every file's checksum; then every server
        and worker restores its part. A resumed ``dist_sync`` job continues bit-identically to
        one that was never stopped. Chunk sizes may differ from the saving job's
        (``KVSTORE_PARTITION_BYTES``); ``KVSTORE_BIGARRAY_BOUND`` may not.

        Raises:
            CheckpointError: the checkpoint is incomplete, corrupted, newer, or of another job
                (naming the key, file or rank); nothing was changed then.
        """
        self._check_open()
        with self._api_lock:
            self._checkpoints.load(path)

    def codec_state(self, keys: KeyArg) -> dict[str, Any]:
        """This worker's codec state of ``keys`` (not collective; the servers are not asked).

        Waits for this worker's pushes of the keys, then returns, per key, its shape, dtype,
        compression and chunks, and per chunk the encoder's state as numpy arrays on the host
        (2-bit / top-k / 1-bit residuals, DGC's momentum and velocity, PowerSGD's error and
        factor, the push count of codecs that draw random numbers): a dict of plain data and
        numpy arrays, JSON-able but for the arrays, which the caller owns. A key whose encoder
        was never made (no push since init) has ``None`` per chunk. The format is
        :func:`kvstore.worker.checkpointing.codec_state_dict`'s.

        Call it between steps, like :meth:`save_checkpoint`; :meth:`load_codec_state` restores
        it. The servers' state (values, optimizer state) is not in it.

        Raises:
            KeyNotInitializedError: a key was never initialised.
        """
        self._check_open()
        names = keys if isinstance(keys, list | tuple) else [keys]
        with self._api_lock:
            states: dict[Key, KeyState] = {}  # (a key named twice is described once)
            for name in names:
                state = self._state(normalize_key(name))
                states[state.key] = state
            return self._checkpoints.codec_state(states.values())

    def load_codec_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`codec_state` returned, on the worker that saved it (not
        collective): the next push of each key in ``state`` encodes exactly as the saving
        store's next push did.

        Everything is checked before anything changes: the format, the worker's rank, and per
        key that it is initialised here with the same shape, dtype, compression and chunk plan
        (the number of servers, ``KVSTORE_PARTITION_BYTES`` and ``KVSTORE_BIGARRAY_BOUND``), and
        that every chunk's arrays have the names, shapes and dtypes its encoder keeps. Then,
        as in :meth:`load_checkpoint`, each key's encoder is made again at its next push (on
        the values' device) and loads the saved state; a key saved without state starts from
        zero. Keys not in ``state`` keep theirs; the servers are not touched.

        Raises:
            CheckpointError: ``state`` is not a codec state, is another worker's or a newer
                version's, or a key is missing here or differs (naming the key and both sides).
            CodecError: a chunk's arrays do not fit its encoder (naming the key and chunk).
        """
        self._check_open()
        with self._api_lock:
            self._checkpoints.load_codec_state(state)

    # introspection -------------------------------------------------------------------------

    def stats(self) -> TrafficStats:
        """A snapshot of the bytes this worker pushed and pulled so far, and of the time its
        calls spent encoding, copying to and from the GPU and waiting for replies."""
        return dataclasses.replace(self._shared.stats)

    @property
    def metrics_port(self) -> int | None:
        """The port of this worker's Prometheus endpoint until the store closes (None without
        ``KVSTORE_METRICS_PORT``)."""
        metrics = self._shared.metrics
        return metrics.port if metrics is not None else None

    @property
    def optimizer(self) -> OptimizerSpec | None:
        """The optimizer set with :meth:`set_optimizer`, or None."""
        return self._shared.optimizer

    @property
    def compression(self) -> dict[str, Any]:
        """The compression params that keys initialised now would use."""
        return self._codec.spec()

    def __repr__(self) -> str:
        return (
            f"KVStore(type={self.type!r}, rank={self.rank}, num_workers={self.num_workers}, "
            f"num_servers={self.num_servers})"
        )


__all__ = ["KVStore", "TrafficStats"]
