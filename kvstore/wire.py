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

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeGuard, TypeVar

import msgpack
import zmq

from kvstore.errors import ProtocolError
from kvstore.wire_schema import (
    _INT64_MAX as _INT64_MAX,
)
from kvstore.wire_schema import (
    _INT64_MIN as _INT64_MIN,
)
from kvstore.wire_schema import (
    _PAYLOAD_COUNT as _PAYLOAD_COUNT,
)
from kvstore.wire_schema import (
    _WIRE_NAMES as _WIRE_NAMES,
)
from kvstore.wire_schema import (  # (re-exported: the schema is part of the protocol)
    ADDRESSES as ADDRESSES,
)
from kvstore.wire_schema import (
    BOOL as BOOL,
)
from kvstore.wire_schema import (
    DTYPE as DTYPE,
)
from kvstore.wire_schema import (
    DTYPES as DTYPES,
)
from kvstore.wire_schema import (
    FIELDS_OF as FIELDS_OF,
)
from kvstore.wire_schema import (
    KEY as KEY,
)
from kvstore.wire_schema import (
    LANE as LANE,
)
from kvstore.wire_schema import (
    LANE_CONTROL as LANE_CONTROL,
)
from kvstore.wire_schema import (
    LANE_DATA as LANE_DATA,
)
from kvstore.wire_schema import (
    MAX_ACKS as MAX_ACKS,
)
from kvstore.wire_schema import (
    MAX_KEY_LENGTH as MAX_KEY_LENGTH,
)
from kvstore.wire_schema import (
    MAX_NDIM as MAX_NDIM,
)
from kvstore.wire_schema import (
    MAX_PARAMS as MAX_PARAMS,
)
from kvstore.wire_schema import (
    MAX_PAYLOAD_FRAMES as MAX_PAYLOAD_FRAMES,
)
from kvstore.wire_schema import (
    MAX_SERVERS as MAX_SERVERS,
)
from kvstore.wire_schema import (
    MAX_TEXT as MAX_TEXT,
)
from kvstore.wire_schema import (
    MODE as MODE,
)
from kvstore.wire_schema import (
    MODES as MODES,
)
from kvstore.wire_schema import (
    OP_OF as OP_OF,
)
from kvstore.wire_schema import (
    PARAMS as PARAMS,
)
from kvstore.wire_schema import (
    RIDS as RIDS,
)
from kvstore.wire_schema import (
    SCHEMA as SCHEMA,
)
from kvstore.wire_schema import (
    SHAPE as SHAPE,
)
from kvstore.wire_schema import (
    STR as STR,
)
from kvstore.wire_schema import (
    UINT as UINT,
)
from kvstore.wire_schema import (
    VERSION as VERSION,
)
from kvstore.wire_schema import (
    BarrierFields as BarrierFields,
)
from kvstore.wire_schema import (
    ByeFields as ByeFields,
)
from kvstore.wire_schema import (
    CatchUpFields as CatchUpFields,
)
from kvstore.wire_schema import (
    ErrorFields as ErrorFields,
)
from kvstore.wire_schema import (
    Fields as Fields,
)
from kvstore.wire_schema import (
    HelloFields as HelloFields,
)
from kvstore.wire_schema import (
    InitFields as InitFields,
)
from kvstore.wire_schema import (
    LoadFields as LoadFields,
)
from kvstore.wire_schema import (
    Op as Op,
)
from kvstore.wire_schema import (
    PingFields as PingFields,
)
from kvstore.wire_schema import (
    PullFields as PullFields,
)
from kvstore.wire_schema import (
    PushFields as PushFields,
)
from kvstore.wire_schema import (
    PushPullFields as PushPullFields,
)
from kvstore.wire_schema import (
    ReplicateFields as ReplicateFields,
)
from kvstore.wire_schema import (
    ReplyFields as ReplyFields,
)
from kvstore.wire_schema import (
    SaveFields as SaveFields,
)
from kvstore.wire_schema import (
    SetOptimizerFields as SetOptimizerFields,
)
from kvstore.wire_schema import (
    StateFields as StateFields,
)
from kvstore.wire_schema import (
    TakenOverFields as TakenOverFields,
)
from kvstore.wire_schema import (
    _check_addresses as _check_addresses,
)
from kvstore.wire_schema import (
    _check_bool as _check_bool,
)
from kvstore.wire_schema import (
    _check_dtype as _check_dtype,
)
from kvstore.wire_schema import (
    _check_key as _check_key,
)
from kvstore.wire_schema import (
    _check_lane as _check_lane,
)
from kvstore.wire_schema import (
    _check_mode as _check_mode,
)
from kvstore.wire_schema import (
    _check_params as _check_params,
)
from kvstore.wire_schema import (
    _check_rids as _check_rids,
)
from kvstore.wire_schema import (
    _check_shape as _check_shape,
)
from kvstore.wire_schema import (
    _check_str as _check_str,
)
from kvstore.wire_schema import (
    _check_uint as _check_uint,
)
from kvstore.wire_schema import (
    _check_version as _check_version,
)
from kvstore.wire_schema import (
    _show as _show,
)
from kvstore.wire_schema import (
    _wire as _wire,
)

PROTOCOL_VERSION = 6

MAX_HEADER_BYTES = 64 * 1024
PEEK_BYTES = 256
""":func:`peek_request_id` reads the request id from at most this many leading header bytes."""

_NOBLOCK = int(zmq.NOBLOCK)  # an int: ORing or passing pyzmq's enum flags costs a call each
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
