"""A worker's keys: how a key argument is read, and what the client keeps per key.

Per key the client keeps (:class:`KeyState`) its shape, dtype, chunks
(:func:`kvstore.topology.plan_chunks`, planned by :func:`plan_key`), the codec chosen when it
was initialised, its :class:`~kvstore.codecs.base.KeyEncoder` with one
:class:`~kvstore.codecs.Encoder` per chunk (which holds this worker's residual for that chunk;
codecs that select over the whole key, like top-k, do that once per push in the key encoder),
plus each chunk's last push in flight and how many pushes of it were sent.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from kvstore.codecs import Codec, Encoder
from kvstore.codecs.base import KeyEncoder
from kvstore.codecs.pulled import HeldWeights
from kvstore.config import WorkerOptions
from kvstore.errors import ValueMismatchError
from kvstore.topology import (
    WORD_ELEMS,
    Chunk,
    Key,
    interleaved_order,
    partition_elems_for,
    plan_chunks,
)
from kvstore.worker import values as vals
from kvstore.worker.request import Request

KeyArg: TypeAlias = Key | Sequence[Key]
"""A key, or a list of keys, as the store's calls take them."""

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class KeyState:
    """What the client keeps of one key (see above); the per-chunk lists start at
    :meth:`ready`, once every server initialised the key."""

    key: Key
    shape: tuple[int, ...]
    dtype: str
    codec: Codec
    chunks: tuple[Chunk, ...]
    averaged: bool = False  # the servers hold the mean of the pushes (kv.init(averaged=True))
    # The key's encoder (made at its first push, where its device is known) and its chunks'
    # encoders, in chunk order (all None before).
    key_encoder: KeyEncoder | None = None
    encoders: list[Encoder | None] = field(default_factory=list)
    encoder_device: Any = None
    last_push: list[Request | None] = field(default_factory=list)
    pushes_sent: list[int] = field(default_factory=list)  # per chunk; a pull follows them all
    relay_limits: list[int] = field(default_factory=list)  # per chunk; 0: pull dense values
    # compressed pulls (kvstore.codecs.pulled): the w_pub this worker holds, per chunk (None:
    # the key's pulls are dense)
    held: list[HeldWeights] | None = None
    send_order: tuple[Chunk, ...] = ()  # the chunks in push order (see interleaved_order)
    # With hierarchical aggregation (kvstore.worker.host_group), the indices of the chunks
    # this worker pushes and pulls for its host; None: all of them.
    exchanged: frozenset[int] | None = None
    # The chunks this worker exchanges with the servers itself, in chunk order: all of them, or
    # its share of its host's (set by ready()).
    own_chunks: tuple[Chunk, ...] = ()
    # Value prefetch (kvstore.worker.prefetch): whether this key's pushes are followed by a
    # pull, and the requests of the last push that asked for the values (per chunk), not yet
    # pulled.
    pulled_after_push: bool = False
    pushed_since_pull: bool = False
    prefetched: list[Request] | None = None
    # Encoder state loaded from a checkpoint, per chunk, waiting for the chunk's encoder to be
    # made (None: nothing waits); see kvstore.worker.checkpointing.
    restored: Sequence[Mapping[str, np.ndarray] | None] | None = None

    def pull_offer(self, chunk: Chunk) -> tuple[int | None, int | None]:
        """What a request for ``chunk``'s value offers to take: ``(relay_limit,
        held_version)``, a relayed value of at most that many pushes, or the delta to the
        version of ``w_pub`` this worker holds (compressed pulls); (None, None): dense."""
        if self.held is not None:
            return None, self.held[chunk.index].version
        return self.relay_limits[chunk.index] or None, None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def new_key_encoder(self, device: Any, worker: int) -> KeyEncoder:
        """A fresh encoder of the key's chunks for worker rank ``worker`` on ``device`` (None:
        the host), its state at zero."""
        bounds = [(chunk.start, chunk.stop) for chunk in self.chunks]
        return self.codec.make_key_encoder(
            self.key, self.numel, self.dtype, bounds, device, worker=worker, shape=self.shape
        )

    def describe(self) -> str:
        return f"key {self.key!r} (shape {self.shape}, {self.dtype})"

    def check_value(self, value: Any, name: str) -> vals.ValueInfo:
        """Describe ``value`` (the argument ``name`` of a call), which must have the key's
        shape and dtype."""
        info = vals.describe(value, name)
        if info.shape != self.shape or info.dtype != self.dtype:
            raise ValueMismatchError(
                f"`{name}` for {self.describe()} has shape {info.shape} and dtype {info.dtype}; "
                f"it must match the value given to init"
            )
        return info

    def ready(self, relay_limits: list[int]) -> None:
        """Start the per-chunk bookkeeping of a key every server initialised."""
        self.encoders = [None] * len(self.chunks)
        self.last_push = [None] * len(self.chunks)
        self.pushes_sent = [0] * len(self.chunks)
        self.relay_limits = relay_limits
        order = interleaved_order(self.chunks)
        self.own_chunks = self.chunks
        if self.exchanged is not None:  # (hierarchical aggregation: this worker's share)
            shared = self.exchanged
            order = tuple(chunk for chunk in order if chunk.index in shared)
            self.own_chunks = tuple(chunk for chunk in self.chunks if chunk.index in shared)
        self.send_order = order


def plan_key(
    key: Key,
    info: vals.ValueInfo,
    codec: Codec,
    options: WorkerOptions,
    num_servers: int,
    servers_here: bool,
) -> KeyState:
    """The state of a key about to be initialised with a value described by ``info``: its
    chunks, planned alike on every worker (they all read the same settings and addresses).

    ``servers_here``: every server is on this host (:func:`servers_on_this_host`), so no
    push crosses a link and chunks are planned for the servers' cores alone.
    """
    codec.check_dtype(info.dtype, f"key {key!r}")
    itemsize = np.dtype(info.dtype).itemsize
    partition = partition_elems_for(options.partition_bytes, itemsize)
    alignment = codec.chunk_alignment(info.shape)
    if alignment > partition:  # (rows longer than a partition: the codec copes)
        alignment = WORD_ELEMS
    chunks = plan_chunks(
        key,
        info.numel,
        num_servers,
        bigarray_bound=options.bigarray_bound,
        partition_elems=partition,
        wire_fraction=0.0 if servers_here else codec.pushed_fraction(info.numel, info.dtype),
        alignment=alignment,
    )
    return KeyState(key, info.shape, info.dtype, codec, chunks)


def servers_on_this_host(addresses: Sequence[str]) -> bool:
    """Whether every server address is on the worker's own host (loopback, ``localhost``,
    ``inproc://`` or ``ipc://``), judged from the addresses alone: no push crosses a link then.
    """
    for address in addresses:
        scheme, _, rest = address.partition("://")
        if scheme in ("inproc", "ipc"):
            continue
        host = rest.rsplit(":", 1)[0].strip("[]")
        if host == "localhost":
            continue
        try:
            if ipaddress.ip_address(host).is_loopback:
                continue
        except ValueError:
            pass  # a host name: assume it is another host
        return False
    return True


def normalize_key(key: Any) -> Key:
    """``key`` as the wire carries it: a 64-bit int or a str of at most 1024 characters."""
    if isinstance(key, bool):
        raise TypeError("expected int or str for `key`, got bool")
    if isinstance(key, int | np.integer):
        key = int(key)
        if not _INT64_MIN <= key <= _INT64_MAX:
            raise ValueError(f"int key {key} does not fit in 64 bits")
        return key
    if isinstance(key, str):
        if len(key) > 1024:
            raise ValueError("str keys are limited to 1024 characters")
        return key
    raise TypeError(f"expected int or str for `key`, got {type(key).__name__}")


def key_pairs(key: Any, value: Any, name: str) -> list[tuple[Key, Any]]:
    """Normalize ``key``/``value`` (single or lists) into (key, value) pairs."""
    if isinstance(key, list | tuple):
        keys = [normalize_key(k) for k in key]
        if not isinstance(value, list | tuple):
            raise TypeError(
                f"a list of {len(keys)} keys needs a list of {len(keys)} values for `{name}`, "
                f"got {type(value).__name__}"
            )
        if len(value) != len(keys):
            raise ValueError(
                f"{len(keys)} keys but {len(value)} values for `{name}`; give one per key"
            )
        seen: set[Key] = set()
        for k in keys:
            if k in seen:
                raise ValueError(f"key {k!r} appears twice in one call")
            seen.add(k)
        return list(zip(keys, value, strict=True))
    return [(normalize_key(key), value)]
