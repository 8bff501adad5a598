"""Hostile headers: whatever a peer sends, ``wire.decode`` raises ProtocolError (never another
exception, which the server would log as unexpected and leave unanswered), an over-long header
is refused without being unpacked, and error replies stay valid whatever their text."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from kvstore import wire
from kvstore.errors import ProtocolError
from kvstore.wire import Op

V = wire.PROTOCOL_VERSION
INIT = {"k": "w", "c": 0, "o": 0, "n": 3, "dt": "float32", "sh": [3], "cd": "none", "cp": {}}
HELLO = {"r": 0, "nw": 1, "ns": 1, "si": 0, "m": "dist_sync", "ln": 0}


def _packed(op: Op, fields: dict, rid: int = 7, nb: list | None = None) -> bytes:
    return msgpack.packb({"v": V, "op": int(op), "id": rid, **fields, "nb": nb or []})


@pytest.mark.parametrize("odd", [[1, 2], {"a": 1}, ["float32"], {"float32": 1}])
def test_unhashable_dtype_and_mode_are_bad_messages(odd):
    """A msgpack array or map where a dtype or mode name belongs used to raise TypeError
    (``value in frozenset``), which escaped decode and got no reply."""
    with pytest.raises(ProtocolError, match="dtype .* is not allowed"):
        wire.decode([_packed(Op.INIT, {**INIT, "dt": odd})])
    with pytest.raises(ProtocolError, match="mode .* is not one of"):
        wire.decode([_packed(Op.HELLO, {**HELLO, "m": odd})])


@pytest.mark.parametrize("lane", [1.0, True, [1], "1"])
def test_lane_must_be_an_int(lane):
    """(1.0 and True compare equal to lane 1.)"""
    with pytest.raises(ProtocolError, match="lane"):
        wire.decode([_packed(Op.HELLO, {**HELLO, "ln": lane})])


def test_unknown_fields_of_mixed_key_types_are_named():
    """str and bytes map keys do not compare: sorting them for the message used to raise."""
    header = msgpack.packb({"v": V, "op": int(Op.BARRIER), "id": 1, "nb": [], "x": 1, b"y": 2})
    with pytest.raises(ProtocolError, match="unknown fields"):
        wire.decode([header])


@pytest.mark.parametrize("op", [True, 3.0, [3]])
def test_op_must_be_an_int(op):
    with pytest.raises(ProtocolError, match="unknown op"):
        wire.decode([msgpack.packb({"v": V, "op": op, "id": 1, "nb": []})])


def test_long_values_are_quoted_short():
    with pytest.raises(ProtocolError) as caught:
        wire.decode([_packed(Op.INIT, {**INIT, "dt": "x" * 60_000})])
    assert len(str(caught.value)) < 300


def test_long_strings_are_refused_by_length():
    with pytest.raises(ProtocolError, match="longer than 4096 characters"):
        wire.decode([_packed(Op.INIT, {**INIT, "cd": "x" * (wire.MAX_TEXT + 1)})])


def test_error_replies_truncate_long_texts():
    """An error text over MAX_TEXT characters (a message quoting a 4,096-character codec name)
    used to make the ERROR reply itself invalid: the server could not send it."""
    frames = wire.error(5, "codec", "unknown codec " + "x" * 10_000)
    msg = wire.decode(frames)
    assert msg.op is Op.ERROR and msg.rid == 5
    assert len(msg.body.message) <= wire.MAX_TEXT
    assert msg.body.message.startswith("unknown codec xxx") and msg.body.message.endswith(
        "(truncated)"
    )
    assert wire.decode(wire.error(6, "codec", "short")).body.message == "short"


def test_hello_may_announce_the_partition_size():
    frames = wire.encode(Op.HELLO, 1, {**HELLO, "pb": 4 << 20})
    assert wire.decode(frames).body.partition_bytes == 4 << 20
    assert "pb" not in wire.decode(wire.encode(Op.HELLO, 1, HELLO)).fields
    with pytest.raises(ProtocolError, match="'pb'"):
        wire.decode([_packed(Op.HELLO, {**HELLO, "pb": -1})])


class _Spy:
    """msgpack as wire uses it, recording how much any unpacker was given."""

    def __init__(self) -> None:
        self.fed: list[int] = []
        self.whole_unpacks = 0
        spy = self

        class Unpacker(msgpack.Unpacker):
            def feed(self, data):
                spy.fed.append(len(data))
                return super().feed(data)

        self.Unpacker = Unpacker

    def unpackb(self, *args, **kwargs):
        self.whole_unpacks += 1
        return msgpack.unpackb(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(msgpack, name)


def test_an_oversized_header_is_refused_without_being_unpacked(monkeypatch):
    """A 64 MiB header stalled a server's loop for 1.5 s: decode refused it by its length, but
    peek_request_id then unpacked all of it to find the request id."""
    spy = _Spy()
    monkeypatch.setattr(wire, "msgpack", spy)
    huge = msgpack.packb({"v": V, "op": int(Op.PUSH), "id": 4242, "pad": "x" * (8 << 20)})
    frame = np.frombuffer(huge, np.uint8)  # a buffer, as a zmq.Frame is
    with pytest.raises(ProtocolError, match="exceeds the 65536 limit"):
        wire.decode([frame])
    assert wire.peek_request_id([frame]) == 4242
    assert wire.peek_request_id([huge]) == 4242
    assert spy.whole_unpacks == 0
    assert spy.fed and max(spy.fed) <= wire.PEEK_BYTES


@pytest.mark.parametrize(
    "header, rid",
    [
        (msgpack.packb({"v": V, "op": 3, "id": 9}), 9),
        (msgpack.packb({"id": 11, "v": V}), 11),
        (msgpack.packb({"v": "x" * 1000, "id": 12}), 0),  # the id lies past the prefix
        (msgpack.packb({"v": V, "op": 3, "id": -4}), 0),
        (msgpack.packb({"v": V, "op": 3, "id": [1]}), 0),
        (msgpack.packb([1, 2, 3]), 0),
        (b"", 0),
        (b"\xc1", 0),
    ],
)
def test_peek_request_id_reads_a_bounded_prefix(header, rid):
    assert wire.peek_request_id([header]) == rid


def _mutations(rng: random.Random):
    """Headers of every op, mutated field by field, and random bytes."""
    oddities = [
        None, True, -1, 2**64 - 1, 1.5, float("nan"), "", "x" * 5000, b"\x00\xff", [], [1, [2]],
        {}, {"a": [1]}, {1: 2}, msgpack.ExtType(5, b"x"),
    ]  # fmt: skip
    templates = [
        (Op.HELLO, HELLO, []),
        (Op.INIT, INIT, [12]),
        (Op.PUSH, {"k": 1, "c": 0, "n": 3}, [12]),
        (Op.PULL, {"k": 1, "c": 0, "af": 0, "rx": 2}, []),
        (Op.SET_OPTIMIZER, {"opt": "sgd", "hp": {"learning_rate": 0.1}}, []),
        (Op.ERROR, {"code": "x", "msg": "y"}, []),
        (Op.REPLY, {"ak": [1, 2], "rl": 1}, []),
    ]
    while True:
        op, fields, nb = rng.choice(templates)
        header = {"v": V, "op": int(op), "id": rng.randrange(1 << 20), **fields, "nb": list(nb)}
        for _ in range(rng.randint(1, 3)):
            name = rng.choice([*header, "zz"])
            header[name] = rng.choice(oddities)
        try:
            raw = msgpack.packb(header, use_bin_type=True, strict_types=False)
        except (TypeError, ValueError, OverflowError):
            continue
        if rng.random() < 0.3:
            raw = bytearray(raw)
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            raw = bytes(raw[: rng.randint(0, len(raw))] if rng.random() < 0.3 else raw)
        if rng.random() < 0.05:
            raw = rng.randbytes(rng.randint(0, 64))
        payloads = [b"\x00" * rng.choice([0, 12, 13])] * rng.choice([0, 1, 1, 2])
        yield [raw, *payloads]


def test_decode_raises_only_protocol_errors_on_mutated_headers():
    rng = random.Random(35)
    seen = 0
    for frames in _mutations(rng):
        try:
            wire.decode(frames)
        except ProtocolError as exc:
            # decode's safety net caught what no validator did: a validator has a hole
            assert not str(exc).startswith("malformed header"), exc
        rid = wire.peek_request_id(frames)
        assert isinstance(rid, int) and rid >= 0
        seen += 1
        if seen == 5000:
            break
