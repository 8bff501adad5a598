"""Wire protocol: golden bytes of every message type, round trips, and validation."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvstore import wire
from kvstore.errors import ProtocolError
from kvstore.wire import Op

V = wire.PROTOCOL_VERSION

# (op, rid, fields, payloads, header hex). Changing any of these bytes needs a version bump.
GOLDEN = {
    "HELLO": (
        Op.HELLO,
        1,
        {"r": 1, "nw": 2, "ns": 2, "si": 0, "m": "dist_sync", "ln": 1},
        [],
        "8aa17606a26f7001a2696401a17201a26e7702a26e7302a2736900a16da9646973745f73796e63a26c6e01"
        "a26e6290",
    ),
    "INIT": (
        Op.INIT,
        2,
        {
            "k": "w",
            "c": 0,
            "o": 0,
            "n": 3,
            "dt": "float32",
            "sh": [3],
            "cd": "2bit",
            "cp": {"threshold": 0.5},
        },
        [np.array([1, 2, 3], np.float32)],
        "8ca17606a26f7002a2696402a16ba177a16300a16f00a16e03a26474a7666c6f61743332a273689103a263"
        "64a432626974a2637081a97468726573686f6c64cb3fe0000000000000a26e62910c",
    ),
    "PUSH": (
        Op.PUSH,
        3,
        {"k": 7, "c": 1, "n": 17},
        [bytes.fromhex("e3800003c0000000")],
        "87a17606a26f7003a2696403a16b07a16301a16e11a26e629108",
    ),
    "PULL": (
        Op.PULL,
        4,
        {"k": 7, "c": 1, "af": 3, "rx": 8},
        [],
        "88a17606a26f7004a2696404a16b07a16301a2616603a2727808a26e6290",
    ),
    "PUSHPULL": (
        Op.PUSHPULL,
        5,
        {"k": "w", "c": 0, "n": 2, "rx": 8},
        [np.array([0.5, -1], np.float32)],
        "88a17606a26f7005a2696405a16ba177a16300a16e02a2727808a26e629108",
    ),
    "BARRIER": (Op.BARRIER, 6, {}, [], "84a17606a26f7006a2696406a26e6290"),
    "SET_OPTIMIZER": (
        Op.SET_OPTIMIZER,
        7,
        {
            "opt": "sgd",
            "hp": {
                "learning_rate": 0.1,
                "momentum": 0.9,
                "nesterov": False,
                "clip_gradient": None,
            },
        },
        [],
        "86a17606a26f7007a2696407a36f7074a3736764a2687084ad6c6561726e696e675f72617465cb3fb99999"
        "9999999aa86d6f6d656e74756dcb3feccccccccccccda86e65737465726f76c2ad636c69705f6772616469"
        "656e74c0a26e6290",
    ),
    "BYE": (Op.BYE, 8, {}, [], "84a17606a26f7008a2696408a26e6290"),
    "PING": (Op.PING, 11, {}, [], "84a17606a26f7009a269640ba26e6290"),
    "SAVE": (
        Op.SAVE,
        12,
        {"p": "/ckpt/.run.saving"},
        [],
        "85a17606a26f700aa269640ca170b12f636b70742f2e72756e2e736176696e67a26e6290",
    ),
    "LOAD": (
        Op.LOAD,
        13,
        {"p": "/ckpt/run", "ph": 0, "er": "x"},
        [],
        "87a17606a26f700ba269640da170a92f636b70742f72756ea2706800a26572a178a26e6290",
    ),
    "REPLICATE": (
        Op.REPLICATE,
        14,
        {"k": "w", "c": 0, "kd": 2, "rk": [2, 0, 1], "sz": [8, 8, 8], "fc": [1, 1, 1], "up": 4},
        [np.zeros(48, np.float32)],
        "8ba17606a26f700ca269640ea16ba177a16300a26b6402a2726b93020001a2737a93080808a2666393010101a2757004a26e6291ccc0",
    ),
    "CATCH_UP": (
        Op.CATCH_UP,
        15,
        {"sd": 1, "ad": "tcp://h:9"},
        [],
        "86a17606a26f700da269640fa2736401a26164a97463703a2f2f683a39a26e6290",
    ),
    "STATE": (
        Op.STATE,
        16,
        {"k": "w", "c": 0, "pt": "value"},
        [np.zeros(2, np.float32)],
        "87a17606a26f700ea2696410a16ba177a16300a27074a576616c7565a26e629108",
    ),
    "TAKEN_OVER": (
        Op.TAKEN_OVER,
        17,
        {"sd": 1, "sv": 2},
        [],
        "86a17606a26f700fa2696411a2736401a2737602a26e6290",
    ),
    "REPLY": (
        Op.REPLY,
        4,
        {"ak": [3, 9], "rl": 2},
        [np.array([1.5], np.float32)],
        "86a17606a26f7010a2696404a2616b920309a2726c02a26e629104",
    ),
    "ERROR": (
        Op.ERROR,
        3,
        {"code": "not_initialized", "msg": "no"},
        [],
        "86a17606a26f7011a2696403a4636f6465af6e6f745f696e697469616c697a6564a36d7367a26e6fa26e6290",
    ),
}


def test_every_op_has_a_golden_fixture():
    assert {op.name for op in Op} == set(GOLDEN)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(name):
    op, rid, fields, payloads, header_hex = GOLDEN[name]
    frames = wire.encode(op, rid, fields, payloads)
    assert frames[0].hex() == header_hex
    assert frames[1:] == payloads  # payloads are passed through, not copied
    decoded = wire.decode([bytes.fromhex(header_hex), *[bytes(memoryview(p)) for p in payloads]])
    assert decoded.op is op
    assert decoded.rid == rid
    assert decoded.fields == fields
    assert [bytes(p) for p in decoded.payloads] == [bytes(memoryview(p)) for p in payloads]


def test_version_is_six_and_checked_first():
    assert wire.PROTOCOL_VERSION == 6
    header = msgpack.packb({"v": 1, "op": 99, "id": 1, "nb": []})  # a worker of pskv 0.1
    with pytest.raises(ProtocolError, match="protocol version 1 is not supported"):
        wire.decode([header])


def _header(**fields) -> bytes:
    base = {"v": V, "op": int(Op.PULL), "id": 9, "k": 1, "c": 0, "af": 0, "nb": []}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not ...})


@pytest.mark.parametrize(
    "frames, match",
    [
        ([], "empty message"),
        ([b"\xc1garbage"], "not valid msgpack"),
        ([msgpack.packb([1, 2, 3])], "must be a msgpack map"),
        ([b"\x00" * (wire.MAX_HEADER_BYTES + 1)], "exceeds"),
        ([_header(op=250)], "unknown op 250"),
        ([_header(id=-1)], "'id' must be a non-negative int"),
        ([_header(nb=...)], "'nb'"),
        ([_header(nb=[4])], "declares 1 payload frames but 0 arrived"),
        ([_header(), b"xx"], "declares 0 payload frames but 1 arrived"),
        ([_header(k=...)], "missing field 'k'"),
        ([_header(k=1.5)], "a key must be an int or a str, got float"),
        ([_header(k=True)], "got bool"),
        ([_header(k=2**63 + 5)], "does not fit in 64 bits"),
        ([_header(k="x" * 2000)], "longer than 1024"),
        ([_header(c=-3)], "'c' must be a non-negative int"),
        ([_header(extra=1)], "unknown fields"),
    ],
)
def test_malformed_messages_are_rejected(frames, match):
    with pytest.raises(ProtocolError, match=match):
        wire.decode(frames)


def test_key_limits_hold_on_both_sides():
    """Common keys skip their validator (a fast path); the limits are the same either way."""
    for key in ["x" * wire.MAX_KEY_LENGTH, "", -(2**63), 2**63 - 1, 0]:
        frames = wire.encode(Op.PULL, 1, {"k": key, "c": 0, "af": 0})
        assert wire.decode(frames).body.key == key
    for key, match in [
        ("x" * (wire.MAX_KEY_LENGTH + 1), "longer than 1024"),
        (False, "got bool"),
        (2**64 - 1, "does not fit in 64 bits"),
        (b"w", "got bytes"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            wire.encode(Op.PULL, 1, {"k": key, "c": 0, "af": 0})
        with pytest.raises(ProtocolError, match=match):
            wire.decode([_header(k=key)])


def test_payload_length_must_match_the_header():
    header = msgpack.packb(
        {"v": V, "op": int(Op.PUSH), "id": 1, "k": 1, "c": 0, "n": 16, "nb": [4]}
    )
    with pytest.raises(ProtocolError, match="payload 0 has 3 bytes but the header declares 4"):
        wire.decode([header, b"abc"])


def test_init_fields_are_validated():
    good = dict(GOLDEN["INIT"][2])
    for field, value, match in [
        ("dt", "complex64", "dtype 'complex64' is not allowed"),
        ("dt", "bool", "not allowed"),
        ("sh", [3, -1], "dimension -1"),
        ("sh", [2] * 40, "at most 32"),
        ("sh", "3", "must be a list"),
        ("cp", {"t": [1, 2]}, "unsupported type list"),
        ("cp", {1: 2}, "not allowed for map key"),
    ]:
        fields = {**good, field: value}
        header = msgpack.packb({"v": V, "op": int(Op.INIT), "id": 1, **fields, "nb": []})
        with pytest.raises(ProtocolError, match=match):
            wire.decode([header])


def test_init_averaged_is_an_optional_bool():
    """``av`` (an averaged key) is left out when not set, so an INIT without it keeps its
    golden bytes and means a normal key; when sent it must be a bool, not 0 or 1."""
    good = dict(GOLDEN["INIT"][2])
    plain = wire.decode(wire.encode(Op.INIT, 2, good, GOLDEN["INIT"][3]))
    assert plain.body.averaged is None and "av" not in plain.fields
    assert "av" not in wire.wire_fields(plain.body)  # (what a worker sends for a normal key)
    averaged = wire.decode(wire.encode(Op.INIT, 2, {**good, "av": True}, GOLDEN["INIT"][3]))
    assert averaged.body.averaged is True and averaged.fields["av"] is True
    for value in (1, 0, 1.0, "true", None, [True]):
        header = msgpack.packb({"v": V, "op": int(Op.INIT), "id": 1, **good, "av": value, "nb": []})
        with pytest.raises(ProtocolError, match="'av'"):
            wire.decode([header])


def test_fixed_payload_counts_are_enforced():
    header = msgpack.packb({"v": V, "op": int(Op.BARRIER), "id": 1, "nb": [1]})
    with pytest.raises(ProtocolError, match="BARRIER carries 1 payload frames"):
        wire.decode([header, b"x"])


def test_hello_mode_must_be_known():
    fields = {"r": 0, "nw": 1, "ns": 1, "si": 0, "m": "dist_turbo"}
    header = msgpack.packb({"v": V, "op": int(Op.HELLO), "id": 1, **fields, "nb": []})
    with pytest.raises(ProtocolError, match="mode 'dist_turbo'"):
        wire.decode([header])


def test_encode_validates_fields_too():
    with pytest.raises(ProtocolError, match="missing field 'n'"):
        wire.encode(Op.PUSH, 1, {"k": 1, "c": 0})
    with pytest.raises(ProtocolError, match="unknown fields"):
        wire.encode(Op.PULL, 1, {"k": 1, "c": 0, "zz": 1})


def test_peek_request_id_is_best_effort():
    assert wire.peek_request_id([_header(op=250, id=77)]) == 77
    assert wire.peek_request_id([b"\xc1"]) == 0
    assert wire.peek_request_id([msgpack.packb({"id": -5})]) == 0


def test_zmq_frames_decode_without_copy():
    zmq = pytest.importorskip("zmq")
    payload = np.arange(4, dtype=np.float32)
    frames = wire.encode(Op.REPLY, 3, {}, [payload])
    zframes = [zmq.Frame(frames[0]), zmq.Frame(payload)]
    msg = wire.decode(zframes)
    assert np.frombuffer(msg.payloads[0].buffer, np.float32).tolist() == [0, 1, 2, 3]


def test_the_server_and_the_worker_read_messages_by_field_name():
    # Only kvstore.wire knows the short header keys: handlers read msg.body.<name> and build
    # the op's fields dataclass, so no wire name appears as a string in their code.
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    names = {name for fields in wire.SCHEMA.values() for name, _, _ in fields}
    found = [
        f"{path.relative_to(repo)}:{node.lineno}: {node.value!r}"
        for folder in ("server", "worker")
        for path in sorted((repo / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]
    assert not found, found


def test_every_op_has_a_fields_dataclass_whose_fields_name_the_schema():
    for op in wire.Op:
        cls = wire.FIELDS_OF[op]
        assert wire.OP_OF[cls] is op
        assert [w for w, _, _ in wire.SCHEMA[op]] == [w for w, _ in wire._WIRE_NAMES[op]]
