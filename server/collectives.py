"""The collectives: requests answered once every worker of the job made the same call.

* ``barrier`` (kept by server 0): answered when all N workers are in it.
* ``set_optimizer``: answered when all N workers asked for the same optimizer (equal
  arguments); the optimizer then updates every key of the job on this server
  (:mod:`kvstore.server.optimizers`).
* ``save_checkpoint`` and ``load_checkpoint`` (SAVE, LOAD): carried out once all N workers made
  the same call, only while no round is in flight; the file format and the manifest are
  :mod:`kvstore.checkpoint`, this shard's part :mod:`kvstore.server.checkpointing`.

A collective needs every rank: while one is lost (:mod:`kvstore.server.membership`) each fails
with WORKER_LOST, and those already gathered fail when a rank is lost.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from kvstore import checkpoint
from kvstore.errors import CheckpointError, CodecError, ErrorCode
from kvstore.optimizer_spec import make_optimizer_spec
from kvstore.safe_text import printable
from kvstore.server import checkpointing
from kvstore.server.chunk import ChunkState, PendingReply
from kvstore.server.errors import RequestError
from kvstore.server.job import CheckpointCall, Job, ServerState
from kvstore.server.optimizers import make_optimizer
from kvstore.server.published import PublishedValue
from kvstore.server.replies import Replies
from kvstore.server.work import WorkRunner
from kvstore.wire import LoadFields, Message, Op, SaveFields, SetOptimizerFields

logger = logging.getLogger(__name__)

SPEC_LOG_LIMIT = 1000
"""How much of an optimizer's description the log keeps (the workers choose it; texts in it are
escaped by ``repr`` already, so only its length needs a bound)."""


class Collectives:
    """Barriers, set_optimizer and checkpoints of the job.

    Args:
        state: the server's shared state.
        replies: the server's reply sender.
        work: runs checkpoint I/O on the thread pool.
    """

    def __init__(self, state: ServerState, replies: Replies, work: WorkRunner) -> None:
        self._state = state
        self._replies = replies
        self._work = work
        self.take_over: Callable[[int], None] = lambda shard: None
        """Answer for a lost server's shard (replication's ``take_over``; set by the server)."""

    # barrier and optimizer ---------------------------------------------------------------------

    def on_barrier(self, identity: bytes, rank: int, msg: Message) -> None:
        """Hold the worker in the barrier; release every worker when all N are in."""
        moved = self._state.job.moved.get(0)
        if moved is not None:
            raise RequestError(ErrorCode.SHARD_MOVED, f"server {moved} keeps the barriers now")
        if 0 not in self._state.job.serving:
            if not any(chunk.shard == 0 for chunk in self._state.job.chunks.values()):
                raise RequestError(ErrorCode.WRONG_SERVER, "barriers are kept by server 0")
            self.take_over(0)  # (server 0 was lost: its replica here keeps them)
        job = self._state.job
        job.require_all_ranks("the barrier")
        if rank in job.barrier:
            raise RequestError(ErrorCode.BAD_VALUE, f"rank {rank} is already in the barrier")
        job.barrier[rank] = PendingReply(identity, msg.rid, rank, False, Op.BARRIER)
        if len(job.barrier) == self._state.config.num_workers:
            arrived, job.barrier = job.barrier, {}
            for reply in arrived.values():
                self._replies.ack(reply)

    def barrier_moved(self, why: str) -> None:
        """Another replica took server 0's shard over, and its barriers: the workers waiting in
        this one are told so (``shard_moved``), and go on with that replica."""
        waiting, self._state.job.barrier = self._state.job.barrier, {}
        for reply in waiting.values():
            self._replies.error(reply.identity, reply.rid, Op.BARRIER, ErrorCode.SHARD_MOVED, why)

    def on_set_optimizer(
        self, identity: bytes, rank: int, msg: Message[SetOptimizerFields]
    ) -> None:
        """Gather the workers' optimizer proposals; set it once all N asked for the same."""
        spec = make_optimizer_spec(msg.body.name, msg.body.hyperparameters)
        job = self._state.job
        for codec in {chunk.codec for chunk in job.chunks.values()}:
            try:  # e.g. momentum on the servers for DGC, which applies it on the workers
                codec.check_optimizer(spec.name, spec.params)
            except CodecError as exc:
                raise RequestError(ErrorCode.OPTIMIZER, str(exc)) from exc
        if rank in job.rejoined:
            # A replacement runs its script from the top: its first set_optimizer, equal to
            # the job's optimizer, is a no-op that waits for nobody (the others made it long ago).
            job.rejoined.discard(rank)
            if job.optimizer is not None and job.optimizer.spec == spec and not job.proposals:
                self._replies.ack(PendingReply(identity, msg.rid, rank, False, Op.SET_OPTIMIZER))
                return
        job.require_all_ranks("set_optimizer")
        if rank in job.proposals:
            raise RequestError(
                ErrorCode.OPTIMIZER, f"rank {rank} already called set_optimizer and is waiting"
            )
        for other_rank, (other, _) in job.proposals.items():
            if other != spec:
                raise RequestError(
                    ErrorCode.OPTIMIZER,
                    f"rank {rank} asked for optimizer {spec!r} but rank {other_rank} asked for "
                    f"{other!r}: every worker must call set_optimizer with the same arguments",
                )
        reply = PendingReply(identity, msg.rid, rank, False, Op.SET_OPTIMIZER)
        job.proposals[rank] = (spec, reply)
        if len(job.proposals) < self._state.config.num_workers:
            return
        proposals, job.proposals = job.proposals, {}
        job.optimizer = make_optimizer(spec)
        logger.info("optimizer set: %s", printable(repr(spec), limit=SPEC_LOG_LIMIT))
        for _, reply in proposals.values():
            self._replies.ack(reply)

    def worker_lost(self, rank: int) -> None:
        """Fail the collectives being gathered: they wait for every rank (the lost one's own
        entry is told too: a stalled worker reads it when it wakes up)."""
        job = self._state.job
        barrier, job.barrier = job.barrier, {}
        for reply in barrier.values():
            self._replies.worker_lost(reply, rank, "the barrier")
        proposals, job.proposals = job.proposals, {}
        for _, reply in proposals.values():
            self._replies.worker_lost(reply, rank, "set_optimizer")
        call, job.checkpoint = job.checkpoint, None
        if call is not None:
            for reply in call.replies.values():
                self._replies.worker_lost(reply, rank, call.describe())

    # checkpoints -------------------------------------------------------------------------------

    def on_checkpoint(
        self, identity: bytes, rank: int, msg: Message[SaveFields | LoadFields]
    ) -> None:
        """SAVE and LOAD: collective; acted on once all N workers made the same call.

        SAVE writes this server's shard into the staging directory ``p`` (rank 0 then writes
        the manifest and renames the directory: :mod:`kvstore.checkpoint`). LOAD phase 0 reads
        and checks the checkpoint at ``p`` and stages it, phase 1 commits it, phase 2 drops it:
        every worker commits only after every server's phase 0 succeeded, so a load happens
        everywhere or nowhere. Each is carried out only while no round is in flight (between
        steps), else every worker gets a ``checkpoint`` error saying what was in flight.
        """
        job = self._state.job
        body = msg.body
        phase = body.phase if isinstance(body, LoadFields) else 0
        if phase > 2:
            raise RequestError(ErrorCode.BAD_MESSAGE, f"LOAD phase {phase} is not 0, 1 or 2")
        covered = set(body.shards) if body.shards is not None else {self._state.config.server_rank}
        moved = sorted(covered & job.moved.keys())
        if moved:
            raise RequestError(
                ErrorCode.SHARD_MOVED,
                f"server {job.moved[moved[0]]} answers for server {moved[0]}'s shard now",
            )
        if body.retry and self._state.config.replicas > 1:
            self._retried(job, identity, rank, msg)
            return
        job.require_all_ranks("a checkpoint")  # (a collective: it would wait for them)
        if job.checkpoint_busy:
            raise RequestError(
                ErrorCode.CHECKPOINT, f"rank {rank}: a checkpoint is being written or read"
            )
        call = job.checkpoint or CheckpointCall(msg.op, phase, body.path)
        job.require_all_ranks(call.describe())
        if (call.op, call.phase, call.path) != (msg.op, phase, body.path):
            other = CheckpointCall(msg.op, phase, body.path)
            raise RequestError(
                ErrorCode.CHECKPOINT,
                f"rank {rank} called {other.describe()} but rank(s) {sorted(call.replies)} "
                f"called {call.describe()}: every worker makes the same checkpoint calls",
            )
        if rank in call.replies:
            raise RequestError(ErrorCode.CHECKPOINT, f"rank {rank} is already in this call")
        job.checkpoint = call
        call.replies[rank] = PendingReply(identity, msg.rid, rank, False, msg.op)
        if body.failure is not None:
            call.errors[rank] = body.failure
        if body.shards is not None:
            call.shards = (call.shards or set()) | set(body.shards)
        if len(call.replies) == self._state.config.num_workers:
            job.checkpoint = None
            job.checkpoint_busy = True
            self._work.spawn(self._carry_out_checkpoint(job, call))

    def _retried(self, job: Job, identity: bytes, rank: int, msg: Message) -> None:
        """A SAVE or LOAD sent again for a lost server's shards (replication): done for this
        worker alone. A save writes those shards' parts from this replica's copy (the same
        bytes whichever worker asks: the chunks are between steps); a load has nothing to do,
        as every replica loads every shard it holds in the gathered call."""
        reply = PendingReply(identity, msg.rid, rank, False, msg.op)
        if msg.op is Op.LOAD:
            self._replies.ack(reply)
            return
        call = CheckpointCall(msg.op, 0, msg.body.path, shards=set(msg.body.shards or ()))

        async def save() -> None:
            try:
                await self._save_shards(job, call, retried=True)
            except Exception as exc:
                code = (
                    ErrorCode.CHECKPOINT
                    if isinstance(exc, CheckpointError | OSError)
                    else ErrorCode.INTERNAL
                )
                self._replies.error(identity, msg.rid, msg.op, code, str(exc))
                return
            self._replies.ack(reply)

        self._work.spawn(save())

    async def _carry_out_checkpoint(self, job: Job, call: CheckpointCall) -> None:
        error: BaseException | None = None
        try:
            if call.errors:
                failed = call.errors.items()
                raise CheckpointError(
                    "; ".join(f"rank {r} could not do its part: {text}" for r, text in failed)
                )
            if call.op is Op.SAVE:
                await self._save_shards(job, call)
            elif call.phase == 0:
                await self._prepare_load(job, call)
            elif call.phase == 1:
                await self._commit_load(job)
        except Exception as exc:
            error = exc
        finally:
            job.checkpoint_busy = False
            if error is not None or call.op is Op.SAVE or call.phase != 0:
                job.staged_load = None  # (a failed phase 0, a commit, an abort)
        code = ErrorCode.CHECKPOINT
        if error is not None and not isinstance(error, CheckpointError | OSError):
            logger.error("%s failed", printable(call.describe()), exc_info=error)
            code = ErrorCode.INTERNAL
        elif error is not None:
            logger.warning("%s refused: %s", printable(call.describe()), printable(error))
        else:
            logger.info("%s done", printable(call.describe()))
        for reply in call.replies.values():
            if error is None:
                self._replies.ack(reply)
            else:
                self._replies.error(reply.identity, reply.rid, reply.op, code, str(error))

    def _check_quiescent(self, job: Job, what: str) -> list[ChunkState]:
        """The job's chunks, after checking that nothing is in flight on any of them."""
        chunks = list(job.chunks.values())
        problem = checkpointing.busy_reason(chunks)
        if problem is None and (job.barrier or job.proposals):
            problem = "a barrier or set_optimizer is waiting for workers"
        if problem is not None:
            raise CheckpointError(
                f"cannot {what} on server {self._state.config.server_rank}: {problem}; call it "
                f"between steps, once every worker's pushes were pulled"
            )
        return chunks

    def _shards(self, job: Job, call: CheckpointCall, held: bool) -> dict[int, list[ChunkState]]:
        """The shards a checkpoint call covers here, with their chunks: this server's own; with
        replication, those the workers say it answers for (it takes a lost server's over), and
        for a load (``held``) every shard it holds a replica of, backups included."""
        cfg = self._state.config
        chunks = list(job.chunks.values())
        if cfg.replicas == 1:
            return {cfg.server_rank: chunks}
        shards = set(call.shards) if call.shards is not None else {cfg.server_rank}
        for shard in shards:
            if shard not in job.serving and any(c.shard == shard for c in chunks):
                self.take_over(shard)
        if held:
            shards |= {chunk.shard for chunk in chunks}
        return {shard: [c for c in chunks if c.shard == shard] for shard in sorted(shards)}

    async def _save_shards(self, job: Job, call: CheckpointCall, retried: bool = False) -> None:
        cfg = self._state.config
        # (a retry: the other workers may wait in the checkpoint's barrier already, and
        # other retries may write the same parts: they take turns through the locks)
        what = "save a checkpoint"
        chunks = list(job.chunks.values()) if retried else self._check_quiescent(job, what)
        async with _all_locked(chunks):  # (free: quiescent) pushes that sneak in wait
            problem = next((p for c in chunks if (p := c.busy(locked_here=True))), None)
            if retried and problem is not None:
                raise CheckpointError(f"cannot save a checkpoint: {problem}")
            for shard, own in self._shards(job, call, held=False).items():
                info = {
                    "server_rank": shard,
                    "num_servers": cfg.num_servers,
                    "num_workers": cfg.num_workers,
                    "mode": job.mode,
                    "optimizer": checkpointing.optimizer_entry(job.optimizer),
                }
                arrays, meta = checkpointing.snapshot(own, info)
                await self._work.in_pool(
                    checkpoint.write_part,
                    call.path,
                    checkpoint.server_file(shard),
                    arrays,
                    meta,
                )

    async def _prepare_load(self, job: Job, call: CheckpointCall) -> None:
        cfg = self._state.config
        self._check_quiescent(job, "load a checkpoint")
        staged = None
        for shard, own in self._shards(job, call, held=True).items():
            part = await self._work.in_pool(
                lambda shard=shard, own=own: checkpointing.prepare_load(
                    call.path,
                    own,
                    job.optimizer,
                    server_rank=shard,
                    num_servers=cfg.num_servers,
                    num_workers=cfg.num_workers,
                    mode=job.mode,
                ),
            )
            if staged is None:
                staged = part
            else:
                staged.restores += part.restores
                staged.optimizer = staged.optimizer or part.optimizer
        job.staged_load = staged

    async def _commit_load(self, job: Job) -> None:
        staged, job.staged_load = job.staged_load, None
        if staged is None:
            raise CheckpointError("no load was prepared (phase 0 failed or was not called)")
        self._check_quiescent(job, "load a checkpoint")
        chunks = [restore[0] for restore in staged.restores]
        async with _all_locked(chunks):
            values = [_published(chunk) for chunk in chunks]
            spares = [value.spare() for value in values]
            await self._work.in_pool(staged.apply, spares)
            for value, spare in zip(values, spares, strict=True):
                value.publish(spare)
        if staged.optimizer is not None:
            job.optimizer = staged.optimizer
        logger.info("loaded %d chunk(s) from %s", len(chunks), printable(staged.path))


def _published(chunk: ChunkState) -> PublishedValue:
    """The published value of ``chunk``, which a checkpoint only restores once initialised."""
    assert chunk.value is not None
    return chunk.value


@contextlib.asynccontextmanager
async def _all_locked(chunks: list[ChunkState]) -> AsyncIterator[None]:
    """Hold the locks of ``chunks`` (in list order; free when the chunks are quiescent)."""
    held = []
    try:
        for chunk in chunks:
            await chunk.lock.acquire()
            held.append(chunk)
        yield
    finally:
        for chunk in held:
            chunk.lock.release()


__all__ = ["Collectives"]
