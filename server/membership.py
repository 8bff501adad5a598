"""Membership and liveness: who belongs to the job a shard server serves, and who was lost.

A worker opens two connections to each server (its data and control lanes, see
:data:`kvstore.wire.LANE_DATA`), and says HELLO on each: the server checks that the worker sees
the same cluster (worker and server counts, this server's rank, the message limit) and mode as
the job, and that no other worker holds its rank, then opens a session for the connection.
Requests from a connection without a session are refused. BYE closes a session; when every
worker of a job has said goodbye, the server forgets the job (keys, optimizer, mode) and serves
the next one. PING is answered, and counts as a sign of life like every other message.

Lost workers: with a heartbeat timeout (``KVSTORE_HEARTBEAT_TIMEOUT``) the server notes when it
last heard from each rank (any message counts; workers ping when they have nothing else to say)
and, every fraction of the timeout, declares the silent ones lost. A worker that sent nothing
(no request, no PING) for ``config.heartbeat_timeout`` seconds is declared lost: its sessions
are released, so that a replacement with its rank can say HELLO and rejoin the job, and every
request that waits on it fails with WORKER_LOST naming it, at once and until a replacement
rejoins: barriers, set_optimizer, inits waiting for rank 0's value, and in dist_sync the pushes
and pulls of every chunk whose round lacks its push. Those pushes stay in their round (their sum
is not undone), so the replacement's first push of the chunk completes it; a lost worker's push
that is in a round stays there, and its pushes not yet in one are dropped. Nothing waits on
other workers in dist_async but the collectives. Failing what waits is the business of the parts
that keep it (:mod:`kvstore.server.collectives`, :mod:`kvstore.server.rounds`); this module
releases the sessions and tells them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import NoReturn, cast

from kvstore import wire
from kvstore.errors import ErrorCode
from kvstore.server.errors import RequestError
from kvstore.server.job import LANES, ServerState
from kvstore.server.replies import Replies, peer
from kvstore.topology import max_payload_bytes
from kvstore.wire import HelloFields, Message, Op, ReplyFields

logger = logging.getLogger(__name__)

MAX_RELEASED = 1024
"""Sessions of lost workers remembered (to tell one that wakes up why it is not served)."""


class Membership:
    """Sessions, heartbeats and lost workers of the job.

    Args:
        state: the server's shared state.
        replies: the server's reply sender.
        fail_waiting: called with a lost rank once its sessions are released (unless that left
            the job without workers, which forgets it): fails every request that waits on it.
    """

    def __init__(
        self, state: ServerState, replies: Replies, fail_waiting: Callable[[int], None]
    ) -> None:
        self._state = state
        self._replies = replies
        self._fail_waiting = fail_waiting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beat_timer: asyncio.TimerHandle | None = None
        # The sessions released because their worker was lost (identity -> rank), newest last,
        # so that a stalled worker that wakes up is told why it is no longer served.
        self._released: dict[bytes, int] = {}
        self.learn_peers: Callable[[list[str], int], None] = lambda servers, rank: None
        """Told the job's server addresses a worker's HELLO lists (replication's
        :meth:`~kvstore.server.replication.Replication.learn_peers`)."""

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start checking for silent workers (with a heartbeat timeout)."""
        self._loop = loop
        if self._state.liveness is not None:
            self._beat_timer = loop.call_later(self._state.liveness.period, self._check_workers)

    def stop(self) -> None:
        """Stop checking for silent workers."""
        if self._beat_timer is not None:
            self._beat_timer.cancel()
            self._beat_timer = None

    # sessions ---------------------------------------------------------------------------------

    def on_hello(self, identity: bytes, msg: Message[HelloFields]) -> None:
        """Open a session for the connection, if the worker fits the cluster and the job."""
        cfg, job = self._state.config, self._state.job
        hello = msg.body
        rank, mode = hello.rank, hello.mode
        if hello.num_workers != cfg.num_workers:
            raise RequestError(
                ErrorCode.CLUSTER_MISMATCH,
                f"server {cfg.server_rank} serves {cfg.num_workers} worker(s) "
                f"(--num-workers {cfg.num_workers}) but this worker says there are "
                f"{hello.num_workers} (KVSTORE_NUM_WORKERS)",
            )
        if hello.num_servers != cfg.num_servers:
            raise RequestError(
                ErrorCode.CLUSTER_MISMATCH,
                f"the worker lists {hello.num_servers} server(s) (KVSTORE_SERVERS) but server "
                f"{cfg.server_rank} was started with --num-servers {cfg.num_servers}",
            )
        if hello.server_rank != cfg.server_rank:
            raise RequestError(
                ErrorCode.WRONG_SERVER,
                f"the worker lists this address as server {hello.server_rank} but it is server "
                f"{cfg.server_rank}: KVSTORE_SERVERS must list the servers in rank order",
            )
        self._check_partition(hello.partition_bytes)
        if rank >= cfg.num_workers:
            raise RequestError(
                ErrorCode.CLUSTER_MISMATCH, f"rank {rank} is out of range 0..{cfg.num_workers - 1}"
            )
        if mode == "local" and cfg.num_workers != 1:
            raise RequestError(
                ErrorCode.MODE_MISMATCH, "the local mode needs a server for exactly one worker"
            )
        per_push = hello.pushers_per_host or 1
        if cfg.num_workers % per_push:
            raise RequestError(
                ErrorCode.CLUSTER_MISMATCH,
                f"worker rank {rank} says its host's {per_push} workers share each push, but "
                f"{cfg.num_workers} workers do not make whole hosts of {per_push}",
            )
        if job.workers_per_push is not None and per_push != job.workers_per_push:
            raise RequestError(
                ErrorCode.CLUSTER_MISMATCH,
                f"worker rank {rank} says its host's {per_push} worker(s) share each push but "
                f"the job's other workers said {job.workers_per_push}: every host must run the "
                f"same number of workers (KVSTORE_LOCAL_SIZE), and KVSTORE_HIERARCHY must be "
                f"the same on every worker",
            )
        if (hello.replicas or 1) != cfg.replicas:
            raise RequestError(
                ErrorCode.CLUSTER_MISMATCH,
                f"worker rank {rank} keeps each shard on {hello.replicas or 1} server(s) "
                f"(KVSTORE_REPLICAS) but server {cfg.server_rank} was started with "
                f"KVSTORE_REPLICAS={cfg.replicas}: set it equal on servers and workers",
            )
        if hello.servers is not None:
            self.learn_peers(hello.servers, rank)

        if job.mode is not None and mode != job.mode:
            ranks = sorted({r for r, _ in job.ranks})
            raise RequestError(
                ErrorCode.MODE_MISMATCH,
                f"worker rank {rank} created a {mode!r} store but rank(s) {ranks} created "
                f"{job.mode!r}: every worker of a job must use the same mode",
            )
        lane = hello.lane
        holder = job.ranks.get((rank, lane))
        if holder is not None and holder != identity:
            released = (
                f"; if that worker died, its rank is released after "
                f"{cfg.heartbeat_timeout:g} s without a message from it (KVSTORE_HEARTBEAT_TIMEOUT)"
                if self._state.liveness is not None
                else ""
            )
            raise RequestError(
                ErrorCode.DUPLICATE_RANK,
                f"rank {rank} is already connected from another worker ({peer(holder)}); "
                f"every worker needs its own KVSTORE_RANK{released}",
            )
        job.mode = mode
        job.workers_per_push = per_push
        job.sessions[identity] = rank
        job.lanes[identity] = lane
        job.ranks[(rank, lane)] = identity
        if self._state.heard is not None:
            self._state.heard[rank] = self._state.heard_at
        if job.lost.pop(rank, None) is not None:
            job.rejoined.add(rank)
            logger.warning("worker rank %d rejoined the job (%s)", rank, peer(identity))
        logger.debug("worker rank %d connected (%s, %s)", rank, peer(identity), mode)
        answer = ReplyFields(server_rank=cfg.server_rank)
        if cfg.replicas > 1:
            answer.incarnation = self._state.incarnation
        if self._state.liveness is not None:  # (the worker pings often enough for it)
            answer.heartbeat_ms = round(cfg.heartbeat_timeout * 1000)
        self._replies.send(identity, wire.reply(msg.rid, answer), Op.HELLO)

    def _check_partition(self, partition_bytes: int | None) -> None:
        """Refuse a worker whose largest message could exceed this server's limit (ZeroMQ
        would drop its connection mid-job, before the server could say why)."""
        limit = self._state.max_message
        if limit is None or partition_bytes is None:
            return
        largest = max_payload_bytes(partition_bytes)
        if largest > limit:
            server_rank = self._state.config.server_rank
            raise RequestError(
                ErrorCode.MESSAGE_LIMIT,
                f"this worker's chunks take up to {largest} bytes (KVSTORE_PARTITION_BYTES="
                f"{partition_bytes}) but server {server_rank} accepts messages of at "
                f"most {limit} bytes: give the servers the workers' KVSTORE_PARTITION_BYTES "
                f"(kvstore-launch passes it on), or raise KVSTORE_MAX_MESSAGE_BYTES "
                f"(kvstore-server --max-message-bytes)",
            )

    def on_bye(self, identity: bytes, rank: int, msg: Message) -> None:
        """Close the connection's session; forget the job when it was the last."""
        job = self._state.job
        job.sessions.pop(identity, None)
        job.ranks.pop((rank, job.lanes.pop(identity, 0)), None)
        if self._state.heard is not None and not any((rank, ln) in job.ranks for ln in LANES):
            self._state.heard.pop(rank, None)  # it left: nothing to watch
        self._replies.send(identity, wire.reply(msg.rid), Op.BYE)
        logger.debug("worker rank %d left", rank)
        if not job.sessions:
            logger.debug("all workers left; the server is ready for a new job")
            self._state.reset_job()

    def on_ping(self, identity: bytes, rank: int, msg: Message) -> None:
        """Answer a worker's heartbeat."""
        # Being handled was the point (the rank's last-heard time is now); the reply tells the
        # worker that this server lives.
        self._replies.send(identity, wire.reply(msg.rid), Op.PING)

    # lost workers ------------------------------------------------------------------------------

    def _check_workers(self) -> None:
        """Declare lost the ranks that have been silent for too long (a timer callback)."""
        liveness = self._state.liveness
        assert liveness is not None and self._loop is not None
        self._beat_timer = self._loop.call_later(liveness.period, self._check_workers)
        timeout = self._state.config.heartbeat_timeout
        now = time.monotonic()
        for peer_rank in liveness.overdue(now):
            if peer_rank not in liveness.heard:  # (the job was forgotten meanwhile)
                continue
            silence = liveness.silence(peer_rank, now)
            self.declare_lost(
                cast(int, peer_rank),  # (the server's liveness watches worker ranks)
                f"nothing heard from it for {silence:.1f} s (KVSTORE_HEARTBEAT_TIMEOUT="
                f"{timeout:g}): it died, stalled or lost its network",
            )

    def refuse_stranger(self, identity: bytes, msg: Message) -> NoReturn:
        """Raise the error for a request from a connection without a session."""
        rank = self._released.get(identity)
        if rank is not None:
            cfg = self._state.config
            raise RequestError(
                ErrorCode.WORKER_LOST,
                f"worker rank {rank} (this worker) was declared lost by server "
                f"{cfg.server_rank} after it sent nothing for "
                f"{cfg.heartbeat_timeout:g} s (KVSTORE_HEARTBEAT_TIMEOUT), and its "
                f"rank was released; restart the worker to rejoin the job",
                rank,
            )
        raise RequestError(
            ErrorCode.NOT_CONNECTED,
            f"{msg.op.name} from a worker that has not said HELLO to this server",
        )

    def declare_lost(self, rank: int, reason: str) -> None:
        """Release ``rank``'s sessions for a replacement and fail what waits on it (or forget
        the job if no worker is left)."""
        job = self._state.job
        identities = [identity for identity, r in job.sessions.items() if r == rank]
        for identity in identities:
            del job.sessions[identity]
            job.lanes.pop(identity, None)
            self._released[identity] = rank
        while len(self._released) > MAX_RELEASED:
            del self._released[next(iter(self._released))]
        for lane in LANES:
            job.ranks.pop((rank, lane), None)
        if self._state.heard is not None:
            self._state.heard.pop(rank, None)
        job.rejoined.discard(rank)
        job.lost[rank] = reason
        logger.error("worker rank %d is lost: %s", rank, reason)
        if not job.sessions:
            logger.warning(
                "no worker of the job is left; the server forgets the job and is ready for a "
                "new one"
            )
            self._state.reset_job()
            return
        self._fail_waiting(rank)


__all__ = ["MAX_RELEASED", "Membership"]
