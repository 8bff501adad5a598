"""Server replication (``KVSTORE_REPLICAS=R``): every shard lives on R servers, so that a job
survives R - 1 lost servers with nothing lost or applied twice.

Placement: server ``p``'s shard (the chunks whose primary it is, :mod:`kvstore.topology`) is
held by servers ``p, p+1, ..., p+R-1`` (mod S, :func:`~kvstore.topology.replica_servers`).
Workers declare each chunk on all of them (an INIT with ``shard`` on a backup), so every
replica starts from rank 0's value, and tell every server the optimizer; after that a backup's
chunks change only by their primary's rounds.

The primary's side (:meth:`Replication.forward`): when a round of a chunk is complete and
applied, and before any of its pushes or pulls is answered, the primary hands the round to
every live backup and waits until each has applied it (the output commit rule: no worker
sees a round that a backup lacks). It sends the round once, aggregated or not, whichever is
fewer bytes and replays exactly:

* the round's dense sum (``kind`` 1), for codecs whose aggregator keeps nothing between
  rounds and ends a round with the sum (dense pushes: one sum instead of N pushes);
* the round's pushes in the order they were summed (``kind`` 2), for compressed pushes
  (N 2-bit pushes are an eighth of one fp32 sum) and for codecs whose server keeps state or
  answers in several round trips (the sketch, PowerSGD), whose arithmetic the backup redoes;
* nothing but the ranks (``kind`` 0), for a round that failed.

The backup's side (:meth:`Replication.on_replicate`): it replays the round on its copy of the
chunk with the primary's own code (:meth:`~kvstore.server.rounds.Rounds.replay`): decode, sum
in the same order, the optimizer's step, the compressed pulls' ``w_pub`` and version, a
codec's server state. The same arithmetic on the same values gives the same bits, so a backup
holds what its primary holds after every round it acknowledged. It counts the round's pushes
per rank, and refuses a round that does not follow the last one it had (it missed one): the
primary then stops forwarding to it.

Failover: a worker that loses a server (its connection closed, or its heartbeat timed out)
sends that server's requests to the next live replica of the shard
(:mod:`kvstore.worker.transport`). A worker request on a backed-up chunk makes this server
answer for the whole shard from then on (:meth:`Replication.take_over`); later rounds of the
shard go to the replicas after it. Pushes carry their number among the worker's pushes of
the chunk (``sequence``): a resent push whose round was replicated here is answered without
being applied again (:meth:`~kvstore.server.rounds.Rounds._seen_before`); one whose round was
not is summed in a round rebuilt from the resent pushes. Once a shard was taken over, its old
primary's rounds are refused here (``SHARD_MOVED``), so a primary that was only slow cannot
change a shard that another replica answers for; and the old primary is told
(:meth:`Replication.on_taken_over`), so that the workers that still send to it are refused
too and go on here (a round is never split between two replicas).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import zmq

from kvstore import auth, wire
from kvstore.codecs import accumulator_dtype, codec_from_spec
from kvstore.codecs.pulled import pull_codec_from_spec
from kvstore.errors import ErrorCode
from kvstore.optimizer_spec import make_optimizer_spec
from kvstore.server.checkpointing import optimizer_entry, spec_entry
from kvstore.server.chunk import ChunkSpec, ChunkState, named_with
from kvstore.server.errors import RequestError
from kvstore.server.job import ServerState
from kvstore.server.optimizers import make_optimizer
from kvstore.server.replica_link import LinkLost, RefusedByPeer, ReplicaLink
from kvstore.server.replies import Replies
from kvstore.topology import backed_up_shards, replica_servers
from kvstore.wire import (
    CatchUpFields,
    Message,
    Op,
    ReplicateFields,
    StateFields,
    TakenOverFields,
)

if TYPE_CHECKING:
    from kvstore.server.rounds import Rounds

logger = logging.getLogger(__name__)

ALIGN = 64
"""Each push frame of a forwarded round starts at a multiple of this many bytes of its one
payload, so that the backup decodes aligned views of it."""

KIND_FAILED, KIND_SUM, KIND_PUSHES = 0, 1, 2


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack_pushes(pushes: list[list[Any]]) -> tuple[bytearray, list[int], list[int]]:
    """The frames of ``pushes`` in one buffer, each at a multiple of :data:`ALIGN`; with the
    byte size of every frame and the frame count of every push."""
    views = [[memoryview(getattr(f, "buffer", f)).cast("B") for f in push] for push in pushes]
    sizes = [v.nbytes for push in views for v in push]
    packed = bytearray(sum(_aligned(n) for n in sizes))
    offset = 0
    for push in views:
        for view in push:
            packed[offset : offset + view.nbytes] = view
            offset += _aligned(view.nbytes)
    return packed, sizes, [len(push) for push in views]


def unpack_pushes(payload: Any, sizes: list[int], frames: list[int]) -> list[list[memoryview]]:
    """The pushes :func:`pack_pushes` packed into ``payload`` (views, not copies)."""
    buffer = memoryview(getattr(payload, "buffer", payload)).cast("B")
    if sum(frames) != len(sizes) or sum(_aligned(n) for n in sizes) != buffer.nbytes:
        raise RequestError(ErrorCode.BAD_MESSAGE, "a replicated round's sizes do not add up")
    pushes, offset, i = [], 0, 0
    for count in frames:
        push = []
        for size in sizes[i : i + count]:
            push.append(buffer[offset : offset + size])
            offset += _aligned(size)
        pushes.append(push)
        i += count
    return pushes


class Replication:
    """One server's part in replication: forwarding its shards' rounds to their backups, and
    replaying the rounds of the shards it backs up.

    Args:
        state: the server's shared state.
        replies: the server's reply sender.
        context: the server's ZeroMQ context (for the links to the backups).
    """

    def __init__(self, state: ServerState, replies: Replies, context: zmq.Context) -> None:
        self._state = state
        self._replies = replies
        self._context = context
        config = state.config
        self.enabled = config.replicas > 1
        self.peers: tuple[str, ...] | None = config.peers
        self.rounds: Rounds | None = None
        self._links: dict[int, ReplicaLink] = {}
        self._dropped: dict[int, str] = {}  # backups no longer forwarded to, and why
        self._joining: set[int] = set()  # servers being caught up (backups once they are)
        self._backups: dict[int, tuple[ReplicaLink, ...]] = {}  # per shard served
        self._staged: dict[tuple[Any, int], dict[str, Any]] = {}  # chunks arriving (a joiner)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._job = state.job  # (the job the links' state is about)
        self.barrier_moved: Callable[[str], None] = lambda why: None
        """Fail the workers waiting in server 0's barrier (set by the server)."""

    # which chunks forward ------------------------------------------------------------------------

    def backs_up(self, chunk: ChunkState) -> bool:
        """Whether rounds of ``chunk`` go to backups (its shard is served here and has a live
        backup)."""
        if not self.enabled:
            return False
        if self._job is not self._state.job:  # a new job: its backups start all live
            self._job = self._state.job
            self._dropped.clear()
            self._backups.clear()
        if chunk.shard in self._state.job.moved:  # (its rounds are refused: it moved)
            return False
        return bool(self._backups_of(chunk.shard) or chunk.joined)

    def _forward_links(self, chunk: ChunkState) -> list[ReplicaLink]:
        """The links a round of ``chunk`` goes to: its shard's live backups after this server,
        and the servers caught up with it since they joined."""
        links = list(self._backups_of(chunk.shard))
        peers = {link.peer for link in links}
        links += [
            self._link(peer)
            for peer in sorted(chunk.joined)
            if peer not in peers and peer not in self._dropped
        ]
        return links

    def _backups_of(self, shard: int) -> tuple[ReplicaLink, ...]:
        links = self._backups.get(shard)
        if links is None:
            links = self._backups[shard] = self._open_backups(shard)
        return links

    def _open_backups(self, shard: int) -> tuple[ReplicaLink, ...]:
        """The links to the live replicas of ``shard`` after this server, opened as needed."""
        config = self._state.config
        if self.peers is None or shard not in self._state.job.serving:
            return ()
        replicas = replica_servers(shard, config.num_servers, config.replicas)
        after = replicas[replicas.index(config.server_rank) + 1 :]
        return tuple(
            self._link(peer)
            for peer in after
            if peer not in self._dropped and peer not in self._joining
        )

    def _link(self, peer: int) -> ReplicaLink:
        link = self._links.get(peer)
        if link is None:
            assert self.peers is not None
            config = self._state.config
            link = ReplicaLink(
                self._context,
                self.peers[peer],
                peer,
                config.curve,
                config.heartbeat_timeout,
                self._link_lost,
            )
            self._links[peer] = link
        return link

    def _link_lost(self, link: ReplicaLink, why: str) -> None:
        self._drop(link.peer, why)

    def _drop(self, peer: int, why: str) -> None:
        """Stop forwarding to backup ``peer`` (it was lost, or missed a round)."""
        if peer in self._dropped:
            return
        self._dropped[peer] = why
        link = self._links.pop(peer, None)
        if link is not None:
            link.lose(why)
        self._backups.clear()  # recomputed without it
        logger.warning(
            "server %d forwards no more rounds to server %d: %s; its shards have one replica "
            "fewer until it is replaced",
            self._state.config.server_rank,
            peer,
            why,
        )

    def learn_peers(self, servers: list[str], rank: int) -> None:
        """The job's server addresses, as a worker's HELLO lists them (the first one that
        lists them is taken; the others must agree)."""
        if not self.enabled:
            return
        config = self._state.config
        if len(servers) != config.num_servers:
            raise RequestError(
                ErrorCode.CLUSTER_MISMATCH,
                f"worker rank {rank} lists {len(servers)} server addresses, the job has "
                f"{config.num_servers}",
            )
        if self.peers is None:
            self.peers = tuple(servers)
            self._backups.clear()

    def take_over(self, shard: int) -> None:
        """Answer for ``shard`` from now on: a worker sent this backup a request of it, which
        it does only once it lost the shard's replicas before this one."""
        job = self._state.job
        if shard in job.serving:
            return
        if shard in job.moved:  # (this server was taken for lost: another one has it)
            raise RequestError(
                ErrorCode.SHARD_MOVED,
                f"server {job.moved[shard]} answers for server {shard}'s shard now",
            )
        job.serving.add(shard)
        self._backups.pop(shard, None)
        for chunk in job.chunks.values():
            if chunk.shard == shard:  # (dist_async's per-worker w_pub: see ChunkState)
                chunk.pull_by_rank = {}
                chunk.pull_base = TAKEN_OVER_VERSION + chunk.rounds
        logger.warning(
            "server %d takes over server %d's shard: a worker lost the replicas before it",
            self._state.config.server_rank,
            shard,
        )
        self._spawn(self._announce(shard))

    async def _announce(self, shard: int) -> None:
        """Tell the replicas of ``shard`` before this server that it answers for the shard now.

        A worker takes a server for lost on its own (a closed connection, or silence past its
        heartbeat timeout), so a server that was only slow may still be sent a round's pushes
        by the other workers: the round would then wait on both replicas for the pushes sent
        to the other. Told, that server answers what waits on it with ``shard_moved``, and its
        workers go on here too. A lost one does not answer, which changes nothing."""
        config = self._state.config
        if self.peers is None:
            return
        replicas = replica_servers(shard, config.num_servers, config.replicas)
        own = config.server_rank
        timeout = min(config.heartbeat_timeout or REJOIN_TIMEOUT, REJOIN_TIMEOUT)
        job = self._state.job
        for peer in replicas[: replicas.index(own)]:
            # Until it answers: a stopped server may resume any time (a replacement started
            # at its address answers too, and ignores the notice).
            while job is self._state.job:
                link = ReplicaLink(
                    self._context, self.peers[peer], peer, config.curve, timeout, lambda *_: None
                )
                try:
                    await link.request(
                        TakenOverFields(shard=shard, server=own), [], "a takeover notice"
                    )
                    break
                except RefusedByPeer:
                    break
                except LinkLost as exc:
                    logger.info("server %d: server %d got no takeover notice: %s", own, peer, exc)
                finally:
                    link.close()
                await asyncio.sleep(PROBE_SECONDS)

    def on_taken_over(self, identity: bytes, msg: Message[TakenOverFields], user: str) -> None:
        """Another replica took a shard this server answers for over: stop answering for it,
        and fail what waits on it here with ``shard_moved`` (:meth:`_announce`). A server
        that holds none of the shard's chunks yet, or is being caught up, has nothing to stop
        (the notice was meant for the process it replaces)."""
        self._check_server(user, "TAKEN_OVER")
        shard, by = msg.body.shard, msg.body.server
        job = self._state.job
        chunks = [chunk for chunk in job.chunks.values() if chunk.shard == shard]
        if shard in job.serving and chunks and not self._state.catching_up:
            job.serving.discard(shard)
            job.moved[shard] = by
            self._backups.pop(shard, None)
            logger.warning(
                "server %d no longer answers for server %d's shard: server %d took it over "
                "(a worker counted this server lost)",
                self._state.config.server_rank,
                shard,
                by,
            )
            assert self.rounds is not None
            for chunk in chunks:
                self.rounds.shard_moved(chunk)
            if shard == 0:
                self.barrier_moved(f"server {by} keeps the barriers now")
        self._replies.send(identity, wire.reply(msg.rid), Op.TAKEN_OVER)

    # the primary's side ----------------------------------------------------------------------

    async def forward(
        self,
        chunk: ChunkState,
        ranks: list[int],
        pushes: list[tuple[int, list[Any]]] | None,
        aggregate: np.ndarray | None,
    ) -> None:
        """Hand a finished round of ``chunk`` to its live backups and wait until each applied
        it. ``pushes``: the round's (rank, payloads) in the order summed (None: the round
        failed); ``aggregate``: its dense sum where the codec ends a round with it.

        Raises RequestError(SHARD_MOVED) when a backup answers for the shard already (it took
        over: this server was counted lost by some worker)."""
        kind = KIND_FAILED
        payloads: list[Any] = []
        sizes: list[int] = []
        frames: list[int] = []
        if pushes is not None:
            kind, payload, sizes, frames = self._encode(chunk, pushes, aggregate)
            payloads = [payload]
        fields = ReplicateFields(
            key=chunk.spec.key,
            chunk=chunk.spec.index,
            kind=kind,
            ranks=ranks,
            sizes=sizes,
            frames=frames,
            updates=chunk.rounds - 1,
        )
        what = f"round {chunk.rounds} of {chunk.spec.name}"
        links = self._forward_links(chunk)
        results = await asyncio.gather(
            *(link.request(fields, payloads, what) for link in links), return_exceptions=True
        )
        for link, result in zip(links, results, strict=True):
            if isinstance(result, LinkLost):
                continue  # (dropped by the link's loss)
            if isinstance(result, RefusedByPeer) and result.code == ErrorCode.SHARD_MOVED:
                raise RequestError(
                    ErrorCode.SHARD_MOVED,
                    f"server {link.peer} answers for {chunk.spec.name} now: {result.message}",
                )
            if isinstance(result, BaseException):
                self._drop(link.peer, f"it refused {what}: {result}")

    def _encode(
        self, chunk: ChunkState, pushes: list[tuple[int, list[Any]]], aggregate: np.ndarray | None
    ) -> tuple[int, Any, list[int], list[int]]:
        """The kind and payload of a round: its sum where that replays exactly and is fewer
        bytes, else its pushes."""
        if (
            aggregate is not None
            and not chunk.codec.applies_step_size
            and (self._state.max_message is None or aggregate.nbytes <= self._state.max_message)
            and aggregate.nbytes < sum(wire.buffer_nbytes(f) for _, push in pushes for f in push)
            and not chunk.aggregator.state()
        ):
            return KIND_SUM, aggregate, [], []  # (the pushes are not copied then)
        packed, sizes, frames = pack_pushes([payloads for _, payloads in pushes])
        return KIND_PUSHES, packed, sizes, frames

    # the backup's side -----------------------------------------------------------------------

    def on_replicate(self, identity: bytes, msg: Message[ReplicateFields], user: str) -> None:
        """Replay a round a primary forwarded, then answer it (on the loop; the replay runs as
        the chunk's work)."""
        self._check_server(user, "REPLICATE")
        body = msg.body
        chunk = self._state.job.chunks.get((body.key, body.chunk))
        config = self._state.config
        if chunk is None or not chunk.initialized:
            raise RequestError(
                ErrorCode.REPLICA,
                f"key {body.key!r} chunk {body.chunk} is not initialised on server "
                f"{config.server_rank}",
            )
        if chunk.shard in self._state.job.serving:
            raise RequestError(
                ErrorCode.SHARD_MOVED,
                f"server {config.server_rank} took over server {chunk.shard}'s shard",
            )
        if body.updates != chunk.rounds:  # (counted on arrival: rounds come one at a time)
            raise RequestError(
                ErrorCode.REPLICA,
                f"{chunk.spec.name}: round {body.updates + 1} arrived, this backup had "
                f"{chunk.rounds} rounds",
            )
        pushes = aggregate = None
        if body.kind == KIND_PUSHES:
            if len(msg.payloads) != 1:
                raise RequestError(ErrorCode.BAD_MESSAGE, "a replicated round carries one frame")
            pushes = unpack_pushes(msg.payloads[0], body.sizes, body.frames)
        elif body.kind == KIND_SUM:
            aggregate = np.frombuffer(
                getattr(msg.payloads[0], "buffer", msg.payloads[0]),
                dtype=chunk.aggregator.result.dtype,
            )
            if aggregate.size != chunk.aggregator.result.size:
                raise RequestError(ErrorCode.BAD_MESSAGE, "a replicated sum of the wrong size")
        elif body.kind != KIND_FAILED:
            raise RequestError(ErrorCode.BAD_MESSAGE, f"unknown replicated round {body.kind}")
        chunk.rounds += 1
        for rank in body.ranks:  # (before the replay: a resent push waits for it, not redone)
            chunk.pushes_seen[rank] += 1
        assert self.rounds is not None
        self.rounds.replay_and_answer(chunk, identity, msg.rid, body.ranks, pushes, aggregate)

    def _check_server(self, user: str, what: str) -> None:
        """Refuse ``what`` unless it came from another server of the job (with CURVE keys:
        authenticated with the job's server key pair), or replication is off."""
        if not self.enabled:
            raise RequestError(ErrorCode.BAD_MESSAGE, f"{what}: this job has no replicas")
        if self._state.config.curve is not None and user != auth.SERVER_USER_ID.decode():
            raise RequestError(
                ErrorCode.BAD_MESSAGE, f"{what} is taken only from the job's servers"
            )

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # catching a joining server up (the replica that answers for the shard) -------------------

    def on_catch_up(self, identity: bytes, msg: Message[CatchUpFields], user: str) -> None:
        """A server that joins the job asks for ``shard``'s state: send it every chunk's state
        over a link to it, then forward the chunk's rounds to it too; answer once all went."""
        self._check_server(user, "CATCH_UP")
        config, shard = self._state.config, msg.body.shard
        if shard not in self._state.job.serving or not self._state.job.chunks:
            raise RequestError(
                ErrorCode.REPLICA,
                f"server {config.server_rank} does not answer for server {shard}'s shard",
            )
        peers = self.peers or ()
        if msg.body.address not in peers:
            raise RequestError(
                ErrorCode.REPLICA, f"{msg.body.address!r} is not one of the job's servers"
            )
        peer = peers.index(msg.body.address)
        if peer not in replica_servers(shard, config.num_servers, config.replicas):
            raise RequestError(
                ErrorCode.REPLICA, f"server {peer} holds no replica of server {shard}'s shard"
            )
        self._spawn(self._catch_up(shard, peer, identity, msg.rid))

    async def _catch_up(self, shard: int, peer: int, identity: bytes, rid: int) -> None:
        job = self._state.job
        self._joining.add(peer)
        self._dropped.pop(peer, None)
        stale = self._links.pop(peer, None)  # (to the process it replaces)
        if stale is not None:
            stale.close()
        self._backups.clear()
        link = self._link(peer)
        chunks = [c for c in job.chunks.values() if c.shard == shard and c.initialized]
        try:
            for chunk in chunks:
                async with chunk.lock:  # between rounds: what the next round starts from
                    for part, payload in _state_parts(chunk, job):
                        fields = StateFields(key=chunk.spec.key, chunk=chunk.spec.index, part=part)
                        what = f"the state of {chunk.spec.name}"
                        await link.request(fields, [] if payload is None else [payload], what)
                    chunk.joined.add(peer)
        except (LinkLost, RefusedByPeer) as exc:
            self._replies.error(
                identity, rid, Op.CATCH_UP, ErrorCode.REPLICA, f"catching up failed: {exc}"
            )
            return
        finally:
            self._joining.discard(peer)
            self._backups.clear()
        logger.warning(
            "server %d caught server %d up with server %d's shard (%d chunks); it is a replica "
            "again",
            self._state.config.server_rank,
            peer,
            shard,
            len(chunks),
        )
        self._replies.send(identity, wire.reply(rid), Op.CATCH_UP)

    # being caught up (a server that joins a running job) -------------------------------------

    async def rejoin(self, address: str) -> list[int]:
        """Catch this server up from the live replicas of the shards it holds, if the job runs
        (a server started with the job's addresses, ``KVSTORE_SERVERS``, to replace a lost
        one). Returns the shards it got; none: the job starts fresh.

        Its own shard stays answered by the replica that took it over: this server is its
        backup from now on."""
        config = self._state.config
        own = config.server_rank
        got = []
        timeout = min(config.heartbeat_timeout or REJOIN_TIMEOUT, REJOIN_TIMEOUT)
        for shard in (own, *backed_up_shards(own, config.num_servers, config.replicas)):
            for candidate in replica_servers(shard, config.num_servers, config.replicas):
                if candidate == own or self.peers is None:
                    continue
                probe = ReplicaLink(
                    self._context,
                    self.peers[candidate],
                    candidate,
                    config.curve,
                    timeout,
                    lambda link, why: None,
                )
                try:
                    await probe.request(
                        CatchUpFields(shard=shard, address=address), [], "a catch-up"
                    )
                except (LinkLost, RefusedByPeer) as exc:
                    logger.info("server %d: no catch-up from %d: %s", own, candidate, exc)
                    continue
                finally:
                    probe.close()
                got.append(shard)
                if shard == own:
                    self._state.job.serving.discard(own)
                break
        if got:
            logger.warning(
                "server %d rejoined the job: caught up with the shards of server(s) %s",
                own,
                got,
            )
        return got

    def on_state(self, identity: bytes, msg: Message[StateFields], user: str) -> None:
        """One part of a chunk's state from the replica that catches this server up."""
        self._check_server(user, "STATE")
        body = msg.body
        where = (body.key, body.chunk)
        staged = self._staged.setdefault(where, {})
        if body.part == "meta":
            staged.clear()
            staged["meta"] = msgpack.unpackb(_bytes(msg.payloads), strict_map_key=False)
        elif body.part == "end":
            self._staged.pop(where, None)
            self._install(staged)
        else:
            meta = staged.get("meta")
            if meta is None or body.part not in meta["arrays"]:
                raise RequestError(ErrorCode.REPLICA, f"an unexpected state part {body.part!r}")
            dtype, shape = meta["arrays"][body.part]
            array = np.frombuffer(_bytes(msg.payloads), dtype=dtype).reshape(shape)
            staged[body.part] = array.copy()  # (writable: optimizer state is updated in place)
        self._replies.send(identity, wire.reply(msg.rid), Op.STATE)

    def _install(self, staged: dict[str, Any]) -> None:
        """Make a chunk of the staged state (the replica's, as it was between two rounds)."""
        meta = staged.pop("meta")
        job = self._state.job
        described = meta["job"]
        job.mode = job.mode or described["mode"]
        job.workers_per_push = job.workers_per_push or described["workers_per_push"]
        if job.optimizer is None and described["optimizer"] is not None:
            saved = described["optimizer"]
            job.optimizer = make_optimizer(make_optimizer_spec(saved["name"], saved["params"]))
        spec = ChunkSpec(
            key=meta["key"],
            index=meta["chunk"],
            start=meta["start"],
            numel=meta["numel"],
            dtype=meta["dtype"],
            shape=tuple(meta["shape"]),
            codec=tuple(sorted(meta["codec"].items())),
            pull=tuple(sorted(meta["pull"].items())),
            averaged=meta["averaged"],
        )
        chunk = ChunkState(spec=spec, codec=codec_from_spec(meta["codec"]), shard=meta["shard"])
        chunk.pull_codec = pull_codec_from_spec(meta["pull"]) if meta["pull"] else None
        chunk.set_initial_value(staged["value"], job.mode)
        saved = meta["checkpoint"]
        state = None
        if saved["optimizer"] is not None and job.optimizer is not None:
            state = job.optimizer.import_state(
                named_with(staged, "opt."),
                dict(saved["scalars"]),
                spec.numel,
                accumulator_dtype(spec.dtype),
                spec.name,
            )
        assert chunk.value is not None
        out = chunk.value.spare()
        chunk.restore(staged, state, saved, out)
        chunk.value.publish(out)
        chunk.declared = dict.fromkeys(meta["declared"], spec)
        chunk.rounds = meta["rounds"]
        chunk.applied = Counter(dict(meta["applied"]))
        chunk.pushes_seen = Counter(dict(meta["pushes_seen"]))
        answers = sorted(n for n in staged if n.startswith("answer."))
        chunk.last_answer = [staged[n].tobytes() for n in answers] if meta["answered"] else None
        job.chunks[(spec.key, spec.index)] = chunk

    def close(self) -> None:
        """Stop the tasks under way (catch-ups, notices) and close the links to other
        servers."""
        for task in list(self._tasks):
            task.cancel()
        for link in list(self._links.values()):
            link.close()
        self._links.clear()


TAKEN_OVER_VERSION = 2**40
"""Where the ``w_pub`` versions of a taken-over chunk's workers start in ``dist_async`` (far
above any version a worker can hold, so that each worker's first pull is answered whole)."""

PROBE_SECONDS = 1.0
"""How long a takeover notice that found no server waits before it is sent again."""

REJOIN_TIMEOUT = 10.0
"""Seconds a server that starts with the job's addresses waits for each other replica's answer
to its catch-up request (one that does not answer in time is taken as not running)."""


def _bytes(payloads: list[Any]) -> bytes:
    if len(payloads) != 1:
        raise RequestError(ErrorCode.BAD_MESSAGE, "a state part carries one frame")
    return bytes(memoryview(getattr(payloads[0], "buffer", payloads[0])))


def _state_parts(chunk: ChunkState, job: Any) -> list[tuple[str, Any]]:
    """A chunk's state as STATE parts (name, payload): ``meta`` (msgpack: its spec, counters,
    the job's mode and optimizer, the arrays' dtypes and shapes), every array of its
    checkpoint state, the frames of its last answer, and ``end``."""
    arrays, saved = chunk.checkpoint_state()
    answer = chunk.last_answer
    arrays = dict(arrays)
    for i, frame in enumerate(answer or []):
        arrays[f"answer.{i}"] = np.frombuffer(frame, dtype=np.uint8)
    spec = chunk.spec
    meta = {
        **spec_entry(spec),
        "pull": dict(spec.pull),
        "shard": chunk.shard,
        "declared": sorted(chunk.declared),
        "rounds": chunk.rounds,
        "applied": sorted(chunk.applied.items()),
        # (not pushes_seen: that counts the pushes of the round being summed too, which the
        # joiner gets with the round)
        "pushes_seen": sorted(chunk.applied.items()),
        "answered": answer is not None,
        "checkpoint": saved,
        "job": {
            "mode": job.mode,
            "workers_per_push": job.workers_per_push,
            "optimizer": optimizer_entry(job.optimizer),
        },
        "arrays": {name: [a.dtype.str, list(a.shape)] for name, a in arrays.items()},
    }
    parts: list[tuple[str, Any]] = [("meta", msgpack.packb(meta, use_bin_type=True))]
    parts += [(name, np.ascontiguousarray(a)) for name, a in arrays.items()]
    parts.append(("end", None))
    return parts


__all__ = ["REJOIN_TIMEOUT", "Replication", "pack_pushes", "unpack_pushes"]
