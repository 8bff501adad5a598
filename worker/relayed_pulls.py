"""Relayed pulls: a round's value as the pushes it sums, decoded and summed by the worker.

Without a server optimizer a round's value is the sum of the workers' decoded pushes, and where
a codec's pushes are small (2-bit: N pushes are N/16 of the dense bytes) the server can send
those instead of the value. A pull (or pushpull) offers to take a relayed value (``rx``: at
most this many pushes); the server may then answer with the payloads of the pushes whose
decoded sum is the value (``rl``: how many pushes), which the worker decodes and sums into
``out`` (:meth:`kvstore.codecs.Codec.sum_relay`), bit-identical to the dense value. See
:mod:`kvstore.wire` and ``docs/design.md``.

The client offers relays only where this job's rounds fit the codec's limit
(:func:`relay_limit`). Off switch: ``KVSTORE_PULL_RELAY=0`` (``WorkerOptions.pull_relay``);
every pull is then answered with the dense value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.errors import CodecError, ProtocolError
from kvstore.topology import Chunk
from kvstore.wire import buffer_nbytes
from kvstore.worker.keys import KeyState
from kvstore.worker.values import FlatTarget


def relay_limit(enabled: bool, num_workers: int, state: KeyState, chunk: Chunk) -> int:
    """How many pushes a relayed pull of ``chunk`` may carry (0: always pull dense).

    Relays are asked for only where this job's rounds (N pushes) fit the codec's limit.
    """
    if not enabled:
        return 0
    limit = state.codec.relay_limit(chunk.numel, state.dtype)
    return limit if num_workers <= limit else 0


def land_relayed(
    state: KeyState, chunk: Chunk, frames: Sequence[Any], pushes: int, target: FlatTarget
) -> int:
    """Decode a relayed reply's ``pushes`` pushes (``frames``, push after push) and sum them
    into ``chunk``'s region of ``target``; returns the reply's payload bytes."""
    where = f"relayed reply for key {state.key!r} chunk {chunk.index}"
    if pushes > state.relay_limits[chunk.index] or len(frames) % pushes:
        raise ProtocolError(
            f"{where}: {len(frames)} frames of {pushes} pushes, and at most "
            f"{state.relay_limits[chunk.index]} pushes were asked for"
        )
    per_push = len(frames) // pushes
    groups = [frames[i : i + per_push] for i in range(0, len(frames), per_push)]
    try:
        state.codec.sum_relay(groups, chunk.numel, state.dtype, target.region(chunk))
    except CodecError as exc:
        raise ProtocolError(f"{where}: {exc}") from exc
    return sum(buffer_nbytes(frame) for frame in frames)
