"""The state a shard server's parts share: the job it serves and what outlives a job.

A server serves one job at a time (:class:`Job`: its workers' sessions, keys, optimizer, mode,
the collectives being gathered and its lost workers). When every worker of the job has left, or
was lost, the server forgets the job and starts a fresh :class:`Job` for the next one
(:meth:`ServerState.reset_job`). Work that outlives a request (a round on the thread pool, a
checkpoint being written) holds on to the :class:`Job` it started in, so that a job forgotten
meanwhile never leaks into the next one.

Everything here runs on the server's event-loop thread, except where a docstring says otherwise.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from kvstore import wire
from kvstore.config import ServerConfig, heartbeat_interval
from kvstore.errors import ErrorCode
from kvstore.heartbeat import Liveness
from kvstore.metrics import ServerMetrics
from kvstore.optimizer_spec import OptimizerSpec
from kvstore.server.checkpointing import StagedLoad
from kvstore.server.chunk import ChunkState, PendingReply
from kvstore.server.errors import RequestError
from kvstore.server.optimizers import Optimizer
from kvstore.topology import max_payload_bytes
from kvstore.wire import Op


@dataclass
class CheckpointCall:
    """A collective SAVE or LOAD (phase) being gathered from the workers."""

    op: Op
    phase: int
    path: str
    replies: dict[int, PendingReply] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # ranks that could not do their part
    shards: set[int] | None = None  # (replication) the shards the workers say it answers for

    def describe(self) -> str:
        what = "save_checkpoint" if self.op is Op.SAVE else f"load_checkpoint (phase {self.phase})"
        return f"{what} of {self.path}"


@dataclass
class Job:
    """State of the job the server currently serves (reset when all workers left)."""

    mode: str | None = None
    # workers per host that share one push of each chunk (hierarchical aggregation, set by
    # the first hello): a dist_sync round is num_workers // workers_per_push pushes
    workers_per_push: int | None = None
    sessions: dict[bytes, int] = field(default_factory=dict)  # identity -> rank
    lanes: dict[bytes, int] = field(default_factory=dict)  # identity -> lane
    ranks: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (rank, lane) -> identity
    chunks: dict[tuple[Any, int], ChunkState] = field(default_factory=dict)
    optimizer: Optimizer | None = None
    proposals: dict[int, tuple[OptimizerSpec, PendingReply]] = field(default_factory=dict)
    barrier: dict[int, PendingReply] = field(default_factory=dict)
    # checkpoints: the collective SAVE/LOAD being gathered, whether one is being carried out,
    # and a load read and checked by its first phase, waiting for its commit
    checkpoint: CheckpointCall | None = None
    checkpoint_busy: bool = False
    staged_load: StagedLoad | None = None
    # Lost workers (see kvstore.server.membership): rank -> why; ranks taken back by a
    # replacement that has not called set_optimizer yet; requests already answered with
    # WORKER_LOST whose push stays in its round, as (identity, request id).
    lost: dict[int, str] = field(default_factory=dict)
    rejoined: set[int] = field(default_factory=set)
    failed: set[tuple[bytes, int]] = field(default_factory=set)
    # replication: the shards this server answers for (its own, and those of lost primaries
    # it took over); the others it holds are backups, changed only by their primary's rounds
    serving: set[int] = field(default_factory=set)
    # replication: shards this server answered for until another replica took them over
    # (a worker counted this server lost), with that replica; their requests are refused
    moved: dict[int, int] = field(default_factory=dict)

    def lost_message(self, rank: int, what: str) -> str:
        """Why ``what`` fails while worker ``rank`` is lost."""
        return (
            f"{what} needs worker rank {rank}, which was lost ({self.lost[rank]}); a "
            f"replacement started with KVSTORE_RANK={rank} can rejoin the job"
        )

    def require_all_ranks(self, what: str) -> None:
        """Raise WORKER_LOST if a rank is lost (for a request that needs every worker)."""
        lost = self.lost
        if lost:
            rank = min(lost)
            raise RequestError(ErrorCode.WORKER_LOST, self.lost_message(rank, what), rank)


LANES = (wire.LANE_DATA, wire.LANE_CONTROL)
"""The connections each worker opens to each server (one session each)."""


class ServerState:
    """What the parts of one :class:`~kvstore.server.ShardServer` share.

    Attributes:
        config: the server's settings.
        job: the job being served; replaced (never cleared in place) when it is forgotten.
        max_message: the largest frame accepted (``ZMQ_MAXMSGSIZE``); None in-process, where
            no stranger can send and libzmq would not check it anyway.
        metrics: the Prometheus metrics while they are served (``config.metrics``), else None,
            so that each place that counts costs one comparison without.
        liveness: when each rank of the job was last heard from, with a heartbeat timeout
            (``KVSTORE_HEARTBEAT_TIMEOUT``); None without.
        heard: ``liveness.heard`` (None without a timeout): rank -> the time it was last heard.
        heard_at: the time of the current drain of the socket; every message of a drain counts
            as heard then.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.job = Job(serving={config.server_rank})
        self.metrics: ServerMetrics | None = None
        self.max_message: int | None = None
        if not (config.bind or "").startswith("inproc://"):
            self.max_message = config.max_message_bytes or max(
                wire.MAX_HEADER_BYTES, max_payload_bytes(config.partition_bytes)
            )
        self.liveness: Liveness | None = None
        if config.heartbeat_timeout > 0:
            period = heartbeat_interval(config.heartbeat_timeout) / 2
            self.liveness = Liveness(config.heartbeat_timeout, period)
        self.heard = self.liveness.heard if self.liveness is not None else None
        self.heard_at = 0.0
        # replication: a number of this process (workers tell a replacement from a process
        # that was only stopped), and whether it is being caught up (it takes no worker then)
        self.incarnation = secrets.randbits(63)
        self.catching_up = False

    def reset_job(self) -> None:
        """Forget the job: its keys, optimizer, mode and ranks; serve the next one."""
        self.job = Job(serving={self.config.server_rank})
        if self.heard is not None:
            self.heard.clear()


__all__ = ["LANES", "CheckpointCall", "Job", "ServerState"]
