"""Key initialisation: the collective INIT that declares each chunk of a key on its server.

``init`` is collective: each worker declares the chunk's spec (shape, dtype, element range,
push and pull compression, whether it is averaged; rank 0 also sends the value), the specs must
match rank 0's, and every worker's init is answered once rank 0's value is stored, so no pull
can see an uninitialised key. Pushes and pulls then find their chunk through
:meth:`Keys.ready_chunk`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from kvstore.codecs import Codec, codec_from_spec
from kvstore.codecs.base import frame_array
from kvstore.codecs.pulled import pull_applies, pull_codec_from_spec
from kvstore.errors import ErrorCode
from kvstore.server.chunk import ChunkSpec, ChunkState, PendingReply
from kvstore.server.errors import RequestError
from kvstore.server.job import ServerState
from kvstore.server.replies import Replies
from kvstore.topology import Key, backed_up_shards
from kvstore.wire import InitFields, Message, Op


class Keys:
    """The job's chunks: their declaration by every worker and rank 0's initial value.

    Args:
        state: the server's shared state.
        replies: the server's reply sender.
    """

    def __init__(self, state: ServerState, replies: Replies) -> None:
        self._state = state
        self._replies = replies
        self.take_over: Callable[[int], None] = lambda shard: None
        """Called with a backed-up shard a worker addressed (its primary was lost), before
        the request is served (:meth:`kvstore.server.replication.Replication.take_over`)."""

    def _shard_of(self, init: InitFields) -> int:
        """The primary server of the chunk an INIT declares: this server, or (``shard``) one
        of those it holds backups of."""
        config = self._state.config
        if init.shard is None or init.shard == config.server_rank:
            return config.server_rank
        if init.shard not in backed_up_shards(
            config.server_rank, config.num_servers, config.replicas
        ):
            raise RequestError(
                ErrorCode.BAD_VALUE,
                f"key {init.key!r} chunk {init.chunk}: server {config.server_rank} holds no "
                f"backup of server {init.shard}'s shard with KVSTORE_REPLICAS={config.replicas}; "
                f"set it equal on servers and workers",
            )
        return init.shard

    def _chunk_spec(self, init: InitFields) -> tuple[ChunkSpec, Codec]:
        """The chunk an INIT declares, and its push codec; refuses what cannot work."""
        shape = tuple(init.shape)
        numel = math.prod(shape)
        start, count = init.offset, init.numel
        if start + count > numel or (count == 0 and numel > 0):
            raise RequestError(
                ErrorCode.BAD_VALUE,
                f"key {init.key!r} chunk {init.chunk}: elements [{start}, {start + count}) do not "
                f"fit a value of shape {shape}",
            )
        averaged = bool(init.averaged)
        if averaged and not init.dtype.startswith("float"):
            raise RequestError(
                ErrorCode.BAD_VALUE,
                f"key {init.key!r} is {init.dtype}: averaged keys hold a mean, so they must be "
                f"float keys",
            )
        codec = codec_from_spec({"type": init.codec, **init.codec_params})
        codec.check_dtype(init.dtype, f"key {init.key!r}")
        optimizer = self._state.job.optimizer
        if optimizer is not None:  # e.g. DGC under an optimizer with momentum
            codec.check_optimizer(optimizer.spec.name, optimizer.spec.params)
        nbytes = count * np.dtype(init.dtype).itemsize
        limit = self._state.max_message
        if limit is not None and nbytes > limit:
            # Its value could never arrive: refused before any state is allocated for it.
            raise RequestError(
                ErrorCode.MESSAGE_LIMIT,
                f"key {init.key!r} chunk {init.chunk} holds {nbytes} bytes, more than the "
                f"{limit} bytes server {self._state.config.server_rank} accepts in a "
                f"message (KVSTORE_MAX_MESSAGE_BYTES)",
            )
        pull_codec = None
        if init.pull_codec is not None:
            pull_codec = pull_codec_from_spec({"type": init.pull_codec, **(init.pull_params or {})})
            if not pull_applies(pull_codec, init.dtype):
                raise RequestError(
                    ErrorCode.BAD_VALUE,
                    f"key {init.key!r} is {init.dtype}: pulls are compressed for float32 keys only",
                )
        spec = ChunkSpec(
            key=init.key,
            index=init.chunk,
            start=start,
            numel=count,
            dtype=init.dtype,
            shape=shape,
            codec=tuple(sorted(codec.spec().items())),
            pull=tuple(sorted(pull_codec.spec().items())) if pull_codec is not None else (),
            averaged=averaged,
        )
        return spec, codec

    def on_init(self, identity: bytes, rank: int, msg: Message[InitFields]) -> None:
        """Declare a chunk (rank 0 also stores its value); answered once the value is in."""
        spec, codec = self._chunk_spec(msg.body)
        shard = self._shard_of(msg.body)
        chunks = self._state.job.chunks
        chunk = chunks.get((spec.key, spec.index))
        if chunk is None:
            chunk = ChunkState(spec=spec, codec=codec, shard=shard)
            chunks[(spec.key, spec.index)] = chunk
        elif chunk.shard != shard:
            raise RequestError(
                ErrorCode.SPEC_MISMATCH,
                f"{spec.name} is server {chunk.shard}'s, rank {rank} declared it server "
                f"{shard}'s; every worker must use the same KVSTORE_SERVERS",
            )
        if rank in chunk.declared and self._state.config.replicas > 1:
            # Declared twice on a backup: once as the backup's INIT, once resent here from a
            # lost primary (in either order). Both are answered when rank 0's value is in.
            if chunk.declared[rank] == spec:
                reply = PendingReply(identity, msg.rid, rank, False, Op.INIT)
                if chunk.initialized:
                    self._replies.ack(reply)
                else:
                    chunk.init_waiters.append(reply)
                return
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
            values = frame_array(msg.payloads[0], np.dtype(spec.dtype))
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
            declared = {other.rank: chunk.declared[other.rank] for other in waiting}
            for other in waiting:
                other_spec = declared[other.rank]
                if other_spec != spec:
                    chunk.declared.pop(other.rank, None)
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
            f"compression, averaged flag, KVSTORE_BIGARRAY_BOUND/KVSTORE_PARTITION_BYTES and "
            f"KVSTORE_SERVERS"
        )

    @staticmethod
    def _rejoin_mismatch(spec: ChunkSpec, reference: ChunkSpec) -> str:
        return (
            f"{spec.name}: rank 0 declared {spec.describe()} but the key lives in this job as "
            f"{reference.describe()}; a worker that rejoins a job must init its keys as before"
        )

    def ready_chunk(self, rank: int, key: Key, index: int) -> ChunkState:
        """Chunk ``index`` of ``key``, which must be initialised and declared by ``rank``."""
        chunk = self._state.job.chunks.get((key, index))
        if chunk is None or not chunk.initialized:
            raise RequestError(
                ErrorCode.NOT_INITIALIZED,
                f"key {key!r} chunk {index} is not initialised on server "
                f"{self._state.config.server_rank}; call kv.init first",
            )
        if rank not in chunk.declared:
            raise RequestError(
                ErrorCode.NOT_INITIALIZED,
                f"rank {rank} never called kv.init for key {key!r}; init is collective",
            )
        moved = self._state.job.moved.get(chunk.shard)
        if moved is not None:
            raise RequestError(
                ErrorCode.SHARD_MOVED,
                f"{chunk.spec.name}: server {moved} answers for server {chunk.shard}'s shard "
                f"now (a worker counted this server lost)",
            )
        if chunk.shard not in self._state.job.serving:  # its primary was lost: answer for it
            self.take_over(chunk.shard)
        return chunk

    def worker_lost(self, chunk: ChunkState, rank: int) -> None:
        """Forget the lost ``rank``'s declaration of ``chunk`` (its replacement declares it
        again) and fail the inits that wait on it."""
        chunk.declared.pop(rank, None)
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


__all__ = ["Keys"]
