"""Compressed pulls, the worker's side: the ``w_pub`` it holds per chunk, and how replies land.

With ``kv.set_pull_compression`` the servers answer a pull of a float32 key with the compressed
difference between the current value and ``w_pub``, the weights this worker holds; both sides
add its decoded form to ``w_pub`` and ``out`` receives ``w_pub`` (the arithmetic and the
versions are :mod:`kvstore.codecs.pulled`'s). Here: which keys hold weights
(:func:`held_weights`), what an INIT tells the servers (:func:`ask_for_compressed_pulls`), a
pull's reply applied to ``w_pub`` (:func:`land_compressed`), and the restart of the versions after a
checkpoint load (:func:`forget_held`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.codecs import Codec
from kvstore.codecs.pulled import HeldWeights, pull_applies
from kvstore.errors import CodecError, ProtocolError
from kvstore.topology import Chunk
from kvstore.wire import InitFields, Message
from kvstore.worker.keys import KeyState
from kvstore.worker.values import FlatTarget


def held_weights(
    pull_codec: Codec | None, dtype: str, chunks: Sequence[Chunk]
) -> list[HeldWeights] | None:
    """The ``w_pub`` of each chunk of a key of ``dtype`` whose pulls ``pull_codec`` compresses
    (None: the key's pulls are dense)."""
    if pull_codec is None or not pull_applies(pull_codec, dtype):
        return None
    return [HeldWeights(pull_codec, chunk.numel) for chunk in chunks]


def ask_for_compressed_pulls(init: InitFields, pull_codec: Codec) -> None:
    """Make ``init`` ask the servers to compress the key's pulls with ``pull_codec``."""
    init.pull_codec = pull_codec.name
    init.pull_params = pull_codec.params()


def land_compressed(state: KeyState, chunk: Chunk, reply: Message, target: FlatTarget) -> int:
    """Apply a compressed pull's reply to the chunk's ``w_pub`` and put ``w_pub`` into
    ``target``; returns the reply's payload bytes."""
    if state.held is None:
        raise ProtocolError(
            f"a compressed reply for key {state.key!r}, whose pulls are not compressed"
        )
    held = state.held[chunk.index]
    try:
        answer = reply.body
        base = -1 if answer.base_version is None else answer.base_version
        nbytes = held.apply(answer.pull_kind, answer.version, base, reply.payloads)
    except CodecError as exc:
        raise ProtocolError(
            f"compressed reply for key {state.key!r} chunk {chunk.index}: {exc}"
        ) from exc
    target.write(chunk.start, chunk.stop, held.w_pub)
    return nbytes


def forget_held(state: KeyState) -> None:
    """After a checkpoint load: the next pull brings the restored ``w_pub`` whole."""
    for held in state.held or ():
        held.version = -1
