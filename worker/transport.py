"""The worker's transport ("van"): two DEALER sockets per server, driven by one I/O thread.

Callers (any thread) :meth:`Transport.submit` a request and get a
:class:`~kvstore.worker.request.Request` to wait on.
The I/O thread owns the sockets: it sends queued requests, receives replies, validates them with
:func:`kvstore.wire.decode` and completes the matching request by id.

Two lanes per server (:mod:`kvstore.worker.connections`): pushes and inits go on the *data*
connection, pulls and the other small requests on the *control* connection.

Flow control: at most a window of data-lane payload, over all servers, is handed to ZeroMQ and
not yet written to a connection (the sends' tickets say when it was); the rest waits in
the transport's own queues (:class:`~kvstore.worker.send_queue.SendQueue`). The next message is
the best across all servers' data lanes: higher ``priority`` first, small messages before bulk
ones, then submission order. Because the window is shared, the order in which the client
submits chunks is the order they go out (the client interleaves a key's slices so that all
servers receive at the same pace), give or take the window: TCP shares a worker's uplink among
its connections unevenly, and what one connection gets ahead by is what another server's
rounds wait for at the end of a step. So with ``queue_seconds`` the window is that much of the
measured send rate (:class:`~kvstore.worker.send_window.SendWindow`), and the kernel
keeps at most :data:`~kvstore.worker.connections.NOTSENT_LOWAT` unsent bytes per data
connection to another host (``TCP_NOTSENT_LOWAT``), so "written to a connection" means close to
on the wire.

A server's data lane also holds back bulk pushes while ``lead_chunks`` of its pushes are
unanswered (:mod:`kvstore.worker.push_lead`), so a worker whose TCP flows are faster does not
run ahead of the others that a synchronous round waits for. Control-lane messages are never
held back.

Payload buffers are sent without copies (:class:`~kvstore.zerocopy.ZeroCopySender`). The caller
keeps them alive and unchanged until the request completes (the encoders do: a chunk is not
re-encoded before its previous push was answered).

A TCP server that closes its connection (it died, or was stopped) fails every request pending on
it with :class:`~kvstore.errors.ServerLostError` (a ``ConnectionLostError``), and later requests
to it fail at once, so a dead server never leaves a worker hanging. So does a server that sent
nothing for the heartbeat timeout (:mod:`kvstore.worker.heartbeats`).

A value reply may also acknowledge earlier push requests of this worker (``ak``): they
complete with it, without a reply of their own.

With ``metrics`` (:class:`~kvstore.metrics.WorkerMetrics`) the I/O thread counts every request
it hands to ZeroMQ, every reply and every ERROR reply; :meth:`Transport.queue_depths` is read
when the metrics are scraped.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import zmq

from kvstore import wire
from kvstore.config import CurveKeys
from kvstore.errors import (
    AuthenticationError,
    ConnectionLostError,
    ErrorCode,
    KVStoreError,
    ProtocolError,
    ServerLostError,
    error_from_code,
)
from kvstore.metrics import WorkerMetrics, frames_nbytes
from kvstore.topology import replica_servers
from kvstore.wire import LANE_CONTROL, LANE_DATA, Message, Op, PingFields, ReplyFields
from kvstore.worker.connections import Connections, head_order
from kvstore.worker.heartbeats import Heartbeats
from kvstore.worker.push_lead import LEAD_CHUNKS, LEAD_OPS
from kvstore.worker.request import Request
from kvstore.worker.send_window import SendWindow
from kvstore.zerocopy import ZeroCopySender

EXPRESS_BYTES = 64 * 1024
"""Messages with at most this much payload skip ahead of bulk ones and are not windowed."""

DEFAULT_WINDOW_BYTES = 8 * 1024 * 1024

logger = logging.getLogger(__name__)

_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_socket_get = cast(Callable[[zmq.Socket, int], int], zmq.backend.Socket.get)
"""libzmq's getsockopt as pyzmq's backend has it: the ``zmq.Socket`` method of the same name
turns ZMQ_EVENTS into an enum, which costs half as much again as the option itself."""


_ACKNOWLEDGED = Message(op=Op.REPLY, rid=0, body=ReplyFields(), fields={}, payloads=[])
"""What a push request holds when a later pull's reply acknowledged it (``ak``)."""

_DATA_OPS = frozenset({Op.PUSH, Op.PUSHPULL, Op.INIT})

_ROUTED_OPS = frozenset({Op.PUSH, Op.PUSHPULL, Op.PULL, Op.INIT, Op.BARRIER})
"""Requests for a shard, which a lost server's next live replica answers (with replication)."""

_ANSWERED_BY_REPLICAS = frozenset({Op.SET_OPTIMIZER, Op.BYE, Op.PING})
"""Requests every server gets for itself: a lost one's are done once its shards went on with
their replicas, which had their own."""

PROBE_SECONDS = 1.0
"""With replication, how often a worker greets the address of each server it lost, to find
its replacement."""

IDLE_WAIT_MS = 1000
"""How long the I/O thread sleeps when nothing is due; input and submits wake it at once."""

LEAD_PATIENCE_S = 0.5
"""How long a lane waits for an answer before its lead limit lapses
(:meth:`~kvstore.worker.push_lead.PushLead.blocked`)."""


class Transport:
    """Sockets to all servers and the I/O thread that drives them.

    Args:
        servers: server addresses in rank order.
        identity: this worker's routing id (unique per worker process); each lane's socket
            uses it with a suffix.
        context: a ZeroMQ context to use (``local`` mode shares one with its in-process
            server); by default the transport makes and terminates its own.
        window_bytes: data-lane payload bytes, over all servers, that may be handed to ZeroMQ
            and not yet written to a connection.
        lead_chunks: bulk pushes per server sent and not yet answered, at most (0: no limit).
        tos: IP TOS byte of the packets this worker sends (0: unmarked).
        queue_seconds: size the window to this much of the send rate measured while it was
            full, and limit the kernel's unsent bytes per data connection to another host
            (0: a fixed ``window_bytes``, kernel buffers as the system sets them).
        metrics: where to count requests, replies and errors (None: nowhere).
        heartbeat_timeout: a server that sent nothing for this many seconds is lost (its
            requests fail with :class:`~kvstore.errors.ServerLostError`); 0: never. Every
            server that took this worker is pinged every
            :func:`~kvstore.config.heartbeat_interval` of this timeout or of the server's own
            (which its HELLO reply gives), whichever is shorter.
        curve: the job's CURVE credentials: every connection to a ``tcp://`` or ``ipc://``
            server is then authenticated and encrypted (:mod:`kvstore.auth`), and a handshake
            that fails (wrong keys, or keys on one side only) fails the requests to that server
            with :class:`~kvstore.errors.AuthenticationError`. None: plain connections.
        native_sends: send large buffers through the compiled free function of
            :mod:`kvstore.zerocopy`; False: pyzmq's zero-copy sends.
    """

    def __init__(
        self,
        servers: Sequence[str],
        identity: bytes,
        context: zmq.Context | None = None,
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        lead_chunks: int = LEAD_CHUNKS,
        tos: int = 0,
        queue_seconds: float = 0.0,
        metrics: WorkerMetrics | None = None,
        curve: CurveKeys | None = None,
        heartbeat_timeout: float = 0.0,
        native_sends: bool = True,
        replicas: int = 1,
    ) -> None:
        self.servers = tuple(servers)
        self._replicas = replicas
        # With replication: which server answers for each shard (its primary, until a
        # failover moves it to the next live replica); the HELLO of each lane, by which a lost
        # server's replacement is greeted (set by the handshake); the greetings in flight.
        self._route: dict[int, int] = {}
        self.hello: Callable[[int, int], wire.HelloFields] | None = None
        self._greetings: dict[int, list[Request]] = {}
        self._incarnations: dict[int, int] = {}
        self._next_probe = 0.0
        self._metrics = metrics
        self._own_context = context is None
        self._context = context if context is not None else zmq.Context()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._window = SendWindow(window_bytes, queue_seconds)
        self._window_full = False  # the window held a message back since the last flush
        self._lead = max(0, lead_chunks)  # 0: no lead limit, and no pushes tracked for one
        self._in_flight_bytes = 0  # data-lane payload handed to ZeroMQ, not yet written
        self._seq = itertools.count()  # one submission order across all queues
        self._pending: dict[int, Request] = {}
        self._lost: dict[int, str] = {}
        self._heartbeats = Heartbeats(
            heartbeat_timeout, self.servers, self._lost, self._send_ping, self._server_lost
        )
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        # (used by the I/O thread only; KVSTORE_NATIVE_SENDS=0: pyzmq's zero-copy sends)
        self._sender = ZeroCopySender(native=None if native_sends else False)
        self._sent_on: set[zmq.Socket] = set()  # sockets the I/O thread sent on since it read them
        self._connections = Connections(
            self._context,
            self.servers,
            identity,
            tos=tos,
            curve=curve,
            limit_unsent=bool(queue_seconds),
            lost=self._lost,
            server_lost=self._server_lost,
        )
        self._lanes = self._connections.pairs
        self._by_socket = self._connections.by_socket
        self._all_lanes = self._connections.all
        self._thread = threading.Thread(target=self._run, name="kvstore-io", daemon=True)
        self._thread.start()

    # caller side -------------------------------------------------------------------------------

    def submit(
        self,
        server: int,
        body: wire.Fields,
        payloads: Sequence[Any] = (),
        *,
        priority: int = 0,
        order_key: Any = None,
        what: str = "",
        on_done: Callable[[Request], None] | None = None,
        lane: int | None = None,
        routed: bool = True,
    ) -> Request:
        """Queue a request to ``server`` and return it; thread-safe, never blocks on I/O.

        Args:
            server: server rank.
            body: the request's fields; its type is the operation (e.g.
                :class:`~kvstore.wire.PullFields`: a PULL).
            payloads: buffers to send without copying.
            priority: higher is sent earlier.
            order_key: requests with the same key on one lane are sent in submission order
                whatever their priorities.
            what: description for error messages.
            on_done: called (on the I/O thread, or at once if the request fails early) when
                the request completes, before anyone waiting on it wakes.
            lane: ``LANE_DATA`` or ``LANE_CONTROL``; by default pushes and inits take the data
                lane and everything else the control lane.
            routed: with replication, a request for ``server``'s shard that goes to its live
                replica once ``server`` is lost (False: for this server itself, such as an
                INIT of a backup it holds, which then fails).
        """
        rid = next(self._ids)
        op = wire.OP_OF[type(body)]
        frames = wire.request(rid, body, payloads)
        payload_bytes = sum(wire.buffer_nbytes(p) for p in payloads)
        nbytes = payload_bytes + wire.buffer_nbytes(frames[0])
        request = Request(rid, server, op, what or op.name, nbytes)
        request._done_cb = on_done
        if lane is None:
            lane = LANE_DATA if op in _DATA_OPS else LANE_CONTROL
        express = payload_bytes <= EXPRESS_BYTES
        bulk = 0 if express else payload_bytes
        if self._replicas > 1 and routed:
            request.resend = (frames, lane, priority, order_key, express, bulk)
        done: Message | None = None
        with self._lock:
            if self._closing:
                raise KVStoreError("the store is closed")
            if self._route and routed and op in _ROUTED_OPS:
                server = request.server = self._route.get(server, server)
            lost = self._lost.get(server)
            if lost is not None and self._replicas > 1 and op in _ANSWERED_BY_REPLICAS:
                done, lost = _ACKNOWLEDGED, None  # (the shard's live replica has it itself)
            elif lost is None:
                self._pending[rid] = request
                self._queue(request, frames, lane, priority, order_key, express, bulk)
        if done is not None:
            request._complete(done, None)
        elif lost is not None:
            request._complete(None, self._lost_error(server, request.what, lost))
        return request

    def _queue(
        self,
        request: Request,
        frames: list[Any],
        lane: int,
        priority: int,
        order_key: Any,
        express: bool,
        bulk: int,
    ) -> None:
        """Queue ``request`` for its server's ``lane`` (the caller holds the lock)."""
        self._lanes[request.server][lane].queue.push(
            (frames, request, bulk), priority, order_key, express=express, seq=next(self._seq)
        )
        self._wake()

    def queue_depths(self) -> dict[str, int]:
        """Requests waiting, by :data:`kvstore.metrics.WORKER_QUEUES` name (any thread)."""
        with self._lock:
            return {
                "outstanding": len(self._pending),
                "unsent": sum(len(lane.queue) for lane in self._all_lanes),
            }

    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass

    def close(self) -> None:
        """Stop the I/O thread and close the sockets; pending requests fail."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake()
        self._thread.join()
        self._connections.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._own_context:
            self._context.term()
        self._sender.close()
        error = KVStoreError("the store was closed before the reply arrived")
        for request in list(self._pending.values()):
            request._complete(None, error)
        self._pending.clear()

    # I/O thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        """The I/O thread: hand queued messages to ZeroMQ and take replies until closed.

        It sleeps in one ``poll`` system call on the sockets' ZMQ_FD descriptors and the wake-up
        pipe, not in ``zmq_poll``, which asks every socket for its ZMQ_EVENTS before and after
        sleeping (each ask a ``getpid`` and a ``poll`` system call inside libzmq). With two
        sockets and two monitors per server that is 16 sockets for 4 servers, so a ``zmq_poll``
        that finds nothing costs several times one ``poll`` on their descriptors.

        A ZMQ_FD only says that the socket's command mailbox got something, and any operation
        on the socket may take that signal without its input being read (edge-triggered). So a
        socket is looked at when its descriptor fired and after this thread sent on it, and is
        then read until its ZMQ_EVENTS say it has no input; only then may the thread sleep.
        """
        poller = select.poll()
        by_fd: dict[int, zmq.Socket] = {}
        monitors = self._connections.monitors
        heartbeats = self._heartbeats
        for sock in (*self._by_socket, *monitors):
            fd = cast(int, sock.getsockopt(zmq.FD))
            by_fd[fd] = sock
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        sent_on = self._sent_on
        to_read: set[zmq.Socket] = set(by_fd.values())  # what came before the thread started
        try:
            while True:
                for sock in to_read:
                    if sock in monitors:
                        self._connections.on_monitor(sock)
                    else:
                        self._receive_all(sock)
                to_read.clear()
                wait_ms = self._flush()
                if heartbeats.every is not None:
                    wait_ms = min(wait_ms, heartbeats.beat())
                if self._replicas > 1 and self._lost:
                    wait_ms = min(wait_ms, self._greet_replacements())
                with self._lock:
                    if self._closing:
                        return
                # A send may have taken a socket's signal: read its input before sleeping, and
                # flush again at once if replies came (they may let held-back messages go).
                while sent_on:
                    if self._receive_all(sent_on.pop()):
                        wait_ms = 0
                for fd, _ in poller.poll(wait_ms):
                    if fd != self._wake_r:
                        to_read.add(by_fd[fd])
                        continue
                    # Drain first, then clear the flag: clearing first could swallow the byte of
                    # a submit made in between and leave the flag set with an empty pipe.
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    with self._lock:
                        self._wake_pending = False
        except Exception:
            logger.exception("the kvstore I/O thread failed")
            self._fail_all(KVStoreError("the kvstore I/O thread failed; see the log"))

    def _flush(self) -> int:
        """Hand queued messages to ZeroMQ within the window and lead limits.

        Returns how long (ms) the I/O thread may sleep when no socket has anything: while the
        window holds a message back, the window's refill wait (send tickets have no file
        descriptor to wait on; :meth:`SendWindow.refill_wait_seconds`), until the lead limit
        lapses while only that holds one back (answers arrive on sockets), else
        :data:`IDLE_WAIT_MS`.
        """
        written = 0
        lanes = self._all_lanes
        for lane in lanes:
            while lane.in_flight and lane.in_flight[0][0].done:  # sent in order per socket
                written += lane.in_flight.popleft()[1]
        self._in_flight_bytes -= written
        now = time.monotonic()
        self._window.observe(written, now, self._window_full)
        self._window_full = False
        while True:
            with self._lock:
                ready = [lane for lane in lanes if lane.queue.heads]
                if not ready:
                    return IDLE_WAIT_MS
                # The best message goes first; one that must wait lets the next best go.
                ready.sort(key=head_order)
                wait_ms = IDLE_WAIT_MS
                window_full = False
                chosen = None
                for lane in ready:
                    if window_full and lane.windowed:
                        continue
                    frames, request, bulk = lane.queue.peek()
                    if not (lane.windowed and bulk):
                        chosen = lane
                        break
                    used = self._in_flight_bytes
                    if used and used + bulk > self._window.bytes:
                        # The window holds every data lane back; control messages may still go.
                        window_full = self._window_full = True
                        refill_ms = self._window.refill_wait_seconds() * 1000
                        wait_ms = min(wait_ms, max(1, int(refill_ms)))
                    elif self._lead and lane.lead.blocked(self._lead, now, LEAD_PATIENCE_S):
                        lapse = LEAD_PATIENCE_S - (now - lane.lead.last_answer)
                        wait_ms = min(wait_ms, max(1, int(lapse * 1000) + 1))
                    else:
                        chosen = lane
                        break
                if chosen is None:
                    return wait_ms
                lane = chosen
                lane.queue.pop()
                if request.server != lane.server:
                    continue  # sent to another replica since it was queued (a failover)
                lost = self._lost.get(lane.server)
            if lost is not None:
                self._fail(request, self._lost_error(lane.server, request.what, lost))
                continue
            track = lane.windowed and bulk > 0
            self._sent_on.add(lane.sock)
            try:
                ticket = self._sender.send_multipart(lane.sock, frames, track=track)
            except zmq.ZMQError as exc:
                self._fail(request, ConnectionLostError(f"{request.what}: send failed: {exc}"))
                continue
            if self._metrics is not None:
                self._metrics.sent(request.op, request.nbytes)
            if track:
                lane.in_flight.append((ticket, bulk))
                self._in_flight_bytes += bulk
                # Only a lead limit reads (and prunes) the unanswered pushes: without one,
                # keeping them would keep every push of the job alive.
                if self._lead and request.op in LEAD_OPS:
                    lane.lead.sent(request, now)

    def _receive_all(self, sock: zmq.Socket) -> bool:
        """Take every reply waiting on ``sock``; returns whether there was any.

        Reads while the socket's ZMQ_EVENTS say it has input. Asking for them is cheaper than
        the failed receive that would end the loop otherwise (pyzmq raises ``zmq.Again``, whose
        constructor imports modules), and it processes the socket's pending commands, so its
        ZMQ_FD signals the next input.
        """
        received = False
        while _socket_get(sock, _EVENTS) & _POLLIN:
            self._on_reply(wire.recv_frames(sock), self._by_socket[sock].server)
            received = True
        heard = self._heartbeats.heard
        if received and heard is not None:  # a sign of life (heartbeats), once per batch
            server = self._by_socket[sock].server
            if server not in self._lost:  # (a lost server stays lost)
                heard[server] = time.monotonic()
        return received

    def _on_reply(self, frames: list[Any], sender: int) -> None:
        """Complete the request that the received message ``frames`` from server ``sender``
        answers."""
        metrics = self._metrics
        try:
            msg = wire.decode(frames)
        except ProtocolError as exc:
            if metrics is not None:
                metrics.received(None, frames_nbytes(frames))
            rid = wire.peek_request_id(frames)
            logger.error("malformed reply (request %d): %s", rid, exc)
            with self._lock:
                request = self._pending.pop(rid, None)
            if request is not None:
                request._complete(None, exc)
            return
        with self._lock:
            request = self._pending.pop(msg.rid, None)
            if request is not None and request.server != sender and msg.op is Op.ERROR:
                # The refusal of a server this request left (it failed over to the shard's
                # next replica, which answers it): a stopped server that resumed refuses what
                # the workers sent it before they left, with ``shard_moved``.
                self._pending[msg.rid] = request
                return
            acknowledged = self._take_acknowledged(msg) if msg.op is Op.REPLY else []
        for push in acknowledged:
            push._complete(_ACKNOWLEDGED, None)
        if metrics is not None:
            metrics.received(request.op if request is not None else None, frames_nbytes(frames))
            if msg.op is Op.ERROR:
                metrics.remote_error(msg.body.code)
        if request is None:
            logger.debug("reply to unknown request %d ignored", msg.rid)
            return
        if msg.op is Op.ERROR and msg.body.code == ErrorCode.SHARD_MOVED:
            # Another replica answers for the shard: this server was counted lost elsewhere.
            routed = request.resend is not None and request.op in _ROUTED_OPS
            if routed:
                with self._lock:
                    self._pending[request.rid] = request  # (moved with the server's others)
            reason = (
                f"server {request.server} ({self.servers[request.server]}) no longer answers "
                f"for its shard: {msg.body.message}"
            )
            self._server_lost(request.server, reason)
            if not routed:  # (a checkpoint call: its caller retries it on the replica)
                request._complete(None, self._lost_error(request.server, request.what, reason))
            return
        if msg.op is Op.ERROR:
            where = f"server {request.server} ({self.servers[request.server]})"
            failure = msg.body
            error = error_from_code(failure.code, failure.message, where, failure.lost_rank)
            request._complete(None, error)
            if request.op is Op.PING and self._heartbeats.ping_refused(request, error):
                self._fail_server(request.server, error)
        elif msg.op is Op.REPLY:
            if request.op is Op.HELLO:
                if not self._first_greeting(request, msg):
                    request._complete(None, KVStoreError("the lost process itself answered"))
                    return
                self._heartbeats.on_hello_reply(request.server, msg)
            request._complete(msg, None)
        else:
            request._complete(None, ProtocolError(f"unexpected {msg.op.name} as a reply"))

    def _take_acknowledged(self, msg: Message) -> list[Request]:
        """The pending push requests that the value reply ``msg`` also acknowledges (``ak``),
        taken out of the pending ones (the caller holds the lock and completes them): a pull's
        reply says which of this worker's pushes its value includes, so they need no reply of
        their own."""
        acknowledged: list[Request] = []
        for rid in msg.body.acks or ():
            push = self._pending.pop(rid, None)
            if push is not None:
                acknowledged.append(push)
        return acknowledged

    def _lost_error(self, server: int, what: str, reason: str) -> KVStoreError:
        """The error of a request ``what`` to a lost server (``reason``: why it is lost)."""
        if server in self._connections.refused:
            # The reason names the server, its address and what to do; the request (the
            # handshake of kvstore.create, or one queued behind it) adds nothing.
            return AuthenticationError(reason)
        return ServerLostError(f"{what}: {reason}", server, self.servers[server])

    def _server_lost(self, server: int, reason: str) -> None:
        """Declare ``server`` lost: fail every request pending on it, and later ones at once.

        With replication, the requests of each shard it answered for go to the shard's next
        live replica instead (a failover), and so do later ones; only a shard with no live
        replica left fails its requests."""
        answered: list[Request] = []
        with self._lock:
            first = server not in self._lost
            reason = self._lost.setdefault(server, reason)
            moved = self._fail_over(server) if first and self._replicas > 1 else {}
            failed = []
            for request in [r for r in self._pending.values() if r.server == server]:
                target = moved.get(request.shard) if request.op in _ROUTED_OPS else None
                if target is not None and request.resend is not None:
                    request.server = target
                    self._queue(request, *request.resend)
                    continue
                del self._pending[request.rid]
                if self._replicas > 1 and request.op in _ANSWERED_BY_REPLICAS:
                    answered.append(request)
                else:
                    failed.append(request)
            for lane in self._lanes[server]:  # (what it had on the way is gone with it)
                self._in_flight_bytes -= sum(nbytes for _, nbytes in lane.in_flight)
                lane.in_flight.clear()
        if first:
            logger.error("%s", reason)
            for shard, target in moved.items():
                logger.warning(
                    "server %d's shard goes on with its replica on server %d (%s)",
                    shard,
                    target,
                    self.servers[target],
                )
        self._heartbeats.forget(server)
        for request in answered:
            request._complete(_ACKNOWLEDGED, None)
        for request in failed:
            request._complete(None, self._lost_error(server, request.what, reason))

    def _fail_over(self, server: int) -> dict[int, int]:
        """Route every shard that the lost ``server`` answered for to the shard's next live
        replica (the caller holds the lock); returns shard -> its new server, for the shards
        that have one."""
        count = len(self.servers)
        moved = {}
        for shard in range(count):
            if self._route.get(shard, shard) != server:
                continue
            replicas = replica_servers(shard, count, self._replicas)
            start = replicas.index(server)
            after = [replicas[(start + i) % len(replicas)] for i in range(1, len(replicas))]
            target = next((r for r in after if r not in self._lost), None)
            if target is not None:
                self._route[shard] = moved[shard] = target
        return moved

    def _greet_replacements(self) -> int:
        """With replication: greet each lost server's address again every
        :data:`PROBE_SECONDS` (I/O thread); a replacement that answers both lanes' HELLO (it
        does once it caught up from a live replica) is a live replica again, one a later
        failover may go on with. Returns the milliseconds until the next greeting is due."""
        now = time.monotonic()
        if now < self._next_probe:
            return int((self._next_probe - now) * 1000) + 1
        self._next_probe = now + PROBE_SECONDS
        if self.hello is None:
            return int(PROBE_SECONDS * 1000)
        for server in list(self._lost):
            if server in self._greetings or server in self._connections.refused:
                continue
            greetings = []
            for lane in (LANE_DATA, LANE_CONTROL):
                rid = next(self._ids)
                frames = wire.request(rid, self.hello(server, lane))
                request = Request(rid, server, Op.HELLO, f"greeting server {server}", 0)
                with self._lock:
                    self._pending[rid] = request
                sock = self._lanes[server][lane].sock
                self._sent_on.add(sock)
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    with self._lock:
                        self._pending.pop(rid, None)
                    break
                greetings.append(request)
            else:
                self._greetings[server] = greetings
                for request in greetings:
                    request.add_done_callback(functools.partial(self._greeted, server))
                continue
            for request in greetings:
                self._fail(request, KVStoreError("not sent"))
        return int(PROBE_SECONDS * 1000)

    def _first_greeting(self, request: Request, msg: Message) -> bool:
        """Record the server process a HELLO reached (its ``incarnation``, with replication);
        False where a lost server's address answered with the lost process itself (it was
        stopped, not replaced: its state is stale)."""
        drawn = msg.body.incarnation
        if drawn is None:
            return True
        if request.server in self._lost:  # a greeting: the lost process, or a replacement
            return drawn != self._incarnations.get(request.server)
        self._incarnations[request.server] = drawn
        return True

    def _greeted(self, server: int, _: Request) -> None:
        """A greeting of a lost server completed: once both lanes' did, it is live again if
        both were taken (I/O thread), else it is greeted again later."""
        greetings = self._greetings.get(server, [])
        # (a request's callback runs before it counts as done: _completing says it is in)
        if not all(request._completing for request in greetings):
            return
        del self._greetings[server]
        if any(request._error is not None for request in greetings):
            return
        reply = greetings[0]._reply
        assert reply is not None
        self._incarnations[server] = reply.body.incarnation
        with self._lock:
            self._lost.pop(server, None)
        if self._heartbeats.heard is not None:
            self._heartbeats.heard[server] = time.monotonic()
        self._heartbeats.on_hello_reply(server, reply)  # (pinged from now on)
        logger.warning(
            "server %d (%s) is back: its replacement caught up from a live replica",
            server,
            self.servers[server],
        )

    def shards_by_server(self) -> dict[int, list[int]]:
        """Which server answers for which shards now (with replication, a lost server's go
        with their live replica; a shard whose replicas are all lost stays with its lost
        server). Servers answering for none are left out."""
        with self._lock:
            plan: dict[int, list[int]] = {}
            for shard in range(len(self.servers)):
                plan.setdefault(self._route.get(shard, shard), []).append(shard)
            return plan

    def live_servers(self) -> list[int]:
        """The servers not lost."""
        with self._lock:
            return [s for s in range(len(self.servers)) if s not in self._lost]

    def is_lost(self, server: int) -> bool:
        """Whether ``server`` was lost (and not replaced since)."""
        with self._lock:
            return server in self._lost

    def _send_ping(self, server: int) -> Request | None:
        """Send a PING to ``server`` on its control lane now (I/O thread): no queue, no window.

        Returns the request, or None where it could not go (the server is lost)."""
        rid = next(self._ids)
        frames = wire.request(rid, PingFields())
        request = Request(rid, server, Op.PING, f"heartbeat to server {server}", len(frames[0]))
        lane = self._lanes[server][LANE_CONTROL]
        with self._lock:
            if server in self._lost:
                return None
            self._pending[rid] = request
        self._sent_on.add(lane.sock)
        try:
            lane.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._fail(request, self._lost_error(server, request.what, f"send failed: {exc}"))
            return None
        return request

    def _fail_server(self, server: int, error: KVStoreError) -> None:
        """Fail every request pending on ``server`` with ``error`` (later ones are sent, and
        refused by the server itself)."""
        with self._lock:
            failed = [r for r in self._pending.values() if r.server == server]
            for other in failed:
                del self._pending[other.rid]
        for other in failed:
            other._complete(None, error)

    def _fail(self, request: Request, error: BaseException) -> None:
        with self._lock:
            self._pending.pop(request.rid, None)
        request._complete(None, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            failed = list(self._pending.values())
            self._pending.clear()
        for request in failed:
            request._complete(None, error)
