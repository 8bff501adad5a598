"""The wire protocol's schema: every op, and each op's header fields with their wire names
and validators (:mod:`kvstore.wire` encodes and decodes messages with it).

Each op's header fields are declared once, as a dataclass whose fields carry their wire name
(the short msgpack key) and validator; :data:`SCHEMA` is derived from them. The validators
type-check before any set lookup or comparison, so that whatever a peer sends they raise
:class:`~kvstore.errors.ProtocolError` and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from kvstore.errors import ProtocolError

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

LANE_DATA = 0
"""The connection that carries pushes and inits (bulk payloads)."""
LANE_CONTROL = 1
"""The connection that carries pulls, barriers and the other small requests."""

DTYPES: frozenset[str] = frozenset({"float32", "float16", "float64", "int32", "int64"})
"""Value dtypes accepted on the wire."""

MODES: frozenset[str] = frozenset({"dist_sync", "dist_async", "local"})


_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


class Op(IntEnum):
    """Message operations. Requests go worker -> server (REPLICATE, CATCH_UP, STATE and
    TAKEN_OVER server -> server, :mod:`kvstore.server.replication`); REPLY and ERROR go back."""

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
    TAKEN_OVER = 15
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
class TakenOverFields:
    """TAKEN_OVER: a replica that took a shard over (a worker counted the servers before it
    lost) tells them so; one that still answers for it stops, and fails what waits on it
    there with ``shard_moved``."""

    shard: int = _wire("sd", UINT)
    server: int = _wire("sv", UINT)
    """The server that answers for the shard now."""


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
    | TakenOverFields
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
    Op.TAKEN_OVER: TakenOverFields,
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
    Op.TAKEN_OVER: (0,),
    Op.ERROR: (0,),
}
