"""The wire protocol: the only module that knows how a message is laid out.

A message is a ZeroMQ multipart message::

    +----------------------+-------------+-----+-------------+
    | header (msgpack map) | payload 0   | ... | payload n-1 |
    +----------------------+-------------+-----+-------------+

(on the server's ROUTER socket a routing-identity frame precedes the header; the transport strips
it before calling :func:`decode`).

The header is a msgpack map with short string keys, packed with ``use_bin_type=True`` and
unpacked with ``raw=False, strict_map_key=True``:

==========  ==============================================================================
``v``       protocol version (:data:`PROTOCOL_VERSION`); checked before anything else
``op``      the operation (:class:`Op`)
``id``      request id chosen by the worker, echoed by the reply
...         the op's fields, in the order of :data:`SCHEMA` (key, chunk, dtype, shape, codec...)
``nb``      list of the payload frames' byte lengths
==========  ==============================================================================

Each worker holds two connections to each server: a *data* lane for pushes and inits (bulk
payloads) and a *control* lane for pulls, barriers and the other small requests, so that a pull
request never queues behind megabytes of pushes in one TCP stream. Across two connections
arrival order means nothing, so a PULL says how many of the worker's pushes of the chunk it must
follow (``af``), and a value reply names the push requests it acknowledges (``ak``).

A PULL (or PUSHPULL) may offer to take a *relayed* value (``rx``: at most this many pushes): the
server may then answer with the payloads of the pushes whose decoded sum is the value, in the
order it summed them (``rl``: how many pushes the reply carries; the payload frames are theirs,
push after push) instead of the dense value; see :mod:`kvstore.codecs.base`.

Payloads are raw contiguous buffers (numpy/pinned memory, packed codec words), never embedded in
msgpack, sent with ``copy=False`` and received without copies. Nothing is ever pickled.

:func:`decode` validates every inbound message before anyone acts on it: the version, the op, the
field types (:data:`SCHEMA`; an int field, the version included, refuses floats and bools,
which compare equal to ints), the dtype allowlist, shapes, and that the number and byte length of
the payload frames equal what the header declares. Anything else raises
:class:`~kvstore.errors.ProtocolError` naming what was wrong. Semantic checks that need state (is
the key initialised, does the payload size fit the codec) are the server's, and also happen
before any state changes.

Whatever a peer sends, :func:`decode` raises :class:`~kvstore.errors.ProtocolError` and nothing
else (values are type-checked before any set lookup or comparison), a header over
:data:`MAX_HEADER_BYTES` is refused by its length without being unpacked, and
:func:`peek_request_id` reads a bad message's id from a bounded prefix, so that every malformed
message can be answered. :func:`error` cuts texts to :data:`MAX_TEXT` characters, so an error
reply is always valid.

Changing the bytes of any message (see the golden tests) requires bumping
:data:`PROTOCOL_VERSION`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Generic, TypeGuard, TypeVar

import msgpack
import zmq

from kvstore.errors import ProtocolError

PROTOCOL_VERSION = 6

MAX_HEADER_BYTES = 64 * 1024
MAX_KEY_LENGTH = 1024
MAX_NDIM = 32
MAX_PARAMS = 64
MAX_ACKS = 65536
MAX_TEXT = 4096
"""Longest str field (codec and optimizer names, error messages); :func:`error` truncates."""
MAX_SERVERS = 4096
"""The most server addresses a HELLO may list."""
MAX_PAYLOAD_FRAMES = 4
"""The most payload frames a request may declare (a codec's push has at most two: indices and
values, or scales and codes); the server's admission gate closes a connection whose request
declares more (:func:`declared_payload`)."""
PEEK_BYTES = 256
""":func:`peek_request_id` reads the request id from at most this many leading header bytes."""

LANE_DATA = 0
"""The connection that carries pushes and inits (bulk payloads)."""
LANE_CONTROL = 1
"""The connection that carries pulls, barriers and the other small requests."""

DTYPES: frozenset[str] = frozenset({"float32", "float16", "float64", "int32", "int64"})
"""Value dtypes accepted on the wire."""

MODES: frozenset[str] = frozenset({"dist_sync", "dist_async", "local"})

_NOBLOCK = int(zmq.NOBLOCK)  # an int: ORing or passing pyzmq's enum flags costs a call each

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


class Op(IntEnum):
    """Message operations. Requests go worker -> server (REPLICATE and CATCH_UP server ->
    server, :mod:`kvstore.server.replication`); REPLY and ERROR go back."""

    HELLO = 1
    INIT = 2
    PUSH = 3
    PULL = 4
    PUSHPULL = 5
    BARRIER = 6
    SET_OPTIMIZER = 7
    BYE = 8
    PING = 9
    SAVE = 10
    LOAD = 11
    REPLICATE = 12
    CATCH_UP = 13
    STATE = 14
    REPLY = 16
    ERROR = 17


# Field validators --------------------------------------------------------------------------


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: error texts quote what a peer sent, and a
    peer may send a 60 KiB list where a dtype name belongs."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def _check_key(name: str, value: Any) -> None:
    if isinstance(value, bool):
        raise ProtocolError(f"field {name!r}: a key must be an int or a str, got bool")
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ProtocolError(f"field {name!r}: int key {value} does not fit in 64 bits")
    elif isinstance(value, str):
        if len(value) > MAX_KEY_LENGTH:
            raise ProtocolError(f"field {name!r}: str key longer than {MAX_KEY_LENGTH} characters")
    else:
        raise ProtocolError(
            f"field {name!r}: a key must be an int or a str, got {type(value).__name__}"
        )


def _check_uint(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT64_MAX:
        raise ProtocolError(f"field {name!r} must be a non-negative int, got {_show(value)}")


def _check_bool(name: str, value: Any) -> None:
    if type(value) is not bool:  # (not 1 or 0, which compare equal to True and False)
        raise ProtocolError(f"field {name!r} must be a bool, got {_show(value)}")


def _check_version(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= _INT64_MAX:
        raise ProtocolError(f"field {name!r} must be an int >= -1, got {_show(value)}")


def _check_str(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ProtocolError(f"field {name!r} must be a str, got {type(value).__name__}")
    if len(value) > MAX_TEXT:
        raise ProtocolError(f"field {name!r} is longer than {MAX_TEXT} characters")


# The membership tests below come after a type test: ``value in frozenset`` raises TypeError
# for an unhashable value (a msgpack array or map), which would escape as an unexpected error.


def _check_dtype(name: str, value: Any) -> None:
    if type(value) is not str or value not in DTYPES:
        raise ProtocolError(
            f"field {name!r}: dtype {_show(value)} is not allowed; allowed: {sorted(DTYPES)}"
        )


def _check_mode(name: str, value: Any) -> None:
    if type(value) is not str or value not in MODES:
        raise ProtocolError(f"field {name!r}: mode {_show(value)} is not one of {sorted(MODES)}")


def _check_shape(name: str, value: Any) -> None:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise ProtocolError(f"field {name!r} must be a list of at most {MAX_NDIM} dimensions")
    for dim in value:
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim <= _INT64_MAX:
            raise ProtocolError(f"field {name!r}: dimension {_show(dim)} is not a non-negative int")


def _check_rids(name: str, value: Any) -> None:
    if not isinstance(value, list) or len(value) > MAX_ACKS:
        raise ProtocolError(f"field {name!r} must be a list of at most {MAX_ACKS} request ids")
    for rid in value:
        _check_uint(name, rid)


def _check_addresses(name: str, value: Any) -> None:
    if not isinstance(value, list) or len(value) > MAX_SERVERS:
        raise ProtocolError(f"field {name!r} must be a list of at most {MAX_SERVERS} addresses")
    for address in value:
        _check_str(name, address)


def _check_lane(name: str, value: Any) -> None:
    if type(value) is not int or value not in (LANE_DATA, LANE_CONTROL):  # (not 1.0 or True)
        raise ProtocolError(
            f"field {name!r}: lane {_show(value)} is not {LANE_DATA} or {LANE_CONTROL}"
        )


def _check_params(name: str, value: Any) -> None:
    if not isinstance(value, dict) or len(value) > MAX_PARAMS:
        raise ProtocolError(f"field {name!r} must be a map of at most {MAX_PARAMS} entries")
    for k, v in value.items():
        if not isinstance(k, str):
            raise ProtocolError(f"field {name!r}: parameter names must be str")
        if v is not None and not isinstance(v, bool | int | float | str):
            raise ProtocolError(
                f"field {name!r}: parameter {_show(k)} has unsupported type {type(v).__name__}"
            )


VERSION = _check_version
BOOL = _check_bool

KEY, UINT, STR, DTYPE, SHAPE, PARAMS, MODE, RIDS, LANE, ADDRESSES = (
    _check_key,
    _check_uint,
    _check_str,
    _check_dtype,
    _check_shape,
    _check_params,
    _check_mode,
    _check_rids,
    _check_lane,
    _check_addresses,
)

# The schema: one dataclass per op ---------------------------------------------------------
#
# Each op's header fields are declared once, as a dataclass whose fields carry their wire name
# (the short msgpack key) and validator. Code reads and writes messages through these names
# (``msg.body.after_pushes``); :data:`SCHEMA` is derived from them, and the field order is the
# order in the encoded header. Required fields come first; optional ones default to None and
# are left out of the header when None.


def _wire(name: str, check: Callable[[str, Any], None], *, optional: bool = False) -> Any:
    """A dataclass field sent as header key ``name`` and validated by ``check``."""
    metadata = {"wire": name, "check": check}
    return field(default=None, metadata=metadata) if optional else field(metadata=metadata)


@dataclass(slots=True)
class HelloFields:
    """HELLO: a worker's connection joins the job (one per lane)."""

    rank: int = _wire("r", UINT)
    num_workers: int = _wire("nw", UINT)
    num_servers: int = _wire("ns", UINT)
    server_rank: int = _wire("si", UINT)
    """The server rank this worker expects at this address."""
    mode: str = _wire("m", MODE)
    lane: int = _wire("ln", LANE)
    """Which of the worker's two connections this is (:data:`LANE_DATA`, :data:`LANE_CONTROL`)."""
    partition_bytes: int | None = _wire("pb", UINT, optional=True)
    """The worker's ``KVSTORE_PARTITION_BYTES``, which bounds its largest message: the server
    refuses a worker whose messages could exceed its limit (:mod:`kvstore.topology`)."""
    pushers_per_host: int | None = _wire("ph", UINT, optional=True)
    """How many workers of a host push its sum (k, with hierarchical aggregation: each chunk
    of a round is then pushed once per host, N/k pushes; None: 1, every worker pushes)."""
    replicas: int | None = _wire("rp", UINT, optional=True)
    """R, the servers that hold each shard (``KVSTORE_REPLICAS``; None: 1, no replication)."""
    servers: list[str] | None = _wire("sa", ADDRESSES, optional=True)
    """With R > 1: the job's server addresses in rank order, where a server that was started
    without them learns its backups' addresses."""


@dataclass(slots=True)
class InitFields:
    """INIT: the first value of one chunk of a key (payload: rank 0's value, or none)."""

    key: int | str = _wire("k", KEY)
    chunk: int = _wire("c", UINT)
    """The chunk's index within the key (within this server's slice of it)."""
    offset: int = _wire("o", UINT)
    """The chunk's first element within the key."""
    numel: int = _wire("n", UINT)
    """Elements in the chunk."""
    dtype: str = _wire("dt", DTYPE)
    shape: list[int] = _wire("sh", SHAPE)
    """The whole key's shape."""
    codec: str = _wire("cd", STR)
    codec_params: dict[str, Any] = _wire("cp", PARAMS)
    pull_codec: str | None = _wire("pd", STR, optional=True)
    """Pull compression's codec (:mod:`kvstore.codecs.pulled`); None: dense pulls."""
    pull_params: dict[str, Any] | None = _wire("pp", PARAMS, optional=True)
    averaged: bool | None = _wire("av", BOOL, optional=True)
    """True: the chunk holds the mean of the workers' pushes and the server optimizer never
    touches it (``kv.init(..., averaged=True)``); None or False: a normal key."""
    shard: int | None = _wire("sd", UINT, optional=True)
    """With replication: the rank of the chunk's primary server, where this server holds a
    backup of it; None: this server is its primary."""


@dataclass(slots=True)
class PushFields:
    """PUSH: one worker's encoded gradient of one chunk (payloads: the codec's frames)."""

    key: int | str = _wire("k", KEY)
    chunk: int = _wire("c", UINT)
    numel: int = _wire("n", UINT)
    sequence: int | None = _wire("sq", UINT, optional=True)
    """With replication: this push's number among the worker's pushes of the chunk (from 1),
    by which a replica that takes over recognises a push it already applied."""


@dataclass(slots=True)
class PullFields:
    """PULL: ask for one chunk's value."""

    key: int | str = _wire("k", KEY)
    chunk: int = _wire("c", UINT)
    after_pushes: int = _wire("af", UINT)
    """Answer once this many of the worker's pushes of the chunk are applied."""
    relay_limit: int | None = _wire("rx", UINT, optional=True)
    """A relayed value of at most this many pushes is welcome; None: dense only."""
    held_version: int | None = _wire("pv", VERSION, optional=True)
    """With pull compression: the ``w_pub`` version the worker holds (-1: none yet)."""


@dataclass(slots=True)
class PushPullFields:
    """PUSHPULL: a PUSH whose reply is the value of the round it completes."""

    key: int | str = _wire("k", KEY)
    chunk: int = _wire("c", UINT)
    numel: int = _wire("n", UINT)
    relay_limit: int | None = _wire("rx", UINT, optional=True)
    held_version: int | None = _wire("pv", VERSION, optional=True)
    sequence: int | None = _wire("sq", UINT, optional=True)
    """As :attr:`PushFields.sequence`."""


@dataclass(slots=True)
class BarrierFields:
    """BARRIER: answered once every worker of the job asked."""


@dataclass(slots=True)
class SetOptimizerFields:
    """SET_OPTIMIZER: the server optimizer (collective; equal on all workers)."""

    name: str = _wire("opt", STR)
    hyperparameters: dict[str, Any] = _wire("hp", PARAMS)


@dataclass(slots=True)
class ByeFields:
    """BYE: the worker leaves the job."""


@dataclass(slots=True)
class PingFields:
    """PING: a worker's heartbeat (:mod:`kvstore.heartbeat`), answered with an empty REPLY."""


@dataclass(slots=True)
class SaveFields:
    """SAVE: write this server's shard of a checkpoint (collective, :mod:`kvstore.checkpoint`)."""

    path: str = _wire("p", STR)
    """The staging directory the server writes its shard into."""
    failure: str | None = _wire("er", STR, optional=True)
    """This worker could not do its own part: the server refuses the whole collective, naming
    the rank and this text."""
    shards: list[int] | None = _wire("sd", RIDS, optional=True)
    """With replication: the shards this server answers for as the worker sees it (a lost
    server's shard is answered by its live replica, which writes that shard's part too)."""
    retry: bool | None = _wire("rt", BOOL, optional=True)
    """True: sent again to a live replica for ``shards`` after their server was lost during
    the call; done for this worker alone, not gathered from all (some workers may have had
    the lost server's answer)."""


@dataclass(slots=True)
class LoadFields:
    """LOAD: restore this server's shard of a checkpoint, in phases (collective)."""

    path: str = _wire("p", STR)
    """The checkpoint directory the server reads its shard from."""
    phase: int = _wire("ph", UINT)
    """0: read and check, 1: commit, 2: abort."""
    failure: str | None = _wire("er", STR, optional=True)
    """As :attr:`SaveFields.failure`."""
    shards: list[int] | None = _wire("sd", RIDS, optional=True)
    """As :attr:`SaveFields.shards` (a server loads the part of every shard it holds)."""
    retry: bool | None = _wire("rt", BOOL, optional=True)
    """As :attr:`SaveFields.retry` (a replica already loads every shard it holds: it only
    acknowledges)."""


@dataclass(slots=True)
class ReplicateFields:
    """REPLICATE: a primary server hands one finished round of a chunk to a backup, which
    replays it (:mod:`kvstore.server.replication`). The payload is one frame: the round's
    pushes' frames, each starting at a multiple of 64 bytes, in the order they were summed
    (``kind`` 2), or the round's dense sum (``kind`` 1); none for a round that failed
    (``kind`` 0)."""

    key: int | str = _wire("k", KEY)
    chunk: int = _wire("c", UINT)
    kind: int = _wire("kd", UINT)
    ranks: list[int] = _wire("rk", RIDS)
    """The ranks whose pushes the round counted, in the order they were summed."""
    sizes: list[int] = _wire("sz", RIDS)
    """Bytes of each push's frames, push after push (``kind`` 2)."""
    frames: list[int] = _wire("fc", RIDS)
    """How many frames each push has (``kind`` 2)."""
    updates: int = _wire("up", UINT)
    """The chunk's rounds before this one, which the backup must also have had."""


@dataclass(slots=True)
class CatchUpFields:
    """CATCH_UP: a server that joins a running job asks a replica for the state of one shard
    (the reply carries a snapshot of it, and the replica forwards its later rounds)."""

    shard: int = _wire("sd", UINT)
    address: str = _wire("ad", STR)
    """Where the joining server serves (the replica's link to it connects there)."""


@dataclass(slots=True)
class StateFields:
    """STATE: one part of a chunk's state, from a replica to a server it catches up (payload:
    the part's bytes; part ``meta`` is msgpack, ``end`` has none and commits the chunk)."""

    key: int | str = _wire("k", KEY)
    chunk: int = _wire("c", UINT)
    part: str = _wire("pt", STR)


@dataclass(slots=True)
class ReplyFields:
    """REPLY: the answer to a request (payloads: a value, when the request asked for one)."""

    server_rank: int | None = _wire("sr", UINT, optional=True)
    """(To a HELLO) the answering server's rank."""
    acks: list[int] | None = _wire("ak", RIDS, optional=True)
    """Ids of push requests this (value) reply also acknowledges."""
    relayed: int | None = _wire("rl", UINT, optional=True)
    """The value is relayed: the payloads are those of this many pushes, to decode and sum."""
    heartbeat_ms: int | None = _wire("hb", UINT, optional=True)
    """(To a HELLO) the server's heartbeat timeout in ms (None: off); the worker pings it often
    enough for it, whatever its own setting."""
    pull_kind: int | None = _wire("pc", UINT, optional=True)
    """A compressed pull's reply kind: 0 dense ``w_pub``, 1 delta, 2 unchanged."""
    version: int | None = _wire("pv", UINT, optional=True)
    """The ``w_pub`` version a compressed pull's reply brings."""
    base_version: int | None = _wire("pb", VERSION, optional=True)
    """The ``w_pub`` version a delta applies to."""
    incarnation: int | None = _wire("ic", UINT, optional=True)
    """(To a HELLO, with replication) a number the server process drew at its start: a worker
    tells a lost server's replacement from the lost process itself, which a stop only paused."""


@dataclass(slots=True)
class ErrorFields:
    """ERROR: a request failed."""

    code: str = _wire("code", STR)
    """An :class:`~kvstore.errors.ErrorCode` value."""
    message: str = _wire("msg", STR)
    lost_rank: int | None = _wire("lr", UINT, optional=True)
    """The worker rank that was lost (code ``worker_lost``)."""


Fields = (
    HelloFields
    | InitFields
    | PushFields
    | PullFields
    | PushPullFields
    | BarrierFields
    | SetOptimizerFields
    | ByeFields
    | PingFields
    | SaveFields
    | LoadFields
    | ReplicateFields
    | CatchUpFields
    | StateFields
    | ReplyFields
    | ErrorFields
)
"""The typed header of any message."""

FIELDS_OF: dict[Op, type] = {
    Op.HELLO: HelloFields,
    Op.INIT: InitFields,
    Op.PUSH: PushFields,
    Op.PULL: PullFields,
    Op.PUSHPULL: PushPullFields,
    Op.BARRIER: BarrierFields,
    Op.SET_OPTIMIZER: SetOptimizerFields,
    Op.BYE: ByeFields,
    Op.PING: PingFields,
    Op.SAVE: SaveFields,
    Op.LOAD: LoadFields,
    Op.REPLICATE: ReplicateFields,
    Op.CATCH_UP: CatchUpFields,
    Op.STATE: StateFields,
    Op.REPLY: ReplyFields,
    Op.ERROR: ErrorFields,
}
"""Each op's fields dataclass."""

OP_OF: dict[type, Op] = {cls: op for op, cls in FIELDS_OF.items()}

SCHEMA: dict[Op, tuple[tuple[str, Any, bool], ...]] = {
    op: tuple(
        (f.metadata["wire"], f.metadata["check"], f.default is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    )
    for op, cls in FIELDS_OF.items()
}
"""Per op: (wire name, validator, required), in header order; derived from :data:`FIELDS_OF`."""

_WIRE_NAMES: dict[Op, tuple[tuple[str, str], ...]] = {
    op: tuple((f.metadata["wire"], f.name) for f in dataclasses.fields(cls))
    for op, cls in FIELDS_OF.items()
}
"""Per op: (wire name, attribute name) pairs, in header order."""

# Ops whose payload frame count is fixed by the protocol (others depend on the codec).
_PAYLOAD_COUNT: dict[Op, tuple[int, ...]] = {
    Op.HELLO: (0,),
    Op.INIT: (0, 1),
    Op.PULL: (0,),
    Op.BARRIER: (0,),
    Op.SET_OPTIMIZER: (0,),
    Op.BYE: (0,),
    Op.PING: (0,),
    Op.SAVE: (0,),
    Op.LOAD: (0,),
    Op.REPLICATE: (0, 1),
    Op.CATCH_UP: (0,),
    Op.STATE: (0, 1),
    Op.ERROR: (0,),
}


F = TypeVar("F", bound=Fields)


@dataclass(slots=True)
class Message(Generic[F]):
    """A decoded, validated message.

    Attributes:
        op: the operation.
        rid: the request id.
        body: the op's header fields, by name (the op's dataclass in :data:`FIELDS_OF`).
        fields: the same fields under their wire names, as they arrived (for protocol tests
            and error texts; code reads :attr:`body`).
        payloads: the payload frames (``zmq.Frame``, bytes or memoryviews), in order.
    """

    op: Op
    rid: int
    body: F
    fields: dict[str, Any]
    payloads: list[Any]


def buffer_nbytes(buffer: Any) -> int:
    """Byte length of a buffer (bytes, numpy array, memoryview or zmq.Frame)."""
    kind = type(buffer)
    if kind is bytes or kind is bytearray or kind is zmq.Frame:
        # A Frame's len() is its size in bytes. Asking it for ``nbytes`` first would cost an
        # AttributeError and a memoryview on every received payload.
        return len(buffer)
    nbytes = getattr(buffer, "nbytes", None)  # numpy, memoryview
    if nbytes is not None:
        return nbytes
    buf = getattr(buffer, "buffer", None)  # a zmq.Frame subclass
    if buf is not None:
        return memoryview(buf).nbytes
    return memoryview(buffer).nbytes


def recv_frames(sock: Any) -> list[Any]:
    """Receive one multipart message without blocking (raises ``zmq.Again`` if none).

    Same as ``sock.recv_multipart(zmq.NOBLOCK, copy=False)``, but reads each frame's ``more``
    flag instead of querying the socket option per frame, which costs more than the receive.
    """
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def _header_bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    raw = getattr(frame, "bytes", None)  # zmq.Frame
    if isinstance(raw, bytes):
        return raw
    return bytes(memoryview(frame))


def _is_uint(value: Any) -> TypeGuard[int]:
    """The common case of :func:`_check_uint`: a plain int in ``[0, 2**63)`` (:func:`_copy_fields`
    tests it inline, to save a call per field)."""
    return type(value) is int and 0 <= value <= _INT64_MAX


_OPS: dict[int, Op] = {int(op): op for op in Op}
"""Ops by wire value: a dict lookup instead of an ``Op(...)`` call for every message."""

_INT_OK, _KEY_OK = 1, 2
"""Values of :data:`_FIELDS`' fourth item: a plain int in ``[0, 2**63)`` is valid without its
validator (UINT and KEY fields); so is a ``str`` of at most :data:`MAX_KEY_LENGTH` characters
(KEY fields)."""

_FIELDS: dict[Op, tuple[tuple[str, Any, bool, int], ...]] = {
    op: tuple(
        (name, check, required, _KEY_OK if check is KEY else _INT_OK if check is UINT else 0)
        for name, check, required in schema
    )
    for op, schema in SCHEMA.items()
}
""":data:`SCHEMA` with a fourth item per field, which values of the common kinds are valid
without calling the validator (most fields of every message are UINT or KEY);
:func:`_copy_fields` tests them inline. Anything else still goes to the validator, so errors
and their messages are unchanged."""

_KNOWN: dict[Op, frozenset[str]] = {
    op: frozenset(name for name, _, _ in schema) for op, schema in SCHEMA.items()
}

_packers = threading.local()


def _pack(header: dict[str, Any]) -> bytes:
    """``msgpack.packb(header, use_bin_type=True)`` with a packer kept per thread (a new
    Packer per message costs as much as the packing)."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(header)


def _copy_fields(op: Op, source: dict[str, Any], target: dict[str, Any]) -> None:
    """Validate the fields of ``op`` found in ``source`` and copy them into ``target``.

    Raises:
        ProtocolError: a required field is missing or a value is invalid.
    """
    for name, check, required, fast in _FIELDS[op]:
        if name in source:
            value = source[name]
            kind = type(value)
            if not (
                (fast and kind is int and 0 <= value <= _INT64_MAX)
                or (fast == _KEY_OK and kind is str and len(value) <= MAX_KEY_LENGTH)
            ):
                check(name, value)
            target[name] = value
        elif required:
            raise ProtocolError(f"{op.name}: missing field {name!r}")


def encode(
    op: Op, rid: int, fields: dict[str, Any] | None = None, payloads: Sequence[Any] = ()
) -> list[Any]:
    """Build the frames of one message.

    Args:
        op: the operation.
        rid: the request id (a reply echoes the request's).
        fields: the op's header fields; validated against :data:`SCHEMA`.
        payloads: buffers (numpy arrays, bytes, memoryviews); they are not copied.

    Returns:
        ``[header, *payloads]``, ready for ``send_multipart(..., copy=False)``.

    Raises:
        ProtocolError: a field is missing, unknown or of the wrong type.
    """
    fields = fields or {}
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": int(op), "id": rid}
    if not _is_uint(rid):
        _check_uint("id", rid)
    if not _KNOWN[op].issuperset(fields):
        unknown = set(fields) - _KNOWN[op]
        raise ProtocolError(f"{op.name}: unknown fields {sorted(unknown)}")
    _copy_fields(op, fields, header)
    header["nb"] = [buffer_nbytes(p) for p in payloads]
    return [_pack(header), *payloads]


def wire_fields(body: Fields) -> dict[str, Any]:
    """``body``'s fields under their wire names, None (absent optional) ones left out."""
    values = {}
    for wire_name, name in _WIRE_NAMES[OP_OF[type(body)]]:
        value = getattr(body, name)
        if value is not None:
            values[wire_name] = value
    return values


def request(rid: int, body: Fields, payloads: Sequence[Any] = ()) -> list[Any]:
    """Build the frames of one message whose op is given by ``body``'s type (e.g.
    :class:`PullFields` -> PULL); see :func:`encode`."""
    return encode(OP_OF[type(body)], rid, wire_fields(body), payloads)


def _body(op: Op, values: dict[str, Any]) -> Any:
    """The op's dataclass holding the validated wire ``values``."""
    return FIELDS_OF[op](*[values.get(wire_name) for wire_name, _ in _WIRE_NAMES[op]])


def decode(frames: Sequence[Any]) -> Message:
    """Validate and decode one message (without the ROUTER identity frame).

    A header over :data:`MAX_HEADER_BYTES` is refused by its length, before anything reads it.

    Raises:
        ProtocolError: naming the first thing wrong with the message (whatever the header
            holds: no other exception escapes).
    """
    if not frames:
        raise ProtocolError("empty message: expected a header frame")
    size = buffer_nbytes(frames[0])
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {size} bytes exceeds the {MAX_HEADER_BYTES} limit")
    raw = _header_bytes(frames[0])
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack: {_show(exc, 200)}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    try:
        return _decode_header(header, frames)
    except ProtocolError:
        raise
    except Exception as exc:  # a validator missed an odd value: still a bad message, not a crash
        raise ProtocolError(f"malformed header: {type(exc).__name__}: {_show(exc, 200)}") from exc


def declared_payload(raw: bytes, max_frame: int | None) -> tuple[int, int] | None:
    """The payload frames and bytes that the request header ``raw`` declares (its ``nb``), if
    its op's schema allows them: at most the op's payload frame count (:data:`MAX_PAYLOAD_FRAMES`
    where the codec decides), each of at most ``max_frame`` bytes (None: any). None for anything
    else: not msgpack, not a map, no known op, an ``nb`` that is not such a list.

    The server's admission gate calls it on a header as soon as it arrives, before it lets the
    rest of the message in; :func:`decode` checks the whole message later, with its reasons.
    """
    if len(raw) > MAX_HEADER_BYTES:
        return None
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception:  # msgpack raises several unrelated types
        return None
    if not isinstance(header, dict):
        return None
    raw_op = header.get("op")
    op = _OPS.get(raw_op) if type(raw_op) is int else None
    nbytes = header.get("nb")
    if op is None or not isinstance(nbytes, list):
        return None
    counts = _PAYLOAD_COUNT.get(op)
    if len(nbytes) > (max(counts) if counts is not None else MAX_PAYLOAD_FRAMES):
        return None
    total = 0
    for declared in nbytes:
        if type(declared) is not int or declared < 0:
            return None
        if max_frame is not None and declared > max_frame:
            return None
        total += declared
    return len(nbytes), total


def _decode_header(header: dict[Any, Any], frames: Sequence[Any]) -> Message:
    """The checks of :func:`decode` after the header was unpacked into a map."""
    version = header.get("v")
    if type(version) is not int:  # (5.0 and True compare equal to ints, so test the type first)
        raise ProtocolError(f"field 'v' (protocol version) must be an int, got {_show(version)}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {_show(version)} is not supported (this side speaks version "
            f"{PROTOCOL_VERSION}); run the same pskv version on workers and servers"
        )
    raw_op = header.get("op")
    op = _OPS.get(raw_op) if type(raw_op) is int else None  # (not True, 1.0 or a list)
    if op is None:
        raise ProtocolError(f"unknown op {_show(raw_op)}")
    rid = header.get("id")
    if not _is_uint(rid):
        raise ProtocolError(f"field 'id' must be a non-negative int, got {_show(rid)}")
    nbytes = header.get("nb")
    if not isinstance(nbytes, list):
        raise ProtocolError("field 'nb' (payload lengths) is missing or not a list")
    payloads = list(frames[1:])
    if len(nbytes) != len(payloads):
        raise ProtocolError(
            f"{op.name}: header declares {len(nbytes)} payload frames but {len(payloads)} arrived"
        )
    for i, (declared, frame) in enumerate(zip(nbytes, payloads, strict=True)):
        if not (type(declared) is int and 0 <= declared <= _INT64_MAX):
            _check_uint("nb", declared)
        actual = buffer_nbytes(frame)
        if actual != declared:
            raise ProtocolError(
                f"{op.name}: payload {i} has {actual} bytes but the header declares {declared}"
            )
    allowed_counts = _PAYLOAD_COUNT.get(op)
    if allowed_counts is not None and len(payloads) not in allowed_counts:
        raise ProtocolError(f"{op.name} carries {len(payloads)} payload frames")
    fields: dict[str, Any] = {}
    _copy_fields(op, header, fields)
    # v, op, id and nb are present (checked above), so any other key is one too many.
    if len(header) != 4 + len(fields):
        # (key=repr: the keys may mix str and bytes, which do not compare)
        unknown = sorted(set(header) - {"v", "op", "id", "nb"} - set(fields), key=repr)
        raise ProtocolError(f"{op.name}: unknown fields {_show(unknown, 200)}")
    return Message(op=op, rid=rid, body=_body(op, fields), fields=fields, payloads=payloads)


def reply(rid: int, body: ReplyFields | None = None, payloads: Sequence[Any] = ()) -> list:
    """Frames of a REPLY to request ``rid``."""
    return encode(Op.REPLY, rid, None if body is None else wire_fields(body), payloads)


def error(rid: int, code: str, message: str, lost_rank: int | None = None) -> list:
    """Frames of an ERROR reply to request ``rid`` (``lost_rank``: the worker rank a
    ``worker_lost`` error names)."""
    if len(message) > MAX_TEXT:  # (a message quoting long keys must not make the reply invalid)
        message = message[: MAX_TEXT - 16] + " ... (truncated)"
    return request(rid, ErrorFields(code=str(code), message=message, lost_rank=lost_rank))


def peek_request_id(frames: Sequence[Any]) -> int:
    """Best-effort request id of a message that failed validation (0 when unreadable).

    Lets the server address its error reply to the request the worker is waiting on. Reads
    only the first :data:`PEEK_BYTES` bytes of the header and the first entries of its map
    (:func:`encode` puts ``id`` third), so a huge or hostile header costs no more than a small
    one: it is never unpacked as a whole.
    """
    try:
        first = frames[0]
        if isinstance(first, bytes):
            prefix = first[:PEEK_BYTES]
        else:  # a zmq.Frame (its buffer) or any other buffer: slice without copying it all
            prefix = memoryview(getattr(first, "buffer", first)).cast("B")[:PEEK_BYTES].tobytes()
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=PEEK_BYTES)
        unpacker.feed(prefix)
        for _ in range(min(unpacker.read_map_header(), 8)):
            if unpacker.unpack() == "id":
                rid = unpacker.unpack()
                return rid if type(rid) is int and 0 <= rid <= _INT64_MAX else 0
            unpacker.skip()
        return 0
    except Exception:  # not a map, cut off by the prefix, anything else: no id
        return 0
