"""The worker-side client: :class:`KVStore`, with MXNet's ``push``/``pull`` vocabulary.

Per key the client keeps its shape, dtype, chunks (:func:`kvstore.topology.plan_chunks`), the
codec chosen when it was initialised, its :class:`~kvstore.codecs.base.KeyEncoder` with one
:class:`~kvstore.codecs.Encoder` per chunk (which holds this worker's residual for that chunk;
codecs that select over the whole key, like top-k, do that once per push in the key encoder),
plus each chunk's last push in flight.

Ordering: ``push`` encodes each chunk on the caller's thread and queues it; it returns when the
caller's value is no longer needed, without waiting for the network. A chunk is re-encoded only
after its previous push was answered (its buffers are reused). A pull request carries how many
pushes of the chunk this worker sent so far, and each server answers it only after that many
were applied (in ``dist_sync``: after the whole round), so ``push`` followed by ``pull`` returns
the round's result even though pulls travel on a connection of their own. Errors of a
push are raised by the next call that waits on it: a later push or pull of the same key,
``barrier`` or ``close``.

Codecs with several round trips per step (PowerSGD: push P, get the servers' P_hat, push Q, get
Q_sum) use the same machinery: a chunk's push is a chain of plain pushes (:class:`_RoundTrips`)
that the client tracks as one request, and each round counts as one of the chunk's pushes, so a
pull waits, on its server, for the step's last round.

With ``KVSTORE_METRICS_PORT`` (``options.metrics``) the store serves Prometheus metrics
(:mod:`kvstore.metrics`) until it closes: the transport counts the traffic, and on one push of a
key in ``KVSTORE_METRICS_EVERY`` the encoders measure the key's residual norm and the density
sent (:meth:`~kvstore.codecs.Encoder.quality`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore import checkpoint
from kvstore._malloc import tune_malloc
from kvstore._version import __version__
from kvstore.codecs import Codec, Encoder, codec_from_spec, xp
from kvstore.codecs.base import KeyEncoder, PushQuality
from kvstore.codecs.finite import count_nonfinite
from kvstore.codecs.identity import IdentityCodec
from kvstore.codecs.pulled import pull_codec_from_spec
from kvstore.config import ClusterConfig, WorkerOptions
from kvstore.errors import (
    CheckpointError,
    CodecError,
    ConnectionLostError,
    DuplicateInitError,
    KeyNotInitializedError,
    KVStoreError,
    KVStoreTimeoutError,
    NonFiniteError,
    OptimizerError,
    ProtocolError,
    UsageError,
)
from kvstore.metrics import WorkerMetrics
from kvstore.optimizer_spec import OptimizerSpec, make_optimizer_spec
from kvstore.topology import Key
from kvstore.wire import LANE_CONTROL, LANE_DATA, Op
from kvstore.worker import checkpointing as ckpt
from kvstore.worker import values as vals
from kvstore.worker.compressed_pulls import held_weights, init_fields
from kvstore.worker.keys import (
    KeyArg,
    KeyState,
    key_pairs,
    normalize_key,
    plan_key,
    servers_on_this_host,
)
from kvstore.worker.landing import Landing
from kvstore.worker.relayed_pulls import relay_limit
from kvstore.worker.request import Deadline, Request, wait_all
from kvstore.worker.stats import EncodeClock, TrafficStats
from kvstore.worker.transport import Transport

logger = logging.getLogger(__name__)


class _RoundTrips:
    """One chunk's push of a codec that takes several round trips per step, as one request.

    The client keeps each chunk's last push as a request (later pushes, pulls, ``barrier``
    and ``close`` wait on it), so the step is a :class:`Request` of its own, :attr:`step`,
    that is never sent: it completes with the final round's reply, or fails with the first
    failing round's error. Every round is a plain PUSH. Its reply arrives on the transport's
    I/O thread, which runs the encoder there: an intermediate round's frames become the next
    round's payload (:meth:`Encoder.next_round`), submitted from the same thread; the final
    round's acknowledgement ends the encoder's step (:meth:`Encoder.end_step`). The chunk is
    encoded again only after :attr:`step` completed, so the encoder is never used by two
    threads at once.
    """

    def __init__(
        self,
        transport: Transport,
        stats: TrafficStats,
        encoder: Encoder,
        server: int,
        fields: dict[str, Any],
        priority: int,
        order_key: Any,
        what: str,
    ) -> None:
        self._transport = transport
        self._stats = stats
        self._encoder = encoder
        self._server = server
        self._fields = fields
        self._priority = priority
        self._order_key = order_key
        self._what = what
        self._rounds = encoder.round_trips
        self._round = 0
        self.step: Request = Request(0, server, Op.PUSH, what, 0)

    def start(self, payloads: list[Any]) -> Request:
        """Send the first round's ``payloads``; returns :attr:`step`."""
        first = self._submit(payloads)
        if first is not None:
            self.step.nbytes = first.nbytes
        return self.step

    def _submit(self, payloads: list[Any]) -> Request | None:
        self._round += 1
        try:
            return self._transport.submit(
                self._server,
                Op.PUSH,
                self._fields,
                payloads,
                priority=self._priority,
                order_key=self._order_key,
                what=f"{self._what} (round {self._round} of {self._rounds})",
                on_done=self._on_reply,
            )
        except KVStoreError as exc:  # the store closed under us
            self.step._complete(None, exc)
            return None

    def _on_reply(self, request: Request) -> None:
        if request._error is not None:
            self.step._complete(None, request._error)
            return
        reply = request._reply
        assert reply is not None
        began = time.perf_counter()
        try:
            if self._round < self._rounds:
                payloads = self._encoder.next_round(reply.payloads)
            else:
                self._encoder.end_step(reply.payloads)
        except Exception as exc:  # (a CodecError: a reply this encoder cannot use)
            self.step._complete(
                None, ProtocolError(f"{self._what}: the reply to round {self._round}: {exc}")
            )
            return
        finally:
            self._stats.encode_seconds += time.perf_counter() - began
            request.release_payloads()
        if self._round == self._rounds:
            self.step._complete(reply, None)
            return
        sent = self._submit(payloads)
        if sent is not None:
            self._stats.pushed_bytes += sent.nbytes
            self._stats.push_messages += 1


def _reworded(exc: BaseException, message: str) -> BaseException:
    """A copy of ``exc`` that says ``message`` and keeps its attributes (a lost worker's rank,
    a server's error code)."""
    copy = type(exc).__new__(type(exc), message)
    copy.__dict__.update(exc.__dict__)
    copy.args = (message,)
    return copy


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
        self._cluster = cluster
        # Settings left to the job's size (push lead, TOS) are fixed here, once.
        self._options = (options or WorkerOptions()).for_job(cluster.num_workers)
        self._codec: Codec = IdentityCodec()
        self._pull_codec: Codec | None = None  # compressed pulls (set_pull_compression)
        # Every worker reads the same addresses, so every worker plans the same chunks.
        self._servers_on_this_host = servers_on_this_host(cluster.servers)
        self._keys: dict[Key, KeyState] = {}
        self._optimizer: OptimizerSpec | None = None
        self._stats = TrafficStats()
        self._api_lock = threading.RLock()
        self._closed = False
        self._on_close = on_close
        tune_malloc()  # ZeroMQ's receive buffers get reused instead of page-faulted back
        identity = f"w{cluster.rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        metrics_config = self._options.metrics
        self._metrics: WorkerMetrics | None = None
        if metrics_config is not None:  # before the transport, which counts into it
            self._metrics = WorkerMetrics(metrics_config, cluster.rank, cluster.num_servers)
        try:
            self._transport = Transport(
                cluster.servers,
                identity,
                context,
                window_bytes=2 * self._options.partition_bytes,
                lead_chunks=self._options.push_lead,
                tos=self._options.push_tos,
                queue_seconds=self._options.send_queue_ms / 1000,
                metrics=self._metrics,
                curve=self._options.curve,
                heartbeat_timeout=self._options.heartbeat_timeout,
            )
        except BaseException:
            self._close_metrics()
            raise
        if self._metrics is not None:
            stats = self._stats
            self._metrics.watch(
                lambda: (stats.pushed_bytes, stats.pushed_raw_bytes), self._transport.queue_depths
            )
        try:
            self._handshake()
        except BaseException:
            self._shutdown_transport()
            raise

    # lifecycle ---------------------------------------------------------------------------------

    def _handshake(self) -> None:
        timeout = self._options.connect_timeout
        requests = [
            self._transport.submit(
                server,
                Op.HELLO,
                {
                    "r": self.rank,
                    "nw": self.num_workers,
                    "ns": self.num_servers,
                    "si": server,
                    "m": self.type,
                    "ln": lane,
                    # the server refuses us here if our chunks could exceed its message limit
                    "pb": self._options.partition_bytes,
                },
                what=f"handshake with server {server} ({address})",
                lane=lane,
            )
            for server, address in enumerate(self._cluster.servers)
            for lane in (LANE_DATA, LANE_CONTROL)
        ]
        try:
            wait_all(requests, timeout)
        except KVStoreTimeoutError:
            self._leave_after_refusal(requests)
            silent = [r.server for r in requests if not r.done()]
            addresses = ", ".join(self._cluster.servers[s] for s in silent)
            raise ConnectionLostError(
                f"server(s) {silent} ({addresses}) did not answer within {timeout} s "
                f"(KVSTORE_CONNECT_TIMEOUT): are they running? `kvstore-launch` starts them"
            ) from None
        except KVStoreError:
            self._leave_after_refusal(requests)
            raise

    def _leave_after_refusal(self, hellos: list[Request]) -> None:
        """Say goodbye where a HELLO was accepted although another server refused us, so that
        those servers do not hold this rank for a worker that is not coming (a replacement
        that retries before every server released its predecessor's rank)."""
        # (the HELLOs are per server, data lane then control lane: see _handshake)
        lanes = [(r.server, (LANE_DATA, LANE_CONTROL)[i % 2]) for i, r in enumerate(hellos)]
        byes = [
            self._transport.submit(server, Op.BYE, what="goodbye", lane=lane)
            for (server, lane), hello in zip(lanes, hellos, strict=True)
            if hello.done() and not hello.failed()
        ]
        try:
            wait_all(byes, timeout=1.0)
        except KVStoreError as exc:
            logger.debug("goodbye after a refused handshake not acknowledged: %s", exc)

    def _shutdown_transport(self) -> None:
        try:
            self._transport.close()
        finally:
            self._close_metrics()
            if self._on_close is not None:
                on_close, self._on_close = self._on_close, None
                on_close()

    def _close_metrics(self) -> None:
        if self._metrics is not None:
            metrics, self._metrics = self._metrics, None
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
            self._wait_pushes(deadline=deadline)
        except KVStoreError as exc:
            error = exc
        try:
            byes = [
                self._transport.submit(s, Op.BYE, what="goodbye", lane=lane)
                for s in range(self.num_servers)
                for lane in (LANE_DATA, LANE_CONTROL)
            ]
            # At most 5 s, and within KVSTORE_TIMEOUT give or take a moment to send them: a
            # server that misses a goodbye releases the rank after KVSTORE_HEARTBEAT_TIMEOUT.
            remaining = deadline.remaining()
            wait_all(byes, timeout=5.0 if remaining is None else min(5.0, max(remaining, 0.2)))
        except KVStoreError as exc:
            logger.debug("goodbye not acknowledged: %s", exc)
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
        """The deadline of a blocking call starting now: ``KVSTORE_TIMEOUT`` bounds each call
        as a whole, however many keys, chunks and requests it waits for."""
        return Deadline(self._options.timeout)

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
            self._check_round_trips(codec)
            if self._optimizer is not None:  # e.g. DGC after an optimizer with momentum
                codec.check_optimizer(self._optimizer.name, self._optimizer.params)
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
            spec: ``{"type": name, **params}`` with name ``fp16``, ``bf16``, ``2bit``, ``topk``
                or ``threshold``; ``{"type": "none"}`` (the default) pulls dense values.

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
        if self._keys:
            some = ", ".join(repr(k) for k in list(self._keys)[:5])
            raise UsageError(f"{call} must be called before init; keys already initialised: {some}")

    def _check_round_trips(self, codec: Codec) -> None:
        """Refuse a codec with several round trips per step in ``dist_async``."""
        if codec.round_trips > 1 and self.type == "dist_async":
            raise CodecError(
                f"codec {codec.name!r} needs {codec.round_trips} round trips per step, which "
                f"only dist_sync provides (dist_async applies each push on arrival)"
            )

    def set_optimizer(self, name: str, **hyperparameters: Any) -> None:
        """Run an optimizer on the servers; pulls then return updated weights.

        Collective: every worker calls it with the same arguments, and it returns once all
        have. Calling it again replaces the hyperparameters (and keeps the optimizer state when
        the name is unchanged), e.g. for a learning-rate schedule.

        Args:
            name: ``"sgd"`` or ``"adam"``.
            **hyperparameters: see :mod:`kvstore.optimizer_spec` (``learning_rate``,
                ``momentum``, ``nesterov``, ``wd``, ``rescale_grad``, ``clip_gradient``,
                ``beta1``, ``beta2``, ``epsilon``).

        Raises:
            OptimizerError: unknown optimizer or bad hyperparameters (before anything is sent),
                an optimizer the compression cannot work with (DGC and momentum), or workers
                that disagree.
        """
        self._check_open()
        spec = make_optimizer_spec(name, hyperparameters)
        for codec in {self._codec, *(state.codec for state in self._keys.values())}:
            try:  # e.g. momentum on the servers for DGC, which applies it on the workers
                codec.check_optimizer(spec.name, spec.params)
            except CodecError as exc:
                raise OptimizerError(str(exc)) from exc
        requests = [
            self._transport.submit(
                s,
                Op.SET_OPTIMIZER,
                {"opt": spec.name, "hp": spec.params},
                what=f"set_optimizer({spec!r})",
            )
            for s in range(self.num_servers)
        ]
        wait_all(requests, self._options.timeout)
        self._optimizer = spec

    # init ----------------------------------------------------------------------------------------

    def init(self, key: KeyArg, value: Any, *, compression: dict[str, Any] | None = None) -> None:
        """Initialise keys; collective (every worker calls it), rank 0's values win.

        Returns once every server stored rank 0's value, so no pull can see an uninitialised
        key.

        Args:
            key: an int or str key, or a list of them.
            value: an array/tensor per key (a list for a list of keys).
            compression: the codec of these keys (a spec as for
                :meth:`set_gradient_compression`) instead of the store's, e.g.
                ``{"type": "none"}`` for values that must travel exactly; None: the store's.

        Raises:
            DuplicateInitError: a key was already initialised.
            CodecError: the value's dtype does not suit the compression, or ``compression``
                is not a valid spec or cannot work with the optimizer already set.
            ValueMismatchError: another worker declared a different shape, dtype or codec.
        """
        self._check_open()
        pairs = key_pairs(key, value, "value")
        with self._api_lock:
            codec, pull_codec = self._codec, self._pull_codec
            if compression is not None:
                codec = codec_from_spec(compression)
                self._check_round_trips(codec)
                if self._optimizer is not None:  # e.g. DGC under server momentum
                    codec.check_optimizer(self._optimizer.name, self._optimizer.params)
            states = []
            for k, v in pairs:
                if k in self._keys:
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
                state.held = held_weights(pull_codec, state.dtype, state.chunks)
                states.append((state, v))
            requests = []
            for state, v in states:
                source = vals.host_copy(vals.flat_source(v)) if self.rank == 0 else None
                for chunk in state.chunks:
                    fields = {
                        "k": state.key,
                        "c": chunk.index,
                        "o": chunk.start,
                        "n": chunk.numel,
                        "dt": state.dtype,
                        "sh": list(state.shape),
                        "cd": state.codec.name,
                        "cp": state.codec.params(),
                    }
                    if state.held is not None and pull_codec is not None:
                        fields.update(init_fields(pull_codec))
                    payloads = [source[chunk.start : chunk.stop]] if source is not None else []
                    requests.append(
                        self._transport.submit(
                            chunk.server,
                            Op.INIT,
                            fields,
                            payloads,
                            what=f"init of key {state.key!r} chunk {chunk.index}",
                        )
                    )
            wait_all(requests, self._options.timeout)
            for state, _ in states:
                relays = self._options.pull_relay
                state.ready(
                    [relay_limit(relays, self.num_workers, state, chunk) for chunk in state.chunks]
                )
                self._keys[state.key] = state

    # push / pull -------------------------------------------------------------------------------

    def _state(self, key: Key) -> KeyState:
        state = self._keys.get(key)
        if state is None:
            raise KeyNotInitializedError(
                f"key {key!r} is not initialised; call kv.init({key!r}, value) on every worker "
                f"first"
            )
        return state

    def _check_finite(self, work: Sequence[tuple[KeyState, Any]]) -> None:
        """Refuse pushed float values that hold NaN or an infinity, before anything of the call
        is encoded or sent (``KVSTORE_ALLOW_NONFINITE=1`` skips the check).

        One read of each value (:mod:`kvstore.codecs.finite`): a NaN would otherwise reach the
        servers' sums or stay in a 2-bit residual for good, where it sends nothing again.
        """
        if self._options.allow_nonfinite:
            return
        for state, value in work:
            if not state.dtype.startswith("float"):
                continue
            with vals.device_stream(value):
                bad = count_nonfinite(vals.flat_source(value))
            if bad:
                raise NonFiniteError(
                    f"the value pushed for {state.describe()} holds {bad} NaN or infinite "
                    f"element(s) of {state.numel}; nothing of this call was pushed and no "
                    f"residual changed (KVSTORE_ALLOW_NONFINITE=1 pushes them as they are)"
                )

    def _key_encoder(self, state: KeyState, source: Any) -> KeyEncoder:
        """The key's encoder for values on ``source``'s device (made on first use, with the
        state a checkpoint load left waiting for it)."""
        device = vals.gpu_device_of(source)
        key_encoder = state.key_encoder
        if key_encoder is None or state.encoder_device != device:
            if key_encoder is not None:
                # The residuals live where the values live; moving devices starts them over.
                logger.warning("%s moved between host and GPU; residuals reset", state.describe())
                state.restored = None
            state.encoder_device = device
            key_encoder = state.new_key_encoder(device, self.rank)
            for encoder in key_encoder.chunks:  # named in the encoders' warnings
                encoder.label = state.describe()
            if state.restored is not None:  # from load_checkpoint
                for encoder, saved in zip(key_encoder.chunks, state.restored, strict=True):
                    if saved is not None:
                        encoder.load_state(saved)
                state.restored = None
            state.key_encoder = key_encoder
            state.encoders = list(key_encoder.chunks)
        return key_encoder

    def _wait_push(self, state: KeyState, index: int, deadline: Deadline | None = None) -> None:
        """Wait for the last push of ``state``'s chunk ``index`` (within the call's
        ``deadline``; None: a call of its own) and raise its error."""
        previous = state.last_push[index]
        if previous is None:
            return
        state.last_push[index] = None
        try:
            previous.wait(deadline if deadline is not None else self._deadline())
        except KVStoreError as exc:
            raise _reworded(exc, f"an earlier push of {state.describe()} failed: {exc}") from exc

    def _send_pushes(
        self,
        state: KeyState,
        value: Any,
        op: Op,
        priority: int,
        landing: Landing | None = None,
        borrow: bool = False,
        deadline: Deadline | None = None,
    ) -> list[Request]:
        """Encode and send every chunk of ``value`` (in the key's send order); returns the
        requests in chunk order. With ``borrow``, chunks whose codec can send the values as
        they are (dense host values) are sent from ``value``'s memory, not copied. A chunk's
        previous push is waited for within ``deadline`` (None: one from now)."""
        if deadline is None:
            deadline = self._deadline()
        source = vals.flat_source(value)
        requests: list[Any] = [None] * len(state.chunks)  # every slot filled below
        metrics = self._metrics
        measured: list[PushQuality | None] | None = None
        if metrics is not None and metrics.measure(state.pushes_sent[0]):
            measured = []
        with vals.device_stream(value):
            key_encoder = self._key_encoder(state, source)
            if key_encoder.whole_key:  # begin() rewrites every chunk's payload buffers
                for chunk in state.send_order:
                    self._wait_push(state, chunk.index, deadline)
            # (values that reach an encoder were checked for NaN and infinities, unless the
            # job allows them)
            clock = EncodeClock(self._stats)
            key_encoder.begin(source, finite=not self._options.allow_nonfinite)
            clock.lap()
            for chunk in state.send_order:
                self._wait_push(state, chunk.index, deadline)
                encoder = key_encoder.chunks[chunk.index]
                values = source[chunk.start : chunk.stop]
                payloads = encoder.borrow(values) if borrow else None
                clock.start()
                if payloads is None:
                    payloads = encoder.encode(values)
                clock.lap()
                if measured is not None:
                    measured.append(encoder.quality(values))
                fields = {"k": state.key, "c": chunk.index, "n": chunk.numel}
                what = f"{op.name} of key {state.key!r} chunk {chunk.index}"
                rounds = encoder.round_trips
                if rounds > 1:  # (PUSH only: see pushpull and _prefetch_values)
                    assert op is Op.PUSH and landing is None
                    request = _RoundTrips(
                        self._transport, self._stats, encoder, chunk.server, fields,
                        priority, (state.key, chunk.index), what,
                    ).start(payloads)  # fmt: skip
                else:
                    if op is Op.PUSHPULL:
                        fields.update(state.pull_fields(chunk))
                    request = self._transport.submit(
                        chunk.server,
                        op,
                        fields,
                        payloads,
                        priority=priority,
                        order_key=(state.key, chunk.index),
                        what=what,
                        on_done=landing.callback(chunk) if landing is not None else None,
                    )
                if request.failed():  # refused before sending (the server is gone)
                    request.wait()
                state.last_push[chunk.index] = request
                state.pushes_sent[chunk.index] += rounds
                requests[chunk.index] = request
                self._stats.pushed_bytes += request.nbytes
                self._stats.pushed_raw_bytes += chunk.numel * np.dtype(state.dtype).itemsize
                self._stats.push_messages += 1
        if measured and metrics is not None and all(q is not None for q in measured):
            metrics.key_quality(
                state.key,
                sum(q.gradient_sq for q in measured),
                sum(q.residual_sq for q in measured),
                sum(q.sent_nonzero for q in measured),
                state.numel,
            )
        return requests

    def _require_optimizer_for_async(self) -> None:
        if self.type == "dist_async" and self._optimizer is None:
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
        self._require_optimizer_for_async()
        pairs = key_pairs(key, value, "value")
        work = [(self._state(k), v) for k, v in pairs]
        for state, v in work:
            state.check_value(v, "value")
        self._check_finite([(state, v) for state, v in work])
        deadline = self._deadline()  # (for the chunks' previous pushes, over the whole call)
        for state, v in work:
            if self._prefetch_values(state):
                state.prefetched = self._send_pushes(
                    state, v, Op.PUSHPULL, priority, borrow=borrow, deadline=deadline
                )
            else:
                self._send_pushes(state, v, Op.PUSH, priority, borrow=borrow, deadline=deadline)
            state.pushed_since_pull = True

    def _prefetch_values(self, state: KeyState) -> bool:
        """Whether the push about to be sent for ``state`` should ask for the round's values."""
        self._forget_unpulled_values(state)
        # (a multi-round push's last reply carries the codec's factors, not the value)
        multi_round = state.codec.round_trips > 1
        return self.type != "dist_async" and state.pulled_after_push and not multi_round

    @staticmethod
    def _forget_unpulled_values(state: KeyState) -> None:
        """Before a new push of ``state``: drop the last push's values if no pull took them,
        and stop asking for them until a pull follows a push again."""
        if state.prefetched is not None:
            state.prefetched = None
            state.pulled_after_push = False

    def _pull_requests(self, state: KeyState, landing: Landing, priority: int) -> list[Request]:
        """One request per chunk whose reply fills ``landing``: the last push's own, where it
        asked for the values, else a new pull."""
        prefetched, state.prefetched = state.prefetched, None
        if state.pushed_since_pull and prefetched is None:
            state.pulled_after_push = True  # the next push asks for the values
        state.pushed_since_pull = False
        if prefetched is not None:
            for chunk, request in zip(state.chunks, prefetched, strict=True):
                callback = landing.callback(chunk)
                if callback is not None:  # (None: the caller lands GPU targets itself)
                    request.add_done_callback(callback)
            return prefetched
        return self._submit_pulls(state, landing, priority)

    def _submit_pulls(self, state: KeyState, landing: Landing, priority: int) -> list[Request]:
        """A pull of every chunk of ``state``, following every push sent so far."""
        return [
            self._transport.submit(
                chunk.server,
                Op.PULL,
                {
                    "k": state.key,
                    "c": chunk.index,
                    "af": state.pushes_sent[chunk.index],
                    **state.pull_fields(chunk),
                },
                priority=priority,
                what=f"pull of key {state.key!r} chunk {chunk.index}",
                on_done=landing.callback(chunk),
            )
            for chunk in state.chunks
        ]

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
        pending = []
        for state, o in work:
            landing = Landing(state, o, self._stats)
            pending.append((landing, self._pull_requests(state, landing, priority)))
        self._receive_values(pending, deadline)

    def pushpull(
        self, key: KeyArg, value: Any, out: Any = None, priority: int = 0, *, borrow: bool = False
    ) -> None:
        """Push then pull in one round trip per chunk; ``out`` defaults to ``value``.

        ``borrow=True`` sends dense host values from their own memory, as :meth:`push` does;
        the call returns after every push was answered, so only a call that raised leaves
        ``value`` in use (until :meth:`close`)."""
        self._check_open()
        self._require_optimizer_for_async()
        pairs = key_pairs(key, value, "value")
        outs = [v for _, v in pairs] if out is None else [o for _, o in key_pairs(key, out, "out")]
        work = [(self._state(k), v, o) for (k, v), o in zip(pairs, outs, strict=True)]
        for state, v, o in work:
            state.check_value(v, "value")
            state.check_value(o, "out")
        self._check_finite([(state, v) for state, v, _ in work])
        deadline = self._deadline()
        pending = []
        for state, v, o in work:
            self._forget_unpulled_values(state)  # a pushpull is a push, and its own pull
            state.pushed_since_pull = False
            landing = Landing(state, o, self._stats)
            if state.codec.round_trips > 1:
                # The last round's reply carries the codec's factors, not the value: push,
                # then pull (answered once the push's last round is applied).
                self._send_pushes(state, v, Op.PUSH, priority, borrow=borrow, deadline=deadline)
                requests = self._submit_pulls(state, landing, priority)
            else:
                requests = self._send_pushes(
                    state, v, Op.PUSHPULL, priority, landing, borrow, deadline=deadline
                )
            pending.append((landing, requests))
        self._receive_values(pending, deadline)

    def _receive_values(
        self, pending: Iterable[tuple[Landing, list[Request]]], deadline: Deadline
    ) -> None:
        """Wait for the values of every key of one call, all within the call's ``deadline``."""
        first_error: BaseException | None = None
        for landing, requests in pending:
            state = landing.state
            if landing.on_io_thread:
                waited = time.perf_counter()
                arrived = landing.all_arrived.wait(deadline.remaining())
                self._stats.wire_seconds += time.perf_counter() - waited
                if not arrived:
                    waiting = next(r for r in requests if not r.done())
                    first_error = first_error or KVStoreTimeoutError(
                        f"{waiting.what} to server {waiting.server} got no reply within "
                        f"{deadline.timeout} s (KVSTORE_TIMEOUT, for the whole call); is another "
                        f"worker stuck?"
                    )
                for error in landing.errors:
                    first_error = first_error or error
            else:
                for chunk, request in zip(state.chunks, requests, strict=True):
                    try:
                        waited = time.perf_counter()
                        reply = request.wait(deadline)
                        copies = xp.TRANSFERS.h2d_seconds
                        landed = time.perf_counter()
                        self._stats.wire_seconds += landed - waited
                        landing.write(chunk, reply)
                        # a relayed reply is also decoded here: that is encode time
                        h2d = xp.TRANSFERS.h2d_seconds - copies
                        self._stats.h2d_seconds += h2d
                        self._stats.encode_seconds += time.perf_counter() - landed - h2d
                        request.release_payloads()
                    except KVStoreError as exc:
                        first_error = first_error or exc
            if first_error is None:
                landing.target.finish()
            for index, push in enumerate(state.last_push):
                if push is not None and push.failed() and first_error is None:
                    try:
                        self._wait_push(state, index, deadline)
                    except KVStoreError as exc:
                        first_error = exc
        if first_error is not None:
            raise first_error

    def _wait_pushes(
        self, keys: Iterable[KeyState] | None = None, deadline: Deadline | None = None
    ) -> None:
        """Wait for this worker's pushes (of ``keys``, or of all keys) within ``deadline``
        (None: a call of its own); raise the first error after all ended."""
        if deadline is None:
            deadline = self._deadline()
        first_error: BaseException | None = None
        for state in keys if keys is not None else list(self._keys.values()):
            for index in range(len(state.chunks)):
                try:
                    self._wait_push(state, index, deadline)
                except KVStoreError as exc:
                    first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def wait(self, key: KeyArg | None = None) -> None:
        """Block until this worker's pushes (of ``key``, or of all keys) were applied."""
        self._check_open()
        if key is None:
            self._wait_pushes()
        else:
            keys = key if isinstance(key, list | tuple) else [key]
            self._wait_pushes([self._state(normalize_key(k)) for k in keys])

    def barrier(self) -> None:
        """Wait until every worker reached its barrier, after this worker's pushes were applied.

        So once any worker returns from ``barrier``, every worker's earlier pushes are applied.
        """
        self._check_open()
        deadline = self._deadline()
        self._wait_pushes(deadline=deadline)
        request = self._transport.submit(0, Op.BARRIER, what="barrier")
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
            target = Path(path).absolute()
            staging = checkpoint.staging_path(target)
            mine = checkpoint.worker_file(self.rank)
            local_error: BaseException | None = None
            sha = ""
            try:
                self._wait_pushes()  # (an error here fails the call everywhere, not just here)
                if self.rank == 0:
                    checkpoint.clear_stale_manifest(staging)
                arrays, meta = ckpt.codec_state(self._keys.values(), self.rank)
                sha = checkpoint.write_part(staging, mine, arrays, meta)
            except (OSError, KVStoreError) as exc:
                local_error = exc
            # Even when this worker failed: the servers refuse the call for everyone then.
            self._checkpoint_call(Op.SAVE, {"p": str(staging)}, local_error, f"save to {target}")
            finish_error: BaseException | None = None
            if self.rank == 0:  # every part is in: the manifest, then the rename
                try:
                    checkpoint.finalize(
                        target,
                        staging,
                        self._checkpoint_manifest(),
                        checkpoint.part_names(self.num_servers, self.num_workers),
                    )
                except (OSError, KVStoreError) as exc:
                    finish_error = exc
            # Nobody returns before rank 0 finished (or failed).
            self._transport.submit(0, Op.BARRIER, what="checkpoint barrier").wait(
                self._options.timeout
            )
            if finish_error is not None:
                raise CheckpointError(
                    f"could not complete the checkpoint {target}: {finish_error}"
                ) from finish_error
            if self.rank != 0:
                entry = checkpoint.read_manifest(target)["files"].get(mine, {})
                if entry.get("sha256") != sha:
                    raise CheckpointError(
                        f"rank 0 did not complete the checkpoint {target} (see its error)"
                    )

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
            target = Path(path).absolute()
            local_error: BaseException | None = None
            manifest: dict[str, Any] = {}
            plan: dict[Key, list[dict[str, Any] | None]] = {}
            try:
                self._wait_pushes()
                manifest = checkpoint.read_manifest(target)
                checkpoint.check_job(
                    manifest,
                    mode=self.type,
                    num_workers=self.num_workers,
                    num_servers=self.num_servers,
                )
                checkpoint.compare_keys(manifest["keys"], self._checkpoint_keys())
                mine = checkpoint.worker_file(self.rank)
                arrays, meta = checkpoint.read_part(target, mine, manifest)
                plan = ckpt.plan_restore(self._keys, arrays, meta, str(target / mine))
            except (OSError, KVStoreError) as exc:
                local_error = exc
            fields: dict[str, Any] = {"p": str(target)}
            try:
                self._checkpoint_call(Op.LOAD, {**fields, "ph": 0}, local_error, f"load {target}")
            except KVStoreError:
                try:  # every server drops what it staged; nothing changed anywhere
                    self._checkpoint_call(Op.LOAD, {**fields, "ph": 2}, None, "abort")
                except KVStoreError as exc:
                    logger.debug("aborting the load of %s: %s", target, exc)
                raise
            self._checkpoint_call(Op.LOAD, {**fields, "ph": 1}, None, f"load {target}")
            for key, state in self._keys.items():
                state.key_encoder = None
                state.encoders = [None] * len(state.chunks)
                state.restored = plan[key]
                self._forget_unpulled_values(state)  # values of a push from before the load
                state.pushed_since_pull = False
                for held in state.held or ():  # the next pull brings the restored w_pub whole
                    held.version = -1
            saved = manifest.get("optimizer")
            if saved is not None:
                self._optimizer = make_optimizer_spec(saved["name"], saved["params"])

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
            self._wait_pushes(states.values())
            return ckpt.codec_state_dict(states.values(), self.rank)

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
            plan = ckpt.plan_codec_state(self._keys, state, self.rank)
            states = [self._keys[key] for key in plan]
            self._wait_pushes(states)  # (an in-flight round still writes into its encoder)
            for key_state in states:
                key_state.key_encoder = None
                key_state.encoders = [None] * len(key_state.chunks)
                key_state.restored = plan[key_state.key]

    def _checkpoint_keys(self) -> list[dict[str, Any]]:
        return [
            checkpoint.key_spec(s.key, s.shape, s.dtype, s.codec.spec())
            for s in self._keys.values()
        ]

    def _checkpoint_manifest(self) -> dict[str, Any]:
        optimizer = self._optimizer
        return {
            "pskv": __version__,
            "mode": self.type,
            "num_workers": self.num_workers,
            "num_servers": self.num_servers,
            "optimizer": None
            if optimizer is None
            else {"name": optimizer.name, "params": dict(optimizer.params)},
            "keys": self._checkpoint_keys(),
        }

    def _checkpoint_call(
        self, op: Op, fields: dict[str, Any], local_error: BaseException | None, what: str
    ) -> None:
        """Send a collective SAVE or LOAD to every server and wait for all of them. With
        ``local_error`` (this worker could not do its part) the servers refuse the call for
        every worker, and this worker raises its own error."""
        if local_error is not None:
            fields = {**fields, "er": f"{type(local_error).__name__}: {local_error}"[:2000]}
        requests = [
            self._transport.submit(s, op, fields, what=f"{what} (server {s})")
            for s in range(self.num_servers)
        ]
        try:
            wait_all(requests, self._options.timeout)
        except KVStoreError:
            if local_error is None:
                raise
        if local_error is not None:  # (the servers' error only repeats it)
            if isinstance(local_error, KVStoreError):  # (a lost worker stays a WorkerLostError)
                raise local_error
            raise CheckpointError(f"{what}: {local_error}") from local_error

    # introspection -------------------------------------------------------------------------

    def stats(self) -> TrafficStats:
        """A snapshot of the bytes this worker pushed and pulled so far, and of the time its
        calls spent encoding, copying to and from the GPU and waiting for replies."""
        return dataclasses.replace(self._stats)

    @property
    def metrics_port(self) -> int | None:
        """The port of this worker's Prometheus endpoint until the store closes (None without
        ``KVSTORE_METRICS_PORT``)."""
        metrics = self._metrics
        return metrics.port if metrics is not None else None

    @property
    def optimizer(self) -> OptimizerSpec | None:
        """The optimizer set with :meth:`set_optimizer`, or None."""
        return self._optimizer

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
