"""The shard server: one ROUTER socket, an asyncio loop, and a thread pool for the heavy work.

Request handling (all on the loop thread, never blocking it):

* the ROUTER socket is a plain ZeroMQ socket whose file descriptor the event loop watches
  (``add_reader``); each wake-up drains a batch of messages without blocking, and replies are
  sent directly, without per-message futures (ZeroMQ's descriptor is edge-triggered, so the
  loop looks for input again after every send);
* ZeroMQ takes in at most :data:`RECV_QUEUE` messages per connection ahead of the loop
  (backpressure beyond) and drops a connection that sends a frame over the message limit
  (``KVSTORE_MAX_MESSAGE_BYTES``, by default the largest chunk of the workers' partition size,
  which each worker announces in its HELLO and is refused if it exceeds);
* every inbound message is decoded and validated by :func:`kvstore.wire.decode`, then checked
  against the server's state (session, key, chunk spec, payload sizes) *before* anything changes;
  a bad message gets an ``ERROR`` reply with a stable code, is logged, and everyone else is served
  as before;
* decoding, aggregation and optimizer updates of chunks longer than :data:`INLINE_ELEMS`
  elements run on a thread pool (the compiled kernels release the GIL), several at once;
  shorter chunks, which includes every fp32 chunk of the default partition size, run on
  the loop thread, where that costs less CPU than a thread hand-off. A push's work starts
  after the drain that received it, without a Task of its own unless it has to wait (for the
  pool or its chunk's turn): :mod:`kvstore.server.inline`. Per chunk the work is serialized by
  an ``asyncio.Lock`` that hands out turns in arrival order; different chunks proceed in
  parallel.

``dist_sync`` (and ``local``, which is sync with one worker): a chunk's round collects one push
from each of the N workers, decoding each into the round's aggregate as it arrives. When the Nth
is in, the optimizer (if any) is applied once, or the aggregate becomes the stored value, and then
all N pushes are acknowledged. A worker's second push of a chunk within one round waits for the
next round. ``dist_async``: each push is decoded and applied on arrival (an optimizer is required)
and acknowledged.

Pulls are answered with the chunk's published value (or, when the worker offers to take it and
the value is a round's sum without an optimizer, with that round's pushes to sum itself: a
relayed pull, see :mod:`kvstore.codecs.base`), but only after as many of the same worker's
pushes of that chunk have been applied as the pull says it follows (``af``: pulls travel on the
worker's control connection, pushes on its data connection, so arrival order means nothing). So
``push`` then ``pull`` reads the worker's own update without an extra round trip. Such a value
reply also acknowledges those pushes: a push whose worker's pull is answered in the round that
applied it gets no separate ack; the reply lists it in ``ak`` (errors always get their own reply).

``init`` is collective: each worker declares the chunk's spec (rank 0 also sends the value), the
specs must match rank 0's, and every worker's init is answered once rank 0's value is stored, so
no pull can see an uninitialised key. ``set_optimizer`` and ``barrier`` are collective too: each is
answered when all N workers made the same call (with equal optimizer arguments).

When every worker of a job has said goodbye, the server forgets the job (keys, optimizer, mode)
and serves the next one.

With a heartbeat timeout (``KVSTORE_HEARTBEAT_TIMEOUT``) the server notes when it last heard
from each rank (any message counts; workers ping when they have nothing else to say) and, every
fraction of the timeout, declares the silent ones lost: their rank is released for a
replacement, and what waits on them fails with ``WORKER_LOST`` ("lost workers" below).

With ``config.metrics`` (``KVSTORE_METRICS_PORT``) the server serves Prometheus metrics
(:mod:`kvstore.metrics`): it counts each message and reply, each error and each round's
duration; queue depths are read from its state when scraped. Without, the state's ``metrics`` is
None and each of those places costs one comparison.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from kvstore import auth, wire
from kvstore.codecs import codec_from_spec
from kvstore.codecs.base import frame_array, relay_fits
from kvstore.codecs.pulled import pull_applies, pull_codec_from_spec
from kvstore.config import ServerConfig
from kvstore.errors import (
    CodecError,
    ConfigError,
    ErrorCode,
    OptimizerError,
    ProtocolError,
)
from kvstore.metrics import ServerMetrics, frames_nbytes
from kvstore.server.chunk import ChunkSpec, ChunkState, Deferred, PendingReply, PullWaiter
from kvstore.server.collectives import Collectives
from kvstore.server.errors import RequestError
from kvstore.server.job import ServerState
from kvstore.server.membership import Membership
from kvstore.server.replies import Replies, peer
from kvstore.server.work import WorkRunner
from kvstore.wire import Message, Op

logger = logging.getLogger(__name__)

DRAIN_BATCH = 256
"""Messages handled per wake-up before other callbacks get a turn."""

RECV_QUEUE = 16
"""Messages per connection that ZeroMQ receives ahead of the server (``ZMQ_RCVHWM``).

On a ROUTER's inbound side a full queue is backpressure, not loss: libzmq stops reading that
connection until the server has taken some of its messages, and TCP then holds the sender back.
So what ZeroMQ buffers for one connection is at most this many messages of at most
``max_message_bytes`` per frame (a legitimate message has one header and at most one payload
frame: about 65 MiB with the default limit), instead of everything a peer cares to send
(with no limit, a few strangers sending large frames could make a server hold gigabytes).
The server drains its socket whenever it is readable, so a legitimate worker's pushes wait here
only while the server is busy, and 16 chunks are more work than one drain does."""


class ShardServer:
    """One shard server.

    Example::

        server = ShardServer(ServerConfig(port=0, num_workers=2))
        address = await server.start()      # "tcp://127.0.0.1:PORT"
        ...
        await server.stop()

    Args:
        config: the server's settings.
        context: a ZeroMQ asyncio context to share (``local`` mode uses ``inproc://``, which
            needs the worker's context); by default the server makes and closes its own.
    """

    def __init__(self, config: ServerConfig, *, context: zmq.Context | None = None):
        self.config = config
        self._own_context = context is None
        self._context = context if context is not None else zmq.Context()
        self._socket: zmq.Socket | None = None
        self._zap: auth.ZapHandler | None = None  # with CURVE keys: admits the job's workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None
        self._drain_scheduled = False
        self.address: str | None = None
        self._state = ServerState(config)
        self._replies = Replies(self._state, after_send=self._schedule_drain)
        self._work = WorkRunner(config.threads, f"kvstore-server{config.server_rank}")
        self._heard = self._state.heard
        self._collectives = Collectives(self._state, self._replies, self._work)
        self._membership = Membership(self._state, self._replies, self._fail_waiting)
        self._handlers: dict[Op, Callable[[bytes, int, Message], None]] = {
            Op.INIT: self._on_init,
            Op.PUSH: self._on_push,
            Op.PUSHPULL: self._on_push,
            Op.PULL: self._on_pull,
            Op.BARRIER: self._collectives.on_barrier,
            Op.SET_OPTIMIZER: self._collectives.on_set_optimizer,
            Op.BYE: self._membership.on_bye,
            Op.SAVE: self._collectives.on_checkpoint,
            Op.LOAD: self._collectives.on_checkpoint,
            Op.PING: self._membership.on_ping,
        }

    # lifecycle -------------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind the socket and start serving; returns the address workers connect to."""
        if self._socket is not None:
            raise RuntimeError("ShardServer.start() was already called")
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises, never vanishes
        sock.setsockopt(zmq.SNDHWM, 0)  # replies are never dropped
        sock.setsockopt(zmq.RCVHWM, RECV_QUEUE)  # backpressure per connection, see RECV_QUEUE
        if self._state.max_message is not None:
            # A larger frame drops its connection before libzmq allocates it. With CURVE the
            # limit applies to the encrypted frame, a fixed overhead larger.
            overhead = auth.CURVE_MESSAGE_OVERHEAD if self.config.curve is not None else 0
            sock.setsockopt(zmq.MAXMSGSIZE, self._state.max_message + overhead)
        sock.setsockopt(zmq.LINGER, 0)
        cfg = self.config
        if cfg.metrics is not None:  # first: a failure leaves nothing to undo
            self._state.metrics = ServerMetrics(cfg.metrics, cfg.server_rank)
            self._state.metrics.watch_queues(self._queue_depths)
        try:
            if cfg.curve is not None and not (cfg.bind or "").startswith("inproc://"):
                # Before the bind: without a ZAP handler libzmq admits any CURVE client.
                self._zap = auth.ZapHandler(
                    self._context, cfg.curve.peer_key, f"server {cfg.server_rank}"
                )
                self._zap.start()
                auth.secure_server(sock, cfg.curve)
            if cfg.bind is not None:
                sock.bind(cfg.bind)
                self.address = cfg.bind
            else:
                endpoint = f"tcp://{cfg.host}:{cfg.port}" if cfg.port else f"tcp://{cfg.host}:0"
                sock.bind(endpoint)
                bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
                port = int(bound.rsplit(":", 1)[1])
                host = cfg.host if cfg.host not in ("0.0.0.0", "*", "") else socket.getfqdn()
                self.address = f"tcp://{host}:{port}"
        except (zmq.ZMQError, OSError, ConfigError) as exc:
            sock.close(0)
            self._close_metrics()
            self._stop_zap()
            if not isinstance(exc, zmq.ZMQError):
                raise
            raise OSError(
                f"server {cfg.server_rank} cannot bind {cfg.host}:{cfg.port}: {exc}"
            ) from exc
        self._socket = self._replies.socket = sock
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()  # messages may have arrived before the reader was added
        self._membership.start(self._loop)
        logger.info(
            "server %d/%d serving %d worker(s) on %s with %d thread(s)",
            cfg.server_rank,
            cfg.num_servers,
            cfg.num_workers,
            self.address,
            cfg.threads,
        )
        if self._zap is not None:
            logger.info(
                "server %d admits only workers with the job's CURVE keys (connections encrypted)",
                cfg.server_rank,
            )
        elif not self.address.startswith("inproc://"):
            logger.warning(
                "server %d accepts any worker that can reach %s: it has no CURVE keys "
                "(KVSTORE_AUTH_DIR or KVSTORE_AUTH_*_KEY; kvstore-launch makes them unless "
                "--no-auth); run it on a trusted network only",
                cfg.server_rank,
                self.address,
            )
        return self.address

    async def stop(self) -> None:
        """Stop serving, close the socket and the thread pool."""
        self._membership.stop()
        if self._fd is not None and self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        await self._work.cancel()
        if self._socket is not None:
            self._socket.close(0)
            self._socket = self._replies.socket = None
        self._stop_zap()
        self._work.shutdown()
        if self._own_context:
            self._context.term()
        self._replies.close()
        self._close_metrics()

    def _stop_zap(self) -> None:
        if self._zap is not None:
            self._zap.stop()
            self._zap = None

    def _close_metrics(self) -> None:
        if self._state.metrics is not None:
            self._state.metrics.close()
            self._state.metrics = None

    @property
    def metrics_port(self) -> int | None:
        """The port of the Prometheus endpoint while it serves (None without metrics)."""
        return self._state.metrics.port if self._state.metrics is not None else None

    def _queue_depths(self) -> dict[str, int]:
        """Requests waiting, by :data:`kvstore.metrics.SERVER_QUEUES` name.

        Runs on the metrics endpoint's thread while the loop thread changes the state, so it
        only takes sizes, of a snapshot of the chunks (copied in one step, which the loop thread
        cannot interleave with).
        """
        job = self._state.job
        chunks = list(job.chunks.values())
        return {
            "round_pushes": sum(len(c.round_replies) for c in chunks),
            "deferred_pushes": sum(len(c.deferred) for c in chunks),
            "pull_waiters": sum(len(c.pull_waiters) for c in chunks),
            "init_waiters": sum(len(c.init_waiters) for c in chunks),
            "collective_waiters": len(job.barrier) + len(job.proposals),
            "tasks": self._work.tasks,
        }

    async def __aenter__(self) -> ShardServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # I/O -------------------------------------------------------------------------------------

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self._loop is not None:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Handle the messages waiting on the socket (a batch; the rest on the next turn)."""
        self._drain_scheduled = False
        sock = self._socket
        if sock is None:
            return
        self._state.heard_at = time.monotonic()  # a sign of life from each sender (heartbeats)
        for _ in range(DRAIN_BATCH):
            try:
                frames = wire.recv_frames(sock)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return  # closed under us during shutdown
            if len(frames) < 2:
                continue  # a routing id alone: nothing to answer
            identity = frames[0].bytes
            try:
                self._handle(identity, frames[1:])
            except Exception:  # the loop must survive anything a client sends
                logger.exception("unexpected error handling a message from %s", peer(identity))
        self._schedule_drain()

    # dispatch --------------------------------------------------------------------------------

    def _handle(self, identity: bytes, frames: list[Any]) -> None:
        try:
            msg = wire.decode(frames)
        except ProtocolError as exc:
            if self._state.metrics is not None:
                self._state.metrics.received(None, frames_nbytes(frames))
            logger.warning("bad message from %s: %s", peer(identity), exc)
            self._replies.error(
                identity, wire.peek_request_id(frames), None, ErrorCode.BAD_MESSAGE, str(exc)
            )
            return
        if self._state.metrics is not None:
            self._state.metrics.received(msg.op, frames_nbytes(frames))
        try:
            if msg.op is Op.HELLO:
                self._membership.on_hello(identity, msg)
                return
            handler = self._handlers.get(msg.op)
            if handler is None:
                raise RequestError(ErrorCode.BAD_MESSAGE, f"{msg.op.name} is not a request")
            rank = self._state.job.sessions.get(identity)
            if rank is None:
                self._membership.refuse_stranger(identity, msg)
            heard = self._heard
            if heard is not None:
                heard[rank] = self._state.heard_at
            handler(identity, rank, msg)
        except RequestError as exc:
            logger.warning(
                "refused %s (id %d) from %s: %s", msg.op.name, msg.rid, peer(identity), exc
            )
            self._replies.error(identity, msg.rid, msg.op, exc.code, str(exc), exc.lost_rank)
        except (CodecError, OptimizerError) as exc:
            code = ErrorCode.CODEC if isinstance(exc, CodecError) else ErrorCode.OPTIMIZER
            logger.warning("refused %s from %s: %s", msg.op.name, peer(identity), exc)
            self._replies.error(identity, msg.rid, msg.op, code, str(exc))
        except Exception as exc:
            logger.exception("internal error on %s from %s", msg.op.name, peer(identity))
            self._replies.error(
                identity, msg.rid, msg.op, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            )

    # lost workers ------------------------------------------------------------------------------

    def _fail_waiting(self, rank: int) -> None:
        """Fail the requests that wait on the lost worker ``rank``."""
        self._collectives.worker_lost(rank)
        job = self._state.job
        for chunk in job.chunks.values():
            chunk.declared.pop(rank, None)  # the replacement declares it again
            chunk.applied.pop(rank, None)  # and counts its pushes from 0
            waiters = chunk.init_waiters
            if rank == 0 and waiters:  # rank 0's value never comes
                chunk.init_waiters = []
                for reply in waiters:
                    chunk.declared.pop(reply.rank, None)  # (so that it can try again)
                    self._replies.worker_lost(reply, rank, f"init of {chunk.spec.name}")
            elif any(reply.rank == rank for reply in waiters):
                chunk.init_waiters = [reply for reply in waiters if reply.rank != rank]
                for reply in waiters:
                    if reply.rank == rank:
                        self._replies.worker_lost(reply, rank, f"init of {chunk.spec.name}")
            dropped = [push for push in chunk.deferred if push.reply.rank == rank]
            if dropped:  # not in a round yet: dropped (the lost rank's own round push stays)
                chunk.deferred = type(chunk.deferred)(
                    push for push in chunk.deferred if push.reply.rank != rank
                )
                for push in dropped:
                    self._replies.worker_lost(push.reply, rank, f"push of {chunk.spec.name}")
            own = [w for w in chunk.pull_waiters if w.reply.rank == rank]
            if own:
                chunk.pull_waiters = [w for w in chunk.pull_waiters if w.reply.rank != rank]
                for waiter in own:
                    self._replies.worker_lost(waiter.reply, rank, f"pull of {chunk.spec.name}")
            self._fail_blocked(chunk)

    def _fail_blocked(self, chunk: ChunkState) -> None:
        """In dist_sync, while a rank is lost: fail the requests that wait on ``chunk``'s
        round if it lacks a lost rank's push (a later round lacks it in any case)."""
        job = self._state.job
        if not job.lost or job.mode == "dist_async":
            return
        missing = next((r for r in sorted(job.lost) if r not in chunk.round_ranks), None)
        if missing is None:
            return
        what = f"the dist_sync round of {chunk.spec.name}"
        failed = job.failed
        pushes = [*chunk.round_replies, *(push.reply for push in chunk.deferred)]
        for reply in pushes:
            if (reply.identity, reply.rid) not in failed:
                failed.add((reply.identity, reply.rid))
                self._replies.worker_lost(reply, missing, what)
        waiters, chunk.pull_waiters = chunk.pull_waiters, []
        for waiter in waiters:
            for rid in waiter.acks:  # (pushes answered by this pull's reply: done)
                self._replies.send(waiter.reply.identity, wire.reply(rid), Op.PUSH)
            self._replies.worker_lost(waiter.reply, missing, what)

    # init --------------------------------------------------------------------------------------

    def _chunk_spec(self, msg: Message) -> tuple[ChunkSpec, Any]:
        shape = tuple(msg["sh"])
        numel = math.prod(shape)
        start, count = msg["o"], msg["n"]
        if start + count > numel or (count == 0 and numel > 0):
            raise RequestError(
                ErrorCode.BAD_VALUE,
                f"key {msg['k']!r} chunk {msg['c']}: elements [{start}, {start + count}) do not "
                f"fit a value of shape {shape}",
            )
        codec = codec_from_spec({"type": msg["cd"], **msg["cp"]})
        codec.check_dtype(msg["dt"], f"key {msg['k']!r}")
        optimizer = self._state.job.optimizer
        if optimizer is not None:  # e.g. DGC under an optimizer with momentum
            codec.check_optimizer(optimizer.spec.name, optimizer.spec.params)
        nbytes = count * np.dtype(msg["dt"]).itemsize
        if self._state.max_message is not None and nbytes > self._state.max_message:
            # Its value could never arrive: refused before any state is allocated for it.
            raise RequestError(
                ErrorCode.MESSAGE_LIMIT,
                f"key {msg['k']!r} chunk {msg['c']} holds {nbytes} bytes, more than the "
                f"{self._state.max_message} bytes server {self.config.server_rank} accepts in a "
                f"message (KVSTORE_MAX_MESSAGE_BYTES)",
            )
        pull_codec = None
        if msg.get("pd") is not None:
            pull_codec = pull_codec_from_spec({"type": msg["pd"], **msg.get("pp", {})})
            if not pull_applies(pull_codec, msg["dt"]):
                raise RequestError(
                    ErrorCode.BAD_VALUE,
                    f"key {msg['k']!r} is {msg['dt']}: pulls are compressed for float32 keys only",
                )
        spec = ChunkSpec(
            key=msg["k"],
            index=msg["c"],
            start=start,
            numel=count,
            dtype=msg["dt"],
            shape=shape,
            codec=tuple(sorted(codec.spec().items())),
            pull=tuple(sorted(pull_codec.spec().items())) if pull_codec is not None else (),
        )
        return spec, codec

    def _on_init(self, identity: bytes, rank: int, msg: Message) -> None:
        spec, codec = self._chunk_spec(msg)
        chunks = self._state.job.chunks
        chunk = chunks.get((spec.key, spec.index))
        if chunk is None:
            chunk = ChunkState(spec=spec, codec=codec)
            chunks[(spec.key, spec.index)] = chunk
        if rank in chunk.declared:
            raise RequestError(
                ErrorCode.DUPLICATE_INIT,
                f"rank {rank} initialised {spec.name} twice; call kv.init once per key",
            )
        reply = PendingReply(identity, msg.rid, rank, False, Op.INIT)
        if rank == 0:
            if len(msg.payloads) != 1:
                raise RequestError(ErrorCode.BAD_VALUE, "rank 0's INIT must carry the value")
            expected = spec.numel * np.dtype(spec.dtype).itemsize
            values = frame_array(msg.payloads[0], spec.dtype)
            if values.nbytes != expected:
                raise RequestError(
                    ErrorCode.BAD_VALUE,
                    f"{spec.name}: INIT value has {values.nbytes} bytes, expected {expected}",
                )
            if chunk.initialized:
                # A rank 0 that rejoined the job (its predecessor was lost) runs its script
                # from the top: the key lives on, and its value must not be overwritten.
                if spec != chunk.spec:
                    raise RequestError(
                        ErrorCode.SPEC_MISMATCH, self._rejoin_mismatch(spec, chunk.spec)
                    )
                chunk.declared[0] = spec
                self._replies.ack(reply)
                return
            # Rank 0's declaration is the reference; earlier different ones are refused now.
            chunk.spec, chunk.codec = spec, codec
            chunk.pull_codec = pull_codec_from_spec(dict(spec.pull)) if spec.pull else None
            chunk.set_initial_value(values, self._state.job.mode)
            chunk.declared[0] = spec
            self._replies.ack(reply)
            waiting, chunk.init_waiters = chunk.init_waiters, []
            for other in waiting:
                other_spec = chunk.declared[other.rank]
                if other_spec != spec:
                    del chunk.declared[other.rank]
                    self._replies.error(
                        other.identity, other.rid, Op.INIT, ErrorCode.SPEC_MISMATCH,
                        self._mismatch(other.rank, other_spec, spec),
                    )  # fmt: skip
                else:
                    self._replies.ack(other)
            return
        if msg.payloads:
            raise RequestError(ErrorCode.BAD_VALUE, "only rank 0's INIT carries a value")
        if chunk.initialized:
            if spec != chunk.spec:
                raise RequestError(ErrorCode.SPEC_MISMATCH, self._mismatch(rank, spec, chunk.spec))
            chunk.declared[rank] = spec
            self._replies.ack(reply)
        else:
            if 0 in self._state.job.lost:  # rank 0's value would never come
                self._state.job.require_all_ranks(f"init of {spec.name}")
            chunk.declared[rank] = spec
            chunk.init_waiters.append(reply)

    @staticmethod
    def _mismatch(rank: int, spec: ChunkSpec, reference: ChunkSpec) -> str:
        return (
            f"{spec.name}: rank {rank} declared {spec.describe()} but rank 0 declared "
            f"{reference.describe()}; every worker must init a key with the same shape, dtype, "
            f"compression, KVSTORE_BIGARRAY_BOUND/KVSTORE_PARTITION_BYTES and KVSTORE_SERVERS"
        )

    @staticmethod
    def _rejoin_mismatch(spec: ChunkSpec, reference: ChunkSpec) -> str:
        return (
            f"{spec.name}: rank 0 declared {spec.describe()} but the key lives in this job as "
            f"{reference.describe()}; a worker that rejoins a job must init its keys as before"
        )

    def _ready_chunk(self, rank: int, msg: Message) -> ChunkState:
        key, index = msg["k"], msg["c"]
        chunk = self._state.job.chunks.get((key, index))
        if chunk is None or not chunk.initialized:
            raise RequestError(
                ErrorCode.NOT_INITIALIZED,
                f"key {key!r} chunk {index} is not initialised on server "
                f"{self.config.server_rank}; call kv.init first",
            )
        if rank not in chunk.declared:
            raise RequestError(
                ErrorCode.NOT_INITIALIZED,
                f"rank {rank} never called kv.init for key {key!r}; init is collective",
            )
        return chunk

    # push --------------------------------------------------------------------------------------

    def _on_push(self, identity: bytes, rank: int, msg: Message) -> None:
        chunk = self._ready_chunk(rank, msg)
        spec = chunk.spec
        if msg["n"] != spec.numel:
            raise RequestError(
                ErrorCode.BAD_VALUE,
                f"{spec.name}: push of {msg['n']} elements, the chunk has {spec.numel}",
            )
        chunk.codec.validate_payloads(msg.payloads, spec.numel, spec.dtype)
        job = self._state.job
        if job.mode == "dist_async" and job.optimizer is None:
            raise RequestError(
                ErrorCode.NO_OPTIMIZER,
                "dist_async applies every push on arrival and needs an optimizer: "
                "call kv.set_optimizer(...) on every worker before pushing",
            )
        want_value = msg.op is Op.PUSHPULL
        reply = PendingReply(
            identity, msg.rid, rank, want_value, msg.op, msg.get("rx", 0), msg.get("pv")
        )
        if job.mode == "dist_async":
            self._work.submit(self._push_async(chunk, reply, msg.payloads))
        else:
            self._admit(chunk, Deferred(reply, msg.payloads))

    def _admit(self, chunk: ChunkState, push: Deferred) -> None:
        """Give a sync push its place in the current round, or defer it to a later one."""
        rank = push.reply.rank
        if rank in chunk.round_ranks or any(d.reply.rank == rank for d in chunk.deferred):
            chunk.deferred.append(push)
            if self._state.job.lost:
                self._fail_blocked(chunk)
            return
        if self._state.metrics is not None and not chunk.round_ranks:
            chunk.round_started = time.perf_counter()  # the round's first push
        chunk.round_ranks.add(rank)
        chunk.round_replies.append(push.reply)
        self._work.submit(self._accumulate(chunk, push.payloads))
        if self._state.job.lost:
            self._fail_blocked(chunk)

    async def _accumulate(self, chunk: ChunkState, payloads: list[Any]) -> None:
        async with chunk.lock:  # turns are granted in arrival order
            first = chunk.accumulated == 0
            try:
                await self._work.run(chunk, chunk.aggregator.add, payloads, first)
                if chunk.codec.relayable and self._state.job.optimizer is None:
                    chunk.round_payloads.append(payloads)  # for relayed pulls of the sum
            except Exception as exc:
                logger.exception("decoding a push of %s failed", chunk.spec.name)
                chunk.round_error = chunk.round_error or exc
            chunk.accumulated += 1
            if chunk.accumulated == self.config.num_workers:
                await self._complete_round(chunk)

    async def _complete_round(self, chunk: ChunkState) -> None:
        replies, error = chunk.round_replies, chunk.round_error
        summed, started = chunk.round_payloads, chunk.round_started
        chunk.round_ranks, chunk.round_replies, chunk.round_payloads = set(), [], []
        chunk.round_error, chunk.accumulated = None, 0
        intermediate = acknowledgement = None
        if error is None:
            try:
                intermediate = await self._work.run(chunk, chunk.aggregator.finish)
                if intermediate is None:
                    acknowledgement = _copied(chunk.aggregator.reply_frames())
                    await self._apply(chunk, chunk.aggregator.result)
                    # Without an optimizer the new value is exactly the sum of these pushes
                    # (summed stays empty for codecs that cannot relay).
                    relayable = (
                        bool(summed)
                        and self._state.job.optimizer is None
                        and chunk.master is None
                        # (sparse pushes vary in size: relay only while it saves bytes)
                        and relay_fits(summed, chunk.spec.numel, chunk.spec.dtype)
                    )
                    chunk.relay = summed if relayable else None
                else:
                    intermediate = _copied(intermediate)
            except Exception as exc:
                error = exc
        if error is None and intermediate is not None:
            for reply in replies:
                if self._push_applied(chunk, reply):
                    self._replies.send(
                        reply.identity, wire.reply(reply.rid, None, intermediate), reply.op
                    )
            self._release_pulls(chunk)
        else:
            self._pushes_done(chunk, replies, error, acknowledgement)
        if self._state.metrics is not None:
            # (``started`` was read above: a push admitted while this awaited the pool began
            # the next round and its clock.)
            self._state.metrics.round_done(time.perf_counter() - started)
        deferred, chunk.deferred = chunk.deferred, type(chunk.deferred)()
        for push in deferred:
            self._admit(chunk, push)
        if self._state.job.lost:  # the next round lacks a lost rank: its pull waiters fail
            self._fail_blocked(chunk)

    async def _push_async(self, chunk: ChunkState, reply: PendingReply, payloads: list) -> None:
        error: BaseException | None = None
        async with chunk.lock:
            try:
                await self._work.run(chunk, chunk.aggregator.add, payloads, True)
                if await self._work.run(chunk, chunk.aggregator.finish) is not None:
                    raise RequestError(
                        ErrorCode.CODEC,
                        f"codec {chunk.codec.name!r} needs several round trips per step, "
                        f"which only dist_sync provides",
                    )
                await self._apply(chunk, chunk.aggregator.result)
                chunk.relay = None  # an optimizer's update: only the dense value says it
            except Exception as exc:
                error = exc
            self._pushes_done(chunk, [reply], error)

    async def _apply(self, chunk: ChunkState, grad: Any) -> None:
        assert chunk.value is not None
        optimizer = self._state.job.optimizer
        if optimizer is not None and not chunk.spec.dtype.startswith("float"):
            raise RequestError(
                ErrorCode.BAD_VALUE,
                f"{chunk.spec.name} is {chunk.spec.dtype}: the optimizer updates float keys only",
            )
        out = chunk.value.spare()
        aggregator = chunk.aggregator
        if optimizer is None and chunk.master is None and grad is aggregator.result:
            # The round's sum is the new value: publish the aggregator's array itself and let
            # the next round accumulate into the spare, instead of copying.
            aggregator.result = out
            chunk.value.publish(grad)
            chunk.updates += 1
            await self._advance_pulled(chunk)
            return
        try:
            await self._work.run(chunk, chunk.apply_update, grad, optimizer, out)
        except BaseException:
            chunk.value.give_back(out)
            raise
        chunk.value.publish(out)
        await self._advance_pulled(chunk)

    async def _advance_pulled(self, chunk: ChunkState) -> None:
        """With compressed pulls in dist_sync: encode this round's delta once, for every
        worker's pull (dist_async encodes per worker, at its pull)."""
        if chunk.pull is not None:  # (dist_sync only)
            assert chunk.value is not None
            await self._work.run(chunk, chunk.pull.advance, chunk.value.current)

    def _finish_push(
        self,
        chunk: ChunkState,
        reply: PendingReply,
        error: BaseException | None,
        acknowledgement: list[bytes] | None = None,
    ) -> None:
        if error is None and acknowledgement is not None and not reply.want_value:
            self._replies.send(
                reply.identity, wire.reply(reply.rid, None, acknowledgement), reply.op
            )
            return
        if error is None:
            self._replies.answer(reply, chunk)
            return
        if isinstance(error, RequestError):
            code = error.code
        elif isinstance(error, CodecError):  # a push its codec refused (sizes, NaN factors)
            code = ErrorCode.CODEC
            logger.warning("a push of %s was refused: %s", chunk.spec.name, error)
        else:
            code = ErrorCode.INTERNAL
            logger.error("update of %s failed: %r", chunk.spec.name, error)
        self._replies.error(
            reply.identity, reply.rid, reply.op, code, f"{chunk.spec.name}: {error}"
        )

    # pull --------------------------------------------------------------------------------------

    def _on_pull(self, identity: bytes, rank: int, msg: Message) -> None:
        chunk = self._ready_chunk(rank, msg)
        reply = PendingReply(
            identity, msg.rid, rank, True, Op.PULL, msg.get("rx", 0), msg.get("pv")
        )
        if chunk.applied[rank] >= msg["af"]:
            self._replies.value(reply, chunk)
        else:
            chunk.pull_waiters.append(PullWaiter(reply, msg["af"]))
            if self._state.job.lost:
                self._fail_blocked(chunk)

    def _push_applied(self, chunk: ChunkState, reply: PendingReply) -> bool:
        """Count ``reply``'s push as applied for its rank; whether it still needs an answer.

        A lost worker's pushes count for nobody (its replacement counts its own from 0), and a
        push answered with WORKER_LOST while it waited in its round needs no other answer.
        """
        job = self._state.job
        if reply.identity in job.sessions:
            chunk.applied[reply.rank] += 1
        failed = job.failed
        if failed and (reply.identity, reply.rid) in failed:
            failed.discard((reply.identity, reply.rid))
            return False
        return True

    def _pushes_done(
        self,
        chunk: ChunkState,
        replies: list[PendingReply],
        error: BaseException | None,
        acknowledgement: list[bytes] | None = None,
    ) -> None:
        """Answer finished pushes and release the pulls that were waiting for them.

        A successful plain push whose worker has a pull waiting that this push completes gets
        no ack of its own: the pull's value reply lists it in ``ak`` (one message less per
        chunk and step). Errors always get their own reply, and so do the pushes of a round
        whose acknowledgement carries frames (``acknowledgement``: a multi-round codec's
        :meth:`~kvstore.codecs.base.Aggregator.reply_frames`, which a pushpull's value
        reply does not carry).
        """
        sessions = self._state.job.sessions
        for reply in [reply for reply in replies if self._push_applied(chunk, reply)]:
            if (
                error is None
                and acknowledgement is None
                and not reply.want_value
                and reply.identity in sessions
            ):
                waiter = next(
                    (
                        w
                        for w in chunk.pull_waiters
                        if w.reply.rank == reply.rank and w.after <= chunk.applied[reply.rank]
                    ),
                    None,
                )
                if waiter is not None:
                    waiter.acks.append(reply.rid)
                    continue
            self._finish_push(chunk, reply, error, acknowledgement)
        self._release_pulls(chunk)

    def _release_pulls(self, chunk: ChunkState) -> None:
        if not chunk.pull_waiters:
            return
        still_waiting = []
        for waiter in chunk.pull_waiters:
            if chunk.applied[waiter.reply.rank] >= waiter.after:
                self._replies.value(waiter.reply, chunk, waiter.acks)
            else:
                still_waiting.append(waiter)
        chunk.pull_waiters = still_waiting


def _copied(frames: list[Any] | None) -> list[bytes] | None:
    """Reply frames of an aggregator as bytes of their own (it reuses its buffers in the next
    round, while the replies may still be queued)."""
    if frames is None:
        return None
    return [bytes(memoryview(getattr(f, "buffer", f))) for f in frames]


__all__ = ["ShardServer"]
