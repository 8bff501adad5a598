"""Topology: which server holds which part of a key. Pure functions, no sockets.

Rules (docs/design.md, "Sharding"):

* A key with fewer than ``bigarray_bound`` elements lives whole on one server, chosen by
  :func:`stable_key_hash` modulo the number of servers. The hash is the same on every worker, every
  run and every Python version (blake2b of a typed encoding of the key; never the salted
  builtin ``hash``).
* A key with ``bigarray_bound`` elements or more is split into S contiguous slices, one per server
  in server-rank order, with every boundary on a multiple of 16 elements so that a 2-bit word
  (16 elements) never straddles two servers. Slice ``i`` covers words
  ``[W*i//S, W*(i+1)//S)`` of the ``W = ceil(n/16)`` words; the last slice ends at ``n``.
  A codec may ask for a coarser *alignment* (a multiple of 16, at most a partition): PowerSGD
  needs whole matrix rows in every chunk, ``lcm(16, row length)``. Slices and chunks then cut
  on multiples of it instead of 16 (the key's end aside), and a slice's tail shorter than the
  alignment joins its last chunk only while that stays within a partition.
* Each slice is further cut into *chunks*, so that encoding, sending, server-side decoding and
  replies of one big key overlap. A chunk is the unit of server state: it has its own round,
  optimizer state and reply. Pushing chunks and returning their values is a two-stage pipeline
  (a flow shop): a step takes the slice's transfer time plus about one chunk's round, so chunks
  must be small next to the slice. A slice is cut into :data:`SLICE_PARTS` chunks, a *long*
  slice (one whose key pushes at least :data:`LONG_SLICE_PARTITIONS` partitions) into
  :data:`LONG_SLICE_PARTS`, none longer than ``partition_elems`` (:func:`slice_chunking`).
  Chunk sizes ramp up at the start of a slice and down at its end where the slice is long
  enough for ramp steps of at least the shortest chunk (:func:`chunk_sizes`); most bytes
  still travel in full-size messages. A step is a two-stage flow shop: chunk ``i`` takes
  ``p_i`` to reach a server from every worker (N pushes over its link) and ``r_i`` to go back
  (N replies), and the step lasts ``max_k (p_1 + ... + p_k) + (r_k + ... + r_last)``. Where
  pushes are shorter on the wire than replies (compressed pushes, dense values back) that is
  about ``p_1`` plus the replies, and a small first chunk starts them early. Where both are
  the same size (dense) it is the transfer plus the longest chunk's round, however the chunks
  are sized or ordered: ramps only add chunks, and so CPU, which is what the measurement
  behind :data:`LONG_MIN_CHUNK_FRACTION` found (ramps in long slices were slower). (A round
  completes when the slowest worker's push of its chunk arrives; where TCP shares a server's
  link unevenly among many workers, rounds complete in bursts and the outgoing link waits
  between them: see docs/performance.md, shaped-link cluster.)
* No chunk is shorter than :func:`min_chunk_elems` (a quarter partition, 1 MiB of fp32 by
  default; an eighth in a long slice) unless its slice is. Every chunk costs a fixed amount of
  CPU on the worker and the server, whatever its size (two requests, their replies, a round's
  bookkeeping: about 0.25 ms on the worker and 0.16 ms per worker on the server, on loopback:
  docs/performance.md, "Cost of a chunk"). A deeper pipeline brings a step closer to the wire
  floor where many workers share a server's link and CPU is spare (a smaller
  ``partition_elems`` gives one), but on the 2-core development machine at 1 Gbit/s more and
  shorter chunks than these cost more CPU than they gained, except in long slices (see
  :data:`LONG_SLICE_PARTS`; docs/performance.md). With the minimum, a model's many small
  and middle-sized tensors are one or a few chunks each (ResNet-50's 161 tensors: 228 chunks
  on one server, not 633), and keys pushed one after another overlap with each other instead.

Every worker must use the same ``bigarray_bound``, ``partition_elems`` and server addresses (the
client judges from them whether pushes cross a link: ``wire_fraction``); the server checks that
all workers declare the same chunks at init.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

Key = int | str

WORD_ELEMS = 16
"""Elements per 2-bit word; every shard and chunk boundary is a multiple of this."""


def stable_key_hash(key: Key) -> int:
    """A 64-bit hash of ``key`` that is identical on every machine and run.

    ``int`` keys and ``str`` keys are hashed with a type tag, so ``1`` and ``"1"`` differ.
    """
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise TypeError(f"expected int or str for `key`, got {type(key).__name__}")
    if isinstance(key, int):
        data = b"i" + key.to_bytes(8, "little", signed=True)
    else:
        data = b"s" + key.encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def server_for_key(key: Key, num_servers: int) -> int:
    """The server that holds a small (unsplit) key."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    return stable_key_hash(key) % num_servers


def split_bounds(numel: int, parts: int, alignment: int = WORD_ELEMS) -> list[tuple[int, int]]:
    """Cut ``[0, numel)`` into ``parts`` contiguous ranges with boundaries on multiples of
    ``alignment`` (16 by default).

    Ranges are as equal as that granularity allows; some may be empty when
    ``numel < alignment * parts``.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    units = -(-numel // alignment)
    bounds = []
    for i in range(parts):
        start = min(numel, alignment * (units * i // parts))
        stop = min(numel, alignment * (units * (i + 1) // parts))
        bounds.append((start, stop))
    return bounds


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of a key held by one server.

    Attributes:
        index: position among the key's chunks (0-based); names the chunk on the wire.
        server: rank of the server that holds it.
        start: first element (in the flattened key).
        stop: one past the last element.
    """

    index: int
    server: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


SLICE_PARTS = 16
"""A big slice is cut into this many chunks (a step then costs ~1/16 of a slice more), unless
they would be shorter than :func:`min_chunk_elems`."""

RAMP_STEPS = 3
"""A slice starts and ends with chunks of partition / 8, / 4 and / 2 (those above the minimum)."""

MIN_CHUNK_FRACTION = 4
"""No chunk is shorter than ``partition_elems / MIN_CHUNK_FRACTION`` unless its slice is."""


LONG_SLICE_PARTITIONS = 4
"""A slice of a key of at least this many partitions (16 MiB of fp32 by default) is a *long*
slice (:func:`slice_chunking`)."""

LONG_SLICE_PARTS = 32
"""A long slice is cut into this many chunks, none shorter than ``partition_elems /
LONG_MIN_CHUNK_FRACTION``.

A round of a chunk completes only when every worker's push of it arrived, so a step costs
about one round more than the slice's transfer: 1/16 of it with 16 chunks. For a long slice
that round is long in time too, and its chunks are large, so twice as many still cost little
CPU next to their wire time. Slices of compressed pushes, whose rounds are already short on
the wire, and of shorter keys (ResNet-50's tensors), where more and shorter chunks cost more
CPU than they gain, keep 16 chunks (measurements: ``docs/internals.md``, "Chunking")."""

LONG_MIN_CHUNK_FRACTION = 8
"""No chunk of a long slice is shorter than ``partition_elems / LONG_MIN_CHUNK_FRACTION``.

So a long slice's chunks are all about that long, without :func:`chunk_sizes`' ramps, which
were slower there (``docs/internals.md``, "Chunking")."""


def min_chunk_elems(partition_elems: int, fraction: int = MIN_CHUNK_FRACTION) -> int:
    """The shortest chunk a slice is cut into, ``partition_elems / fraction`` elements (a
    multiple of 16)."""
    return max(WORD_ELEMS, partition_elems // fraction // WORD_ELEMS * WORD_ELEMS)


def chunk_sizes(
    length: int, partition_elems: int, min_elems: int = WORD_ELEMS, alignment: int = WORD_ELEMS
) -> list[int]:
    """Chunk lengths of a slice of ``length`` elements.

    Ramps at both ends, ``p/8, p/4, p/2`` first and ``p/2, p/4, p/8`` last (leaving out the
    steps shorter than ``min_elems``), and the rest cut evenly into the fewest chunks of at
    most ``p`` (or, where ``p`` is ``min_elems``, into chunks of at least ``min_elems``). The
    small first chunks let a server's first round of a step complete early; the small last
    chunks keep short the tail after the last push arrives, when each server still has to send
    its last chunk's value to every worker. A ramp step is taken only if what it leaves is
    empty or at least ``min_elems``, so no chunk is shorter than ``min_elems`` unless the slice
    is. Every boundary but the slice's own end is a multiple of ``alignment`` (16 elements;
    ``partition_elems`` must be a multiple of it). The tail past the last such boundary joins
    the last chunk if it is shorter than 16 elements or the chunk stays within
    ``partition_elems``; otherwise (an alignment above 16) it is a chunk of its own.
    """
    unit = alignment
    aligned = length - length % unit
    if aligned == 0:
        return [length]
    head: list[int] = []
    left = aligned
    size = max(unit, (partition_elems >> RAMP_STEPS) // unit * unit)
    while size < min_elems:
        size *= 2
    while size < partition_elems and (left == 2 * size or left >= 2 * size + min_elems):
        head.append(size)
        left -= 2 * size
        size *= 2
    units = left // unit
    parts = -(-left // partition_elems)
    if parts > 1 and units // parts * unit < min_elems:
        # Where p itself is the minimum, even pieces of at most p would fall short of it:
        # take fewer, slightly longer ones (still under 2 x min_elems, below the partition).
        parts = max(1, units // max(1, -(-min_elems // unit)))
    middle = [unit * (units * (i + 1) // parts - units * i // parts) for i in range(parts)]
    sizes = head + middle + head[::-1]
    tail = length - aligned
    if tail < WORD_ELEMS or sizes[-1] + tail <= partition_elems:
        sizes[-1] += tail
    else:
        sizes.append(tail)
    return sizes


def slice_chunking(
    length: int,
    partition_elems: int,
    wire_fraction: float = 1.0,
    key_elems: int | None = None,
    alignment: int = WORD_ELEMS,
) -> tuple[int, int]:
    """The full and the shortest chunk length for a slice of ``length`` elements.

    The full length is ``length / SLICE_PARTS`` (``/ LONG_SLICE_PARTS`` for a long slice)
    within ``[shortest, partition_elems]``, a multiple of ``alignment`` (16; at most
    ``partition_elems``: rounded down where rounding up would pass it); the shortest is
    :func:`min_chunk_elems` of the partition (``LONG_MIN_CHUNK_FRACTION`` of it for a long
    slice). A slice is long when the pushes of its whole key (``key_elems``, by default the
    slice itself) put at least :data:`LONG_SLICE_PARTITIONS` partitions of bytes on the
    network: ``wire_fraction`` is those bytes per value byte (1 dense, 1/16 for 2-bit, 0 where
    every server is on the worker's host), so compressed slices, whose rounds are short on the
    wire, are not long, nor are slices on loopback, where the "wire" is the CPU that more chunks
    would only load.

    Why the whole key: a worker sends the S slices of a split key side by side, and each
    server's round of a chunk waits for that chunk from every worker, so the step trails the
    key's transfer by about one round of every slice at once (the first rounds complete, and
    replies start, only after a chunk of every slice arrived; the last ones leave after the last
    pushes). A key's transfer is as long as its bytes, however many servers share it, and so is
    the time over which finer chunks spread their CPU cost. Counting the slice alone would make
    slices long only for their size, which cut a whole-key ResNet-50 tensor finer than pays
    (``docs/internals.md``, "Chunking").
    """
    whole = length if key_elems is None else max(length, key_elems)
    if whole * wire_fraction >= LONG_SLICE_PARTITIONS * partition_elems:
        parts, shortest = (
            LONG_SLICE_PARTS,
            min_chunk_elems(partition_elems, LONG_MIN_CHUNK_FRACTION),
        )
    else:
        parts, shortest = SLICE_PARTS, min_chunk_elems(partition_elems)
    wanted = -(-length // parts)
    size = min(partition_elems, max(shortest, wanted))
    rounded = -(-size // alignment) * alignment
    if rounded > partition_elems:
        rounded = partition_elems // alignment * alignment
    return max(alignment, rounded), shortest


def partition_elems_for(partition_bytes: int, itemsize: int) -> int:
    """Largest chunk length, in elements, for a partition size in bytes (a multiple of 16)."""
    elems = max(1, partition_bytes // max(1, itemsize))
    return max(WORD_ELEMS, elems // WORD_ELEMS * WORD_ELEMS)


def max_chunk_elems(partition_elems: int) -> int:
    """The longest chunk :func:`plan_chunks` makes with ``partition_elems``: a partition, plus
    the up to 15 elements past a slice's last 16-element boundary that its last chunk takes."""
    return partition_elems + WORD_ELEMS - 1


VALUE_ITEMSIZES = (2, 4, 8)
"""Bytes per element of the value dtypes (float16; float32, int32; float64, int64)."""


def max_payload_bytes(partition_bytes: int) -> int:
    """The largest payload frame a worker with this ``KVSTORE_PARTITION_BYTES`` sends.

    That is the longest chunk's values in the widest dtype: an ``INIT`` carries a chunk's
    values, a dense push too, and every codec's payload of a chunk is at most as large (2-bit:
    a sixteenth; a codec whose payload could be larger must raise this bound). Servers derive
    their message size limit from it (``KVSTORE_MAX_MESSAGE_BYTES``), before any key exists.
    """
    return max(
        max_chunk_elems(partition_elems_for(partition_bytes, size)) * size
        for size in VALUE_ITEMSIZES
    )


def plan_chunks(
    key: Key,
    numel: int,
    num_servers: int,
    *,
    bigarray_bound: int,
    partition_elems: int,
    wire_fraction: float = 1.0,
    alignment: int = WORD_ELEMS,
) -> tuple[Chunk, ...]:
    """All chunks of a key, in element order.

    Args:
        key: the key (its hash places small keys).
        numel: number of elements of the value.
        num_servers: S.
        bigarray_bound: keys with at least this many elements are split over all servers.
        partition_elems: the longest chunk, in elements; must be a positive multiple of 16.
        wire_fraction: bytes a push puts on the network per byte of the value (the key's
            codec's :meth:`~kvstore.codecs.Codec.pushed_fraction`, 0 where every server is on
            the worker's host); decides which slices are long (:func:`slice_chunking`).
        alignment: every chunk boundary but the key's end is a multiple of this (a multiple
            of 16, at most ``partition_elems``; the codec's
            :meth:`~kvstore.codecs.Codec.chunk_alignment`).

    Returns:
        Chunks covering ``[0, numel)`` without gaps; a key of 0 elements has one empty chunk.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if partition_elems < WORD_ELEMS or partition_elems % WORD_ELEMS:
        raise ValueError(
            f"partition_elems must be a positive multiple of 16, got {partition_elems}"
        )
    if alignment < WORD_ELEMS or alignment % WORD_ELEMS or alignment > partition_elems:
        raise ValueError(
            f"alignment must be a positive multiple of 16 of at most partition_elems "
            f"({partition_elems}), got {alignment}"
        )
    if numel >= bigarray_bound and num_servers > 1:
        bounds = split_bounds(numel, num_servers, alignment)
        slices = [(s, lo, hi) for s, (lo, hi) in enumerate(bounds)]
    else:
        slices = [(server_for_key(key, num_servers), 0, numel)]
    chunks: list[Chunk] = []
    for server, lo, hi in slices:
        if hi == lo and numel > 0:
            continue  # a server with nothing of this key
        start = lo
        partition, shortest = slice_chunking(
            hi - lo, partition_elems, wire_fraction, numel, alignment
        )
        for size in chunk_sizes(hi - lo, partition, shortest, alignment):
            chunks.append(Chunk(len(chunks), server, start, start + size))
            start += size
    return tuple(chunks)


def interleaved_order(chunks: Sequence[Chunk]) -> tuple[Chunk, ...]:
    """A key's chunks interleaved over its servers: every slice's first chunk, then every
    slice's second, and so on (the same order on every worker).

    A worker pushes a key's chunks in this order (and the cluster benchmark's bare baseline
    sends them so). The transport's shared window hands them to the connections in this
    order, so every worker pushes a given chunk at about the same time; rounds then complete
    in order, and after the last pushes only the slices' last chunks remain to be returned.
    The order holds on the wire only up to the window and the kernel's send buffers, within
    which TCP shares the uplink among the connections as it likes; ``KVSTORE_SEND_QUEUE_MS``
    narrows both (see the worker's transport).
    """
    first_of_server: dict[int, int] = {}
    for chunk in chunks:
        first_of_server.setdefault(chunk.server, chunk.index)
    return tuple(sorted(chunks, key=lambda c: (c.index - first_of_server[c.server], c.server)))


def replica_servers(shard: int, num_servers: int, replicas: int) -> tuple[int, ...]:
    """The servers that hold shard ``shard`` (the chunks whose primary is server ``shard``)
    with ``replicas`` replicas: its primary, then the next ``replicas - 1`` servers in rank
    order, wrapping around. A lost replica's requests go to the next live one in this order."""
    return tuple((shard + i) % num_servers for i in range(replicas))


def backed_up_shards(server: int, num_servers: int, replicas: int) -> tuple[int, ...]:
    """The shards of which ``server`` holds a backup: those of the ``replicas - 1`` servers
    before it in rank order."""
    return tuple((server - i) % num_servers for i in range(1, replicas))
