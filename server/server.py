"""The shard server: one ROUTER socket, an asyncio loop, and the dispatch of each request to the
part of the server that handles it.

Request handling (all on the loop thread, never blocking it):

* the ROUTER socket is a plain ZeroMQ socket whose file descriptor the event loop watches
  (``add_reader``); each wake-up drains a batch of messages without blocking, and replies are
  sent directly, without per-message futures (ZeroMQ's descriptor is edge-triggered, so the
  loop looks for input again after every send);
* on TCP, peers connect to the server's admission gate (:mod:`kvstore.server.gate`), which
  relays each connection to the socket (listening on the loopback) and admits a frame only once
  it fits the room per connection and in all: what peers make the server hold is bounded by its
  settings. The loop tells the gate what it took from the socket;
* ZeroMQ takes in at most :data:`RECV_QUEUE` messages per connection ahead of the loop
  (backpressure beyond) and drops a connection that sends a frame over the message limit
  (``KVSTORE_MAX_MESSAGE_BYTES``, by default the largest chunk of the workers' partition size,
  which each worker announces in its HELLO and is refused if it exceeds);
* every inbound message is decoded and validated by :func:`kvstore.wire.decode`, then checked
  against the server's state (session, key, chunk spec, payload sizes) *before* anything changes;
  a bad message gets an ``ERROR`` reply with a stable code, is logged, and everyone else is served
  as before;
* a request from a connection with a session goes to the handler of its op:

  ========================================  ==================================================
  HELLO, BYE, PING                          :class:`~kvstore.server.membership.Membership`:
                                            sessions, heartbeats, lost workers
  INIT                                      :class:`~kvstore.server.keys.Keys`
  PUSH, PUSHPULL, PULL                      :class:`~kvstore.server.rounds.Rounds`
  BARRIER, SET_OPTIMIZER, SAVE, LOAD        :class:`~kvstore.server.collectives.Collectives`
  ========================================  ==================================================

The parts share one :class:`~kvstore.server.job.ServerState` (the job being served) and one
reply sender (:class:`~kvstore.server.replies.Replies`); the chunks' work runs inline or on the
thread pool through :class:`~kvstore.server.work.WorkRunner`.

With ``config.metrics`` (``KVSTORE_METRICS_PORT``) the server serves Prometheus metrics
(:mod:`kvstore.metrics`): it counts each message and reply, each error and each round's
duration; queue depths are read from its state when scraped. Without, the state's ``metrics`` is
None and each of those places costs one comparison.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvstore import auth, wire
from kvstore.config import ServerConfig
from kvstore.errors import (
    CodecError,
    ConfigError,
    ErrorCode,
    OptimizerError,
    ProtocolError,
)
from kvstore.metrics import ServerMetrics, frames_nbytes
from kvstore.server.collectives import Collectives
from kvstore.server.errors import RequestError
from kvstore.server.gate import AdmissionGate
from kvstore.server.gate_limits import GateLimits
from kvstore.server.gate_sockets import relay_addresses_work
from kvstore.server.job import ServerState
from kvstore.server.keys import Keys
from kvstore.server.membership import Membership
from kvstore.server.replication import Replication
from kvstore.server.replies import Replies, peer
from kvstore.server.rounds import Rounds
from kvstore.server.work import WorkRunner
from kvstore.wire import Message, Op

logger = logging.getLogger(__name__)

DRAIN_BATCH = 256
"""Messages handled per wake-up before other callbacks get a turn."""

RECV_QUEUE = 16
"""Messages per connection that ZeroMQ receives ahead of the server (``ZMQ_RCVHWM``).

On a ROUTER's inbound side a full queue is backpressure, not loss: libzmq stops reading that
connection until the server has taken some of its messages, and TCP then holds the sender back.
It counts finished messages only; the admission gate bounds the bytes (a message's frames wait
in libzmq until its last one arrived). The server drains its socket whenever it is readable, so
a legitimate worker's pushes wait here only while the server is busy, and 16 chunks are more
work than one drain does."""


WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "", "::"})
"""``--host`` values that bind every interface: no worker can connect to them."""


def worker_address(host: str, port: int) -> str:
    """The address workers connect to, for a server bound to ``host`` and ``port``: where
    ``host`` is a wildcard (:data:`WILDCARD_HOSTS`), the host's name (``socket.gethostname()``,
    what Slurm and most schedulers call a node) instead, which a worker on another host can
    resolve (``socket.getfqdn()`` often gives ``localhost`` on cluster nodes)."""
    shown = socket.gethostname() if host in WILDCARD_HOSTS else _in_brackets(host)
    return f"tcp://{shown}:{port}"


def _user_id(frame: Any) -> str:
    """The ZAP user id of the connection ``frame`` came on (CURVE only; else "")."""
    try:
        return str(frame.get("User-Id"))
    except (AttributeError, zmq.ZMQError):
        return ""


def _in_brackets(host: str) -> str:
    """``host`` as a ZeroMQ TCP endpoint writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


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
        self._gate: AdmissionGate | None = None  # on TCP: bounds what peers make it hold
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None
        self._drain_scheduled = False
        self.address: str | None = None
        self._state = ServerState(config)
        self._replies = Replies(self._state, after_send=self._schedule_drain)
        self._work = WorkRunner(
            config.threads, f"kvstore-server{config.server_rank}", inline=config.inline_work
        )
        self._heard = self._state.heard  # (on the hot path: one dict store per request)
        self._keys = Keys(self._state, self._replies)
        self._replication = Replication(self._state, self._replies, self._context)
        self._rounds = Rounds(self._state, self._replies, self._work, self._keys, self._replication)
        self._replication.rounds = self._rounds
        self._keys.take_over = self._replication.take_over
        self._collectives = Collectives(self._state, self._replies, self._work)
        self._collectives.take_over = self._replication.take_over
        self._replication.barrier_moved = self._collectives.barrier_moved
        self._membership = Membership(self._state, self._replies, self._fail_waiting)
        self._membership.learn_peers = self._replication.learn_peers
        self._handlers: dict[Op, Callable[[bytes, int, Message], None]] = {
            Op.INIT: self._keys.on_init,
            Op.PUSH: self._rounds.on_push,
            Op.PUSHPULL: self._rounds.on_push,
            Op.PULL: self._rounds.on_pull,
            Op.BARRIER: self._collectives.on_barrier,
            Op.SET_OPTIMIZER: self._collectives.on_set_optimizer,
            Op.BYE: self._membership.on_bye,
            Op.SAVE: self._collectives.on_checkpoint,
            Op.LOAD: self._collectives.on_checkpoint,
            Op.PING: self._membership.on_ping,
        }
        self._server_handlers: dict[Op, Callable[[bytes, Message, str], None]] = {
            Op.REPLICATE: self._replication.on_replicate,
            Op.CATCH_UP: self._replication.on_catch_up,
            Op.STATE: self._replication.on_state,
            Op.TAKEN_OVER: self._replication.on_taken_over,
        }
        self._held_hellos: list[tuple[bytes, list[Any]]] = []
        self._rejoining: asyncio.Task[None] | None = None

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
                    self._context,
                    cfg.curve.peer_key,
                    f"server {cfg.server_rank}",
                    watch=sock,
                    # (the job's other servers, whose links forward rounds to this one)
                    server_key=auth.server_public_key(cfg.curve) if cfg.replicas > 1 else None,
                )
                self._zap.start()
                auth.secure_server(sock, cfg.curve)
            if cfg.bind is not None:
                sock.bind(cfg.bind)
                self.address = cfg.bind
            elif cfg.admission_gate and relay_addresses_work():
                # Peers reach the socket through the gate only (see kvstore.server.gate).
                sock.bind("tcp://127.0.0.1:0")
                frame_limit = sock.getsockopt(zmq.MAXMSGSIZE)
                assert isinstance(frame_limit, int)
                target = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
                self._gate = AdmissionGate(
                    GateLimits.for_server(
                        frame_limit if frame_limit >= 0 else None,
                        cfg.max_connections,
                        cfg.receive_buffer_bytes,
                    ),
                    target,
                    self._replies.warn,
                    self._zap.refuse_unencrypted if self._zap is not None else None,
                    self._message_ready,
                )
                if self._zap is not None:
                    self._zap.describe_address = self._gate.public_peer
                    self._zap.mismatches_reported = True
                port = await self._gate.start(cfg.host, cfg.port)
                self.address = worker_address(cfg.host, port)
            else:
                if cfg.admission_gate:
                    logger.warning(
                        "server %d cannot open connections from 127.64.0.0/10 on this host: it "
                        "serves without its admission gate, so the frames of one message are "
                        "not bounded (docs/operations.md, Limits)",
                        cfg.server_rank,
                    )
                if ":" in cfg.host:  # an IPv6 address (``::``: every interface)
                    sock.setsockopt(zmq.IPV6, 1)
                sock.bind(f"tcp://{_in_brackets(cfg.host)}:{cfg.port}")
                bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                self.address = worker_address(cfg.host, int(bound.rsplit(":", 1)[1]))
        except (zmq.ZMQError, OSError, ConfigError) as exc:
            sock.close(0)
            self._close_gate()
            self._close_metrics()
            self._stop_zap()
            if not isinstance(exc, zmq.ZMQError):
                raise
            raise OSError(
                f"server {cfg.server_rank} cannot bind {cfg.host}:{cfg.port}: {exc}"
            ) from exc
        self._socket = self._replies.socket = sock
        self._loop = asyncio.get_running_loop()
        fd = sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._fd = fd
        self._loop.add_reader(fd, self._drain)
        self._schedule_drain()  # messages may have arrived before the reader was added
        self._membership.start(self._loop)
        if cfg.replicas > 1 and cfg.peers is not None:
            # Started with the job's addresses: it may replace a lost server of a running job.
            self._state.catching_up = True
            self._rejoining = self._loop.create_task(self._rejoin())
        logger.info(
            "server %d/%d serving %d worker(s) on %s%s with %d thread(s)",
            cfg.server_rank,
            cfg.num_servers,
            cfg.num_workers,
            self.address,
            " (every interface)" if cfg.bind is None and cfg.host in WILDCARD_HOSTS else "",
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

    async def _rejoin(self) -> None:
        """Be caught up from the live replicas of this server's shards, if its job runs, then
        answer the workers that said hello meanwhile."""
        assert self.address is not None
        try:
            await self._replication.rejoin(self.address)
        except Exception:
            logger.exception("server %d could not be caught up", self.config.server_rank)
        finally:
            self._state.catching_up = False
        held, self._held_hellos = self._held_hellos, []
        for identity, frames in held:
            self._handle(identity, frames)

    async def stop(self) -> None:
        """Stop serving, close the socket and the thread pool."""
        self._membership.stop()
        if self._rejoining is not None:
            self._rejoining.cancel()
        self._replication.close()
        if self._fd is not None and self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._fd = None
        await self._work.cancel()
        self._close_gate()
        if self._socket is not None:
            self._socket.close(0)
            self._socket = self._replies.socket = None
        self._stop_zap()
        self._work.shutdown()
        if self._own_context:
            self._context.term()
        self._replies.close()
        self._close_metrics()

    def _close_gate(self) -> None:
        if self._gate is not None:
            self._gate.close()
            self._gate = None

    def _message_ready(self) -> bool:
        """Whether the socket holds a message the loop has not taken yet (for the gate); if
        so, a drain is scheduled (reading ``EVENTS`` can consume the edge its descriptor would
        have signalled)."""
        sock = self._socket
        if sock is None or sock.closed:
            return False
        try:
            events = sock.getsockopt(zmq.EVENTS)
            ready = isinstance(events, int) and bool(events & zmq.POLLIN)
        except zmq.ZMQError:
            return False
        if ready:
            self._schedule_drain()
        return ready

    @property
    def gate(self) -> AdmissionGate | None:
        """The admission gate while the server listens on TCP (None on ``inproc://`` or
        ``ipc://``, and where the host cannot give it relay addresses)."""
        return self._gate

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
        gate = self._gate
        for _ in range(DRAIN_BATCH):
            try:
                frames = wire.recv_frames(sock)
            except zmq.Again:
                if gate is not None:
                    gate.idle()
                return
            except zmq.ZMQError:
                return  # closed under us during shutdown
            if len(frames) < 2:
                continue  # a routing id alone: nothing to answer
            if gate is not None:  # the gate may let more of this connection in now
                nbytes = sum(map(len, frames)) - len(frames[0])  # (a Frame's len is its size)
                gate.consumed(frames[1].get("Peer-Address"), nbytes, len(frames) - 1)
            identity = frames[0].bytes
            try:
                self._handle(identity, frames[1:])
            except Exception:  # the loop must survive anything a client sends
                logger.exception("unexpected error handling a message from %s", peer(identity))
        self._schedule_drain()

    # dispatch --------------------------------------------------------------------------------

    def _handle(self, identity: bytes, frames: list[Any]) -> None:
        """Decode a request, check its session and hand it to its op's handler; a refusal
        becomes an ERROR reply."""
        try:
            msg = wire.decode(frames)
        except ProtocolError as exc:
            if self._state.metrics is not None:
                self._state.metrics.received(None, frames_nbytes(frames))
            self._replies.warn(logger, identity, "bad message from %s: %s", identity, exc)
            self._replies.error(
                identity, wire.peek_request_id(frames), None, ErrorCode.BAD_MESSAGE, str(exc)
            )
            return
        if self._state.metrics is not None:
            self._state.metrics.received(msg.op, frames_nbytes(frames))
        try:
            if msg.op is Op.HELLO:
                if self._state.catching_up:  # answered once this server has its state
                    self._held_hellos.append((identity, frames))
                    return
                self._membership.on_hello(identity, msg)
                return
            if msg.op in self._server_handlers:  # from another server: no worker session
                self._server_handlers[msg.op](identity, msg, _user_id(frames[0]))
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
            self._replies.warn(
                logger,
                identity,
                "refused %s (id %s) from %s: %s",
                msg.op.name,
                msg.rid,
                identity,
                exc,
            )
            self._replies.error(identity, msg.rid, msg.op, exc.code, str(exc), exc.lost_rank)
        except (CodecError, OptimizerError) as exc:
            code = ErrorCode.CODEC if isinstance(exc, CodecError) else ErrorCode.OPTIMIZER
            self._replies.warn(
                logger, identity, "refused %s from %s: %s", msg.op.name, identity, exc
            )
            self._replies.error(identity, msg.rid, msg.op, code, str(exc))
        except Exception as exc:
            self._replies.warn(
                logger,
                identity,
                "internal error on %s from %s",
                msg.op.name,
                identity,
                level=logging.ERROR,
                exc_info=True,
            )
            self._replies.error(
                identity, msg.rid, msg.op, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
            )

    # lost workers ------------------------------------------------------------------------------

    def _fail_waiting(self, rank: int) -> None:
        """Fail the requests that wait on the lost worker ``rank`` (see
        :mod:`kvstore.server.membership`)."""
        self._collectives.worker_lost(rank)
        for chunk in self._state.job.chunks.values():
            self._keys.worker_lost(chunk, rank)
            self._rounds.worker_lost(chunk, rank)


__all__ = ["ShardServer"]
