"""Rounds: a chunk's pushes are decoded and summed, the sum is applied, and pulls are answered.

``dist_sync`` (and ``local``, which is sync with one worker): a chunk's round collects one push
from each of the N workers, decoding each into the round's aggregate as it arrives. When the Nth
is in, the optimizer (if any) is applied once, or the aggregate becomes the stored value, and then
all N pushes are acknowledged. A worker's second push of a chunk within one round waits for the
next round. ``dist_async``: each push is decoded and applied on arrival (an optimizer is required)
and acknowledged. An *averaged* chunk (``kv.init(..., averaged=True)``) takes no optimizer: its
value is the mean of the round's pushes, or in ``dist_async`` moves 1/N of the way to each push
(:meth:`~kvstore.server.chunk.ChunkState.apply_average`), and pushes need no optimizer. Per
chunk the work is serialized by an ``asyncio.Lock`` that hands out turns in arrival order;
different chunks proceed in parallel (:mod:`kvstore.server.work` says where the work runs).

Pulls are answered with the chunk's published value, but only after as many of the same
worker's pushes of that chunk have been applied as the pull says it follows (``af``: pulls
travel on the worker's control connection, pushes on its data connection, so arrival order means
nothing). So ``push`` then ``pull`` reads the worker's own update without an extra round trip.

Optional speed-ups, each in a method of its own:

* relayed pulls (:meth:`Rounds._keep_for_relay`, :meth:`Rounds._relay_of_round`): a round's
  pushes are kept so that a pull may be answered with them instead of their sum (see
  :mod:`kvstore.server.replies`);
* acks riding on pull replies (:meth:`Rounds._ack_with_pull`): a push whose worker's pull is
  answered in the round that applied it gets no separate ack; the value reply lists it in
  ``ak`` (errors always get their own reply);
* compressed pulls (:meth:`Rounds._advance_pulled`): in dist_sync each round's delta is encoded
  once for every worker's pull (:mod:`kvstore.codecs.pulled`);
* the round's sum published without a copy (in :meth:`Rounds._apply`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore import wire
from kvstore.codecs.base import relay_fits
from kvstore.errors import CodecError, ErrorCode
from kvstore.safe_text import printable
from kvstore.server.chunk import ChunkState, Deferred, PendingReply, PullWaiter
from kvstore.server.errors import RequestError
from kvstore.server.job import ServerState
from kvstore.server.keys import Keys
from kvstore.server.replies import Replies
from kvstore.server.work import WorkRunner
from kvstore.wire import Message, Op, PullFields, PushFields, PushPullFields

if TYPE_CHECKING:
    from kvstore.server.replication import Replication

logger = logging.getLogger(__name__)


class Rounds:
    """The push, round and pull path of the job's chunks.

    Args:
        state: the server's shared state.
        replies: the server's reply sender.
        work: runs the chunks' work inline or on the thread pool.
        keys: finds the chunk a push or pull is for.
    """

    def __init__(
        self,
        state: ServerState,
        replies: Replies,
        work: WorkRunner,
        keys: Keys,
        replication: Replication,
    ) -> None:
        self._state = state
        self._replies = replies
        self._work = work
        self._keys = keys
        self.replication = replication

    # a backup's side of replication -------------------------------------------------------------

    async def replay(
        self,
        chunk: ChunkState,
        ranks: list[int],
        pushes: list[list[Any]] | None,
        aggregate: np.ndarray | None,
    ) -> None:
        """Redo a round of ``chunk`` that its primary forwarded (on a backup): the same
        arithmetic, so the same bits. ``pushes``: the round's pushes in the order the primary
        summed them; ``aggregate``: its dense sum instead; neither: the round failed there.
        Counts the round's pushes of ``ranks`` as applied."""
        async with chunk.lock:
            aggregator = chunk.aggregator
            answer = None
            try:
                if pushes is not None:
                    for i, payloads in enumerate(pushes):
                        await self._work.run(chunk, aggregator.add, payloads, i == 0)
                    intermediate = await self._work.run(chunk, self._finisher(chunk))
                    if intermediate is None:
                        answer = _copied(aggregator.reply_frames())
                        await self._apply(chunk, aggregator.result)
                    else:
                        answer = _copied(intermediate)
                elif aggregate is not None:  # (a codec whose round ends with its sum)
                    np.copyto(aggregator.result, aggregate, casting="no")
                    await self._apply(chunk, aggregator.result)
                else:
                    aggregator.abandon()
            finally:
                chunk.relay = None  # (answered densely if this replica takes over)
                chunk.last_answer = answer
                for rank in ranks:
                    chunk.applied[rank] += 1

    def replay_and_answer(
        self,
        chunk: ChunkState,
        identity: bytes,
        rid: int,
        ranks: list[int],
        pushes: list[list[Any]] | None,
        aggregate: np.ndarray | None,
    ) -> None:
        """:meth:`replay` a forwarded round as the chunk's work, then answer the primary's
        request ``rid`` (an empty reply, or the error that stopped the replay)."""

        async def replayed() -> None:
            try:
                await self.replay(chunk, ranks, pushes, aggregate)
            except Exception as exc:
                logger.error(
                    "replaying a round of %s failed: %s", chunk.spec.name, printable(repr(exc))
                )
                self._replies.error(
                    identity, rid, Op.REPLICATE, ErrorCode.REPLICA, f"{chunk.spec.name}: {exc}"
                )
                return
            self._replies.send(identity, wire.reply(rid), Op.REPLICATE)

        self._work.submit(replayed())

    # push --------------------------------------------------------------------------------------

    def on_push(
        self, identity: bytes, rank: int, msg: Message[PushFields | PushPullFields]
    ) -> None:
        push = msg.body
        chunk = self._keys.ready_chunk(rank, push.key, push.chunk)
        spec = chunk.spec
        if push.numel != spec.numel:
            raise RequestError(
                ErrorCode.BAD_VALUE,
                f"{spec.name}: push of {push.numel} elements, the chunk has {spec.numel}",
            )
        chunk.codec.validate_payloads(msg.payloads, spec.numel, spec.dtype)
        job = self._state.job
        if job.mode == "dist_async" and job.optimizer is None and not spec.averaged:
            raise RequestError(
                ErrorCode.NO_OPTIMIZER,
                "dist_async applies every push on arrival and needs an optimizer: "
                "call kv.set_optimizer(...) on every worker before pushing",
            )
        if isinstance(push, PushPullFields):
            reply = PendingReply(
                identity, msg.rid, rank, True, msg.op, push.relay_limit or 0, push.held_version
            )
        else:
            reply = PendingReply(identity, msg.rid, rank, False, msg.op, 0, None)
        if push.sequence is not None and self._seen_before(chunk, rank, push.sequence):
            self._work.submit(self._answer_again(chunk, reply))
            return
        if job.mode == "dist_async":
            self._work.submit(self._push_async(chunk, reply, msg.payloads))
        else:
            self._admit(chunk, Deferred(reply, msg.payloads))

    @staticmethod
    def _seen_before(chunk: ChunkState, rank: int, sequence: int) -> bool:
        """Whether push number ``sequence`` of ``rank`` is one this server has already (sent
        again after a failover: its round was replicated here); counts it as seen if not.

        Refuses a push that skips one: this replica missed a round of its primary's."""
        seen = chunk.pushes_seen[rank]
        if sequence <= seen:
            return True
        if sequence != seen + 1:
            raise RequestError(
                ErrorCode.REPLICA,
                f"{chunk.spec.name}: push {sequence} of rank {rank} arrived, but this server "
                f"knows of {seen} of its pushes: it missed rounds of the chunk's primary",
            )
        chunk.pushes_seen[rank] = sequence
        return False

    async def _answer_again(self, chunk: ChunkState, reply: PendingReply) -> None:
        """Answer a push this server already applied (its round was replicated here before
        the primary that took it was lost), once the chunk's work before it is done: as its
        round answered it (a multi-round codec's frames), or with the current value."""
        async with chunk.lock:
            if chunk.last_answer is not None and not reply.want_value:
                self._replies.send(
                    reply.identity, wire.reply(reply.rid, None, chunk.last_answer), reply.op
                )
            else:
                self._finish_push(chunk, reply, None)

    def _admit(self, chunk: ChunkState, push: Deferred) -> None:
        """Give a sync push its place in the current round, or defer it to a later one."""
        moved = self._moved_error(chunk)
        if moved is not None:  # (a deferred push, admitted after the shard moved)
            self._finish_push(chunk, push.reply, moved)
            return
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
        self._work.submit(self._accumulate(chunk, push))
        if self._state.job.lost:
            self._fail_blocked(chunk)

    async def _accumulate(self, chunk: ChunkState, push: Deferred) -> None:
        payloads = push.payloads
        async with chunk.lock:  # turns are granted in arrival order
            if chunk.shard in self._state.job.moved:
                return  # (answered by shard_moved, which reset the round)
            first = chunk.accumulated == 0
            try:
                await self._work.run(chunk, chunk.aggregator.add, payloads, first)
                self._keep_for_relay(chunk, payloads)
                if self.replication.enabled:  # (forwarded as summed, in this order)
                    chunk.round_pushes.append((push.reply.rank, payloads))
            except Exception as exc:
                self._replies.warn(
                    logger,
                    chunk.spec.name,
                    "decoding a push of %s failed",
                    chunk.spec.name,
                    level=logging.ERROR,
                    exc_info=True,
                )
                chunk.round_error = chunk.round_error or exc
            chunk.accumulated += 1
            if chunk.accumulated == self._pushes_per_round():
                await self._complete_round(chunk)

    def _pushes_per_round(self) -> int:
        """The pushes of a chunk that make a dist_sync round: one per worker, or one per host
        where each host's workers sum their pushes first (hierarchical aggregation)."""
        return self._state.config.num_workers // (self._state.job.workers_per_push or 1)

    async def _complete_round(self, chunk: ChunkState) -> None:
        replies, error = chunk.round_replies, chunk.round_error
        summed, started = chunk.round_payloads, chunk.round_started
        pushes, chunk.round_pushes = chunk.round_pushes, []
        chunk.round_ranks, chunk.round_replies, chunk.round_payloads = set(), [], []
        chunk.round_error, chunk.accumulated = None, 0
        intermediate = acknowledgement = None
        aggregate = None
        if error is None:
            try:
                intermediate = await self._work.run(chunk, self._finisher(chunk))
                if intermediate is None:
                    acknowledgement = _copied(chunk.aggregator.reply_frames())
                    aggregate = chunk.aggregator.result
                    await self._apply(chunk, aggregate)
                    chunk.relay = self._relay_of_round(chunk, summed)
                else:
                    intermediate = _copied(intermediate)
            except Exception as exc:
                error = exc
        chunk.rounds += 1
        chunk.last_answer = intermediate if intermediate is not None else acknowledgement
        try:
            error = error or self._moved_error(chunk)  # (never answered unreplicated)
            if self.replication.backs_up(chunk):  # the backups have it before anyone sees it
                ranks = [reply.rank for reply in replies]
                await self.replication.forward(
                    chunk, ranks, None if error is not None else pushes, aggregate
                )
        except Exception as exc:  # (SHARD_MOVED: another replica answers for the shard now)
            error = error or exc
        if error is None and intermediate is not None:
            for reply in replies:
                if self._push_applied(chunk, reply):
                    self._replies.send(
                        reply.identity, wire.reply(reply.rid, None, intermediate), reply.op
                    )
            self._release_pulls(chunk)
        else:
            if error is not None:
                chunk.aggregator.abandon()  # (the exact sketch's candidates, for one)
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
                if await self._work.run(chunk, self._finisher(chunk)) is not None:
                    raise RequestError(
                        ErrorCode.CODEC,
                        f"codec {chunk.codec.name!r} needs several round trips per step, "
                        f"which only dist_sync provides",
                    )
                aggregate = chunk.aggregator.result
                await self._apply(chunk, aggregate)
                chunk.relay = None  # an optimizer's update: only the dense value says it
            except Exception as exc:
                error = exc
            chunk.rounds += 1
            try:
                error = error or self._moved_error(chunk)
                if self.replication.backs_up(chunk):
                    await self.replication.forward(
                        chunk,
                        [reply.rank],
                        None if error is not None else [(reply.rank, payloads)],
                        aggregate if error is None else None,
                    )
            except Exception as exc:
                error = error or exc
            self._pushes_done(chunk, [reply], error)

    def _finisher(self, chunk: ChunkState) -> Any:
        """The chunk's ``aggregator.finish``, after handing a codec that applies the server
        optimizer's step size itself (the sketch codec's error accumulation) that size."""
        aggregator = chunk.aggregator
        if chunk.codec.applies_step_size:
            optimizer = self._state.job.optimizer
            aggregator.step_size = 1.0 if optimizer is None else optimizer.step_size()
        return aggregator.finish

    def _value_is_sum(self, chunk: ChunkState) -> bool:
        """Whether a round makes the chunk's value the plain sum of its pushes: no server
        optimizer and not an averaged chunk (whose value is their mean)."""
        return self._state.job.optimizer is None and not chunk.spec.averaged

    async def _apply(self, chunk: ChunkState, grad: Any) -> None:
        assert chunk.value is not None
        if chunk.spec.averaged:
            running = self._state.job.mode == "dist_async"
            num_workers = self._state.config.num_workers
            per_push = self._state.job.workers_per_push or 1
            out = chunk.value.spare()
            work: tuple[Any, ...] = (
                chunk.apply_average, grad, num_workers, running, out, per_push
            )  # fmt: skip
        else:
            optimizer = self._state.job.optimizer
            if optimizer is not None and not chunk.spec.dtype.startswith("float"):
                raise RequestError(
                    ErrorCode.BAD_VALUE,
                    f"{chunk.spec.name} is {chunk.spec.dtype}: the optimizer updates float keys "
                    f"only",
                )
            out = chunk.value.spare()
            aggregator = chunk.aggregator
            if optimizer is None and chunk.master is None and grad is aggregator.result:
                # The round's sum is the new value: publish the aggregator's array itself and
                # let the next round accumulate into the spare, instead of copying.
                aggregator.result = out
                chunk.value.publish(grad)
                chunk.updates += 1
                await self._advance_pulled(chunk)
                return
            work = (chunk.apply_update, grad, optimizer, out)
        try:
            await self._work.run(chunk, *work)
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
            self._replies.warn(
                logger, reply.identity, "a push of %s was refused: %s", chunk.spec.name, error
            )
        else:
            code = ErrorCode.INTERNAL
            logger.error(
                "update of %s failed: %s", printable(chunk.spec.name), printable(repr(error))
            )
        self._replies.error(
            reply.identity, reply.rid, reply.op, code, f"{chunk.spec.name}: {error}"
        )

    # relayed pulls (see kvstore.server.replies) ----------------------------------------------

    def _keep_for_relay(self, chunk: ChunkState, payloads: list[Any]) -> None:
        """Keep a summed push for relayed pulls of the round's sum (in the order summed)."""
        codec = chunk.codec
        if codec.relayable and not codec.relays_round_result and self._value_is_sum(chunk):
            chunk.round_payloads.append(payloads)

    def _relay_of_round(self, chunk: ChunkState, summed: list[Any]) -> list[Any] | None:
        """The pushes a pull may relay instead of the value just published, or None.

        Without an optimizer the new value of a chunk that is not averaged is exactly the sum
        of these pushes (``summed`` stays empty for codecs that cannot relay, and for averaged
        chunks, whose value is the mean).
        """
        if chunk.codec.relays_round_result:  # the round's value is one compact push
            own = chunk.aggregator.relay_frames()
            summed = [own] if own is not None else []
        relayable = (
            bool(summed)
            and self._value_is_sum(chunk)
            and chunk.master is None
            # (sparse pushes vary in size: relay only while it saves bytes)
            and relay_fits(summed, chunk.spec.numel, chunk.spec.dtype)
        )
        return summed if relayable else None

    # pull --------------------------------------------------------------------------------------

    def on_pull(self, identity: bytes, rank: int, msg: Message[PullFields]) -> None:
        pull = msg.body
        chunk = self._keys.ready_chunk(rank, pull.key, pull.chunk)
        reply = PendingReply(
            identity, msg.rid, rank, True, Op.PULL, pull.relay_limit or 0, pull.held_version
        )
        if chunk.applied[rank] >= pull.after_pushes:
            self._replies.value(reply, chunk)
        else:
            chunk.pull_waiters.append(PullWaiter(reply, pull.after_pushes))
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
                and self._state.config.acks_on_pulls
                and self._ack_with_pull(chunk, reply)
            ):
                continue
            self._finish_push(chunk, reply, error, acknowledgement)
        self._release_pulls(chunk)

    def _release_pulls(self, chunk: ChunkState) -> None:
        """Answer the pulls whose worker's pushes they follow are now applied."""
        if not chunk.pull_waiters:
            return
        still_waiting = []
        for waiter in chunk.pull_waiters:
            if chunk.applied[waiter.reply.rank] >= waiter.after:
                self._replies.value(waiter.reply, chunk, waiter.acks)
            else:
                still_waiting.append(waiter)
        chunk.pull_waiters = still_waiting

    # acks riding on pull replies ---------------------------------------------------------------

    @staticmethod
    def _ack_with_pull(chunk: ChunkState, reply: PendingReply) -> bool:
        """Let a waiting pull of the same worker, which this applied push completes, acknowledge
        the push in its value reply (``ak``); whether there was one."""
        waiter = next(
            (
                w
                for w in chunk.pull_waiters
                if w.reply.rank == reply.rank and w.after <= chunk.applied[reply.rank]
            ),
            None,
        )
        if waiter is None:
            return False
        waiter.acks.append(reply.rid)
        return True

    # a shard another replica took over ---------------------------------------------------------

    def _moved_error(self, chunk: ChunkState) -> RequestError | None:
        """SHARD_MOVED if another replica took ``chunk``'s shard over, else None."""
        moved = self._state.job.moved.get(chunk.shard)
        if moved is None:
            return None
        return RequestError(
            ErrorCode.SHARD_MOVED, f"server {moved} answers for server {chunk.shard}'s shard now"
        )

    def shard_moved(self, chunk: ChunkState) -> None:
        """Another replica took ``chunk``'s shard over (some worker counted this server lost,
        while others still sent here): answer every push and pull waiting here with
        SHARD_MOVED, after the chunk's work before, so that their workers go on with that
        replica too and the round is completed there, not split between the two."""

        async def fail_waiting() -> None:
            async with chunk.lock:
                error = self._moved_error(chunk)
                assert error is not None
                replies = [*chunk.round_replies, *(push.reply for push in chunk.deferred)]
                if chunk.accumulated:
                    chunk.aggregator.abandon()
                chunk.round_ranks, chunk.round_replies, chunk.round_payloads = set(), [], []
                chunk.round_pushes, chunk.round_error, chunk.accumulated = [], None, 0
                chunk.deferred = type(chunk.deferred)()
                for reply in replies:
                    self._finish_push(chunk, reply, error)
                waiters, chunk.pull_waiters = chunk.pull_waiters, []
                for waiter in waiters:
                    for rid in waiter.acks:  # (pushes of replicated rounds: done)
                        self._replies.send(waiter.reply.identity, wire.reply(rid), Op.PUSH)
                    self._finish_push(chunk, waiter.reply, error)

        self._work.submit(fail_waiting())

    # lost workers ------------------------------------------------------------------------------

    def worker_lost(self, chunk: ChunkState, rank: int) -> None:
        """Fail the pushes and pulls of the lost ``rank`` on ``chunk`` that are not in a round,
        and, in dist_sync, what waits on a round that lacks its push."""
        chunk.applied.pop(rank, None)  # the replacement counts its pushes from 0
        chunk.pushes_seen.pop(rank, None)
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


def _copied(frames: list[Any] | None) -> list[bytes] | None:
    """Reply frames of an aggregator as bytes of their own (it reuses its buffers in the next
    round, while the replies may still be queued)."""
    if frames is None:
        return None
    return [bytes(memoryview(getattr(f, "buffer", f))) for f in frames]


__all__ = ["Rounds"]
