"""Every header field refuses every wrong type.

For each field of each op's schema (derived from :data:`kvstore.wire.SCHEMA`, so that a new
field is covered as soon as it is declared) and for the envelope fields (``v``, ``op``, ``id``,
``nb``), a header that is valid except for that one field must make :func:`kvstore.wire.decode`
raise :class:`~kvstore.errors.ProtocolError` naming the field: never another exception, never
an accepted message. :func:`kvstore.wire.encode` must refuse the same values, so that a worker
cannot send what a server refuses.

The wrong values are a deterministic table: every msgpack type (nil, bool, int at and past the
bounds, float, str, bin, array, map, ext, timestamp, nested containers) that the field's kind
does not accept, and the values of an accepted type that are out of range.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from kvstore import wire
from kvstore.errors import ProtocolError
from kvstore.wire import Op

V = wire.PROTOCOL_VERSION
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1  # the largest int msgpack can carry: past every int field's range

Check = Callable[[str, Any], None]

# One value of every msgpack type, some nested. A field refuses those whose exact type its
# kind does not accept (``ACCEPTS``); bool is never an int here, although Python says it is.
EVERY_TYPE: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    5,
    0.0,
    1.0,
    5.0,
    -1.5,
    math.nan,
    math.inf,
    "",
    "0",
    "float32",
    b"",
    b"0",
    b"float32",
    [],
    [0],
    [[0]],
    [None],
    {},
    {"a": 0},
    {"a": {"b": [1, {"c": None}]}},
    msgpack.ExtType(5, b"x"),
    msgpack.Timestamp(0, 0),
]

ACCEPTS: dict[Check, tuple[type, ...]] = {
    wire.UINT: (int,),
    wire.VERSION: (int,),
    wire.LANE: (int,),
    wire.KEY: (int, str),
    wire.STR: (str,),
    wire.DTYPE: (str,),
    wire.MODE: (str,),
    wire.SHAPE: (list,),
    wire.RIDS: (list,),
    wire.ADDRESSES: (list,),
    wire.PARAMS: (dict,),
    wire.BOOL: (bool,),
}
"""Per field kind (its validator): the exact types some of whose values are valid."""

OUT_OF_RANGE: dict[Check, list[Any]] = {
    wire.UINT: [-1, -(2**63), INT64_MAX + 1, UINT64_MAX],
    wire.VERSION: [-2, -(2**63), INT64_MAX + 1, UINT64_MAX],
    wire.LANE: [-1, 2, INT64_MAX, UINT64_MAX],
    wire.KEY: [INT64_MAX + 1, UINT64_MAX, "k" * (wire.MAX_KEY_LENGTH + 1)],
    wire.STR: ["x" * (wire.MAX_TEXT + 1)],
    wire.DTYPE: ["", "float128", "FLOAT32", "float32 ", "object"],
    wire.MODE: ["", "sync", "DIST_SYNC", "dist_sync\x00"],
    wire.SHAPE: [
        [True],
        [1.0],
        [-1],
        [UINT64_MAX],
        [None],
        ["4"],
        [b"4"],
        [[4]],
        [{}],
        [4, 4.0],
        [1] * (wire.MAX_NDIM + 1),
    ],
    wire.RIDS: [
        [True],
        [1.0],
        [-1],
        [UINT64_MAX],
        [None],
        ["1"],
        [[1]],
        [{}],
        [1, 2.0],
    ],  # (a list over MAX_ACKS does not fit in a header: see the test of its own below)
    wire.ADDRESSES: [
        [1],
        [None],
        [b"tcp://h:1"],
        [["tcp://h:1"]],
        ["x" * (wire.MAX_TEXT + 1)],
        ["tcp://h:1"] * (wire.MAX_SERVERS + 1),
    ],
    wire.PARAMS: [
        {b"lr": 0.1},
        {"lr": [0.1]},
        {"lr": {"x": 1}},
        {"lr": b"x"},
        {"lr": msgpack.ExtType(1, b"")},
        {"lr": msgpack.Timestamp(1, 0)},
        {f"p{i}": 0 for i in range(wire.MAX_PARAMS + 1)},
    ],
    wire.BOOL: [],  # (both bools are valid; 0 and 1, equal to them, are refused as ints)
}
"""Per field kind: values of an accepted type that are still invalid."""

VALID: dict[Check, Any] = {
    wire.UINT: 0,
    wire.VERSION: -1,
    wire.LANE: 1,
    wire.KEY: "w",
    wire.STR: "x",
    wire.DTYPE: "float32",
    wire.MODE: "dist_sync",
    wire.SHAPE: [4],
    wire.RIDS: [1],
    wire.ADDRESSES: ["tcp://h:1"],
    wire.PARAMS: {"lr": 0.1},
    wire.BOOL: True,
}
"""Per field kind: a valid value, to build headers that are valid but for one field."""


def wrong_values(check: Check) -> list[Any]:
    """Every value a field validated by ``check`` must refuse."""
    accepted = ACCEPTS[check]
    return [v for v in EVERY_TYPE if type(v) not in accepted] + OUT_OF_RANGE[check]


def valid_fields(op: Op) -> dict[str, Any]:
    """A valid value for every field of ``op``, optional ones included."""
    return {name: VALID[check] for name, check, _ in wire.SCHEMA[op]}


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (some wrong values are 64 KiB long)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def packed(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def header_of(of: Op, fields: dict[str, Any], **envelope: Any) -> dict[str, Any]:
    """A header of op ``of`` (id 7, no payloads), ``envelope`` replacing ``v``, ``op``..."""
    return {"v": V, "op": int(of), "id": 7, **fields, "nb": [], **envelope}


OP_FIELDS = [
    pytest.param(op, name, check, id=f"{op.name}.{name}")
    for op, schema in wire.SCHEMA.items()
    for name, check, _ in schema
]


def test_every_field_kind_has_a_table_entry():
    """A new kind of field needs its wrong values here before it is covered."""
    kinds = {check for schema in wire.SCHEMA.values() for _, check, _ in schema}
    for table in (ACCEPTS, OUT_OF_RANGE, VALID):
        assert kinds <= set(table), f"no entry for {kinds - set(table)}"


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.name)
def test_the_valid_headers_are_accepted(op):
    """The fuzzing below starts from these: each must be valid as it is."""
    msg = wire.decode([packed(header_of(op, valid_fields(op)))])
    assert msg.op is op and msg.fields == valid_fields(op)
    assert wire.decode(wire.encode(op, 7, valid_fields(op))).fields == valid_fields(op)


@pytest.mark.parametrize("op, name, check", OP_FIELDS)
def test_each_op_field_refuses_every_wrong_value(op, name, check):
    fields = valid_fields(op)
    failures = []
    for value in wrong_values(check):
        header = header_of(op, {**fields, name: value})
        for side, attempt in (
            ("decode", lambda h=header: wire.decode([packed(h)])),
            ("encode", lambda value=value: wire.encode(op, 7, {**fields, name: value})),
        ):
            try:
                attempt()
            except ProtocolError as exc:
                if repr(name) not in str(exc) or str(exc).startswith("malformed header"):
                    failures.append(f"{side} {shown(value)}: {exc}")
            except Exception as exc:  # the point of the test: nothing but ProtocolError
                failures.append(f"{side} {shown(value)}: {type(exc).__name__}: {exc}")
            else:
                failures.append(f"{side} {shown(value)}: accepted")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("op, name, check", OP_FIELDS)
def test_each_required_field_is_required(op, name, check):
    required = {n for n, _, req in wire.SCHEMA[op] if req}
    fields = {n: v for n, v in valid_fields(op).items() if n != name}
    if name in required:
        with pytest.raises(ProtocolError, match=f"missing field {name!r}"):
            wire.decode([packed(header_of(op, fields))])
    else:
        assert name not in wire.decode([packed(header_of(op, fields))]).fields


def test_too_many_acks_are_refused_on_both_sides():
    """A list over MAX_ACKS ids: encode names the field; a header holding it is over
    MAX_HEADER_BYTES, refused by its length before it is unpacked."""
    acks = [0] * (wire.MAX_ACKS + 1)
    with pytest.raises(ProtocolError, match="'ak'"):
        wire.encode(Op.REPLY, 7, {"ak": acks})
    with pytest.raises(ProtocolError, match="exceeds the"):
        wire.decode([packed(header_of(Op.REPLY, {"ak": acks}))])


def _envelope_cases() -> list[Any]:
    """(field, value, extra payload frames, what the error must say) for the envelope."""
    cases = []
    for value in [v for v in EVERY_TYPE if type(v) is not int] + [V - 1, V + 1, -1, UINT64_MAX]:
        cases.append(("v", value, 0, "protocol version|'v'"))
    unknown_ops = [0, max(Op) + 1, 99, -1, UINT64_MAX]
    for value in [v for v in EVERY_TYPE if type(v) is not int] + unknown_ops:
        cases.append(("op", value, 0, "unknown op"))
    for value in wrong_values(wire.UINT):
        cases.append(("id", value, 0, "'id'"))
    for value in [v for v in EVERY_TYPE if type(v) is not list]:
        cases.append(("nb", value, 0, "'nb'"))
    for value in wrong_values(wire.UINT):  # as the one payload frame's declared length
        cases.append(("nb", [value], 1, "'nb'"))
    return [
        pytest.param(name, value, frames, says, id=f"{name}={shown(value, 24)}")
        for name, value, frames, says in cases
    ]


@pytest.mark.parametrize("name, value, frames, says", _envelope_cases())
def test_each_envelope_field_refuses_every_wrong_value(name, value, frames, says):
    header = header_of(Op.PING, {}, **{name: value})
    with pytest.raises(ProtocolError, match=says) as caught:
        wire.decode([packed(header), *[b""] * frames])
    assert not str(caught.value).startswith("malformed header")


@pytest.mark.parametrize("name", ["v", "op", "id", "nb"])
def test_each_envelope_field_is_required(name):
    header = header_of(Op.PING, {})
    del header[name]
    with pytest.raises(ProtocolError):
        wire.decode([packed(header)])


@pytest.mark.parametrize("version", [float(V), True, str(V), [V], {"v": V}, None], ids=repr)
def test_the_protocol_version_must_be_an_int(version):
    """5.0 compares equal to 5: it was accepted while every other int field refused floats."""
    with pytest.raises(ProtocolError, match="field 'v' .* must be an int"):
        wire.decode([packed(header_of(Op.PING, {}, v=version))])


def test_a_map_with_a_non_str_key_anywhere_is_refused_unread():
    """Maps with int keys (at the top or nested in a parameter map) are refused by msgpack's
    ``strict_map_key`` before any field is read; still a ProtocolError, never another one."""
    for header in (
        {**header_of(Op.PING, {}), 1: 2},
        header_of(Op.SET_OPTIMIZER, {"opt": "sgd", "hp": {1: 0.1}}),
        header_of(Op.SET_OPTIMIZER, {"opt": "sgd", "hp": {"lr": {2: 0.1}}}),
    ):
        with pytest.raises(ProtocolError, match="not valid msgpack"):
            wire.decode([msgpack.packb(header, use_bin_type=True)])
