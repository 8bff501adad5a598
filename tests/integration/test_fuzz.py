"""Fuzzing a real server: over 10,000 mutated and random messages (seeded), then a legitimate job.

Messages come from raw DEALER sockets: four that said HELLO and hold every rank and lane of a
2-worker job (so the strangers can take none), four strangers, and one that sends frames over
the server's message limit. They are real headers of every op mutated field by field (wrong
types, huge ints, nested containers, deleted and unknown fields), wrong frame counts and
lengths, truncated and corrupted msgpack, random bytes, headers over 64 KiB and deeply nested
ones. The test then checks:

* every malformed message got an error reply addressed to the id a server can read from it
  (:func:`kvstore.wire.peek_request_id`), and every message of a stranger got a reply; every
  reply is a valid message;
* the server logged no unexpected or internal error (each message was refused by a check, not
  by the last-resort handler);
* a legitimate 2-worker job on the same server then gets exact sums (dense and 2-bit);
* the server's peak memory (``VmHWM``) stayed under a ceiling computed from its limits: what
  ZeroMQ may queue per connection (``RECV_QUEUE`` messages of at most the message limit) over
  the peak of the same legitimate job before the fuzzing. Two frames of 128 MiB, which a
  server without a message limit would have allocated, are part of the fuzzing.

Timings are never asserted; deadlines are hang guards only.
"""

from __future__ import annotations

import functools
import random
import time
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from kvtest import connect, run_ranks, start_servers, stop_processes

from kvstore import wire
from kvstore.errors import ProtocolError
from kvstore.server.server import RECV_QUEUE
from kvstore.topology import max_payload_bytes
from kvstore.wire import Op

pytestmark = pytest.mark.integration

SEED = 35
MESSAGES = 10_500
PARTITION = 65536  # a small partition: the server's message limit is about 64 KiB
LIMIT = max_payload_bytes(PARTITION)
THRESHOLD = 0.5
HUGE_FRAME = 128 << 20

# A valid value for each kind of field (by validator), and realistic fields for some ops.
_EXAMPLES = {
    wire.KEY: "w",
    wire.UINT: 0,
    wire.STR: "x",
    wire.DTYPE: "float32",
    wire.SHAPE: [4],
    wire.PARAMS: {},
    wire.MODE: "dist_sync",
    wire.RIDS: [1],
    wire.ADDRESSES: ["tcp://127.0.0.1:1"],
    wire.LANE: 0,
    wire.VERSION: -1,
    wire.BOOL: False,
}
_REALISTIC: dict[Op, list[tuple[dict, list[bytes]]]] = {
    Op.HELLO: [({"r": 0, "nw": 2, "ns": 1, "si": 0, "m": "dist_sync", "ln": 0}, [])],
    Op.INIT: [
        (
            {"k": "w", "c": 0, "o": 0, "n": 4, "dt": "float32", "sh": [4], "cd": "none", "cp": {}},
            [bytes(16)],
        ),
        (
            {
                "k": "q",
                "c": 0,
                "o": 0,
                "n": 32,
                "dt": "float32",
                "sh": [32],
                "cd": "2bit",
                "cp": {"threshold": THRESHOLD},
            },
            [bytes(128)],
        ),
        (  # an averaged key: its rounds take the mean, not the optimizer's update
            {
                "k": "m",
                "c": 0,
                "o": 0,
                "n": 4,
                "dt": "float32",
                "sh": [4],
                "cd": "none",
                "cp": {},
                "av": True,
            },
            [bytes(16)],
        ),
    ],  # fmt: skip
    Op.PUSH: [
        ({"k": "w", "c": 0, "n": 4}, [bytes(16)]),
        ({"k": "q", "c": 0, "n": 32}, [bytes(8)]),
        ({"k": "m", "c": 0, "n": 4}, [bytes(16)]),
    ],
    Op.PUSHPULL: [({"k": "w", "c": 0, "n": 4, "rx": 2}, [bytes(16)])],
    Op.PULL: [({"k": "w", "c": 0, "af": 0, "rx": 2}, []), ({"k": "q", "c": 0, "af": 1}, [])],
    Op.SET_OPTIMIZER: [({"opt": "sgd", "hp": {"learning_rate": 0.1, "momentum": 0.9}}, [])],
    Op.REPLY: [({"ak": [1, 2], "rl": 1, "sr": 0}, [bytes(4)])],
    Op.ERROR: [({"code": "internal", "msg": "no"}, [])],
}
_ODDITIES = [
    None, True, False, -1, -(2**63), 2**63, 2**64 - 1, 0.5, float("nan"), float("inf"), "",
    "x" * 5000, "\u00e9\u4e2d", b"", b"\x00\xff" * 10, [], [1, [2, [3, [4]]]], ["float32"],
    {}, {"a": {"b": [1]}}, {"float32": 1}, msgpack.ExtType(5, b"x"), list(range(300)),
]  # fmt: skip
# (session peers must not change their own session or write files; see _generate)
_SESSION_SKIPS = {Op.HELLO, Op.BYE, getattr(Op, "SAVE", None), getattr(Op, "LOAD", None)}


def _templates() -> list[tuple[Op, dict, list[bytes]]]:
    templates = []
    for op, schema in wire.SCHEMA.items():
        generic = {name: _EXAMPLES[check] for name, check, _ in schema}
        for fields, payloads in _REALISTIC.get(op, [(generic, [])]):
            templates.append((op, fields, payloads))
    return templates


def _pack(header: dict) -> bytes | None:
    try:
        return msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None


def _generate(rng: random.Random, templates, rid: int) -> list[bytes]:
    """One fuzzed message: a mutated real header with payloads, or raw junk."""
    kind = rng.random()
    if kind < 0.04:
        return [rng.randbytes(rng.randint(0, 200))]
    if kind < 0.05:  # nested beyond msgpack's depth limit, or a map of many entries
        if rng.random() < 0.5:
            return [b"\x91" * rng.randint(600, 5000) + b"\x00"]
        return [_pack({str(i): i for i in range(6000)} | {"id": rid}) or b""]
    if kind < 0.06:  # over MAX_HEADER_BYTES, under the message limit, its id readable
        pad = "x" * rng.randint(wire.MAX_HEADER_BYTES, LIMIT - 64)
        return [_pack({"v": wire.PROTOCOL_VERSION, "op": int(Op.PULL), "id": rid, "pad": pad})]
    op, fields, payloads = rng.choice(templates)
    header = {"v": wire.PROTOCOL_VERSION, "op": int(op), "id": rid, **fields}
    frames = list(payloads)
    header["nb"] = [len(f) for f in frames]
    for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
        what = rng.random()
        name = rng.choice(list(header))
        if what < 0.6:
            header[name] = rng.choice(_ODDITIES)
        elif what < 0.7:
            del header[name]
        elif what < 0.8:
            header[rng.choice(["zz", "k2", "pad"])] = rng.choice(_ODDITIES)
        elif what < 0.9:  # frames that disagree with nb
            frames = [rng.randbytes(rng.choice([0, 3, 16, 17])) for _ in range(rng.randint(0, 3))]
        else:
            header["nb"] = [rng.choice([0, 1, 16, 2**40]) for _ in range(rng.randint(0, 3))]
    raw = _pack(header)
    if raw is None:
        raw = rng.randbytes(32)
    cut = rng.random()
    if cut < 0.08:
        raw = raw[: rng.randrange(len(raw) + 1)]  # truncated msgpack
    elif cut < 0.16:
        flipped = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        raw = bytes(flipped)
    return [raw, *frames]


class Peer:
    """A raw DEALER socket and the replies it is owed and got."""

    def __init__(self, context: zmq.Context, address: str, name: str) -> None:
        self.name = name
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.ROUTING_ID, name.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(address)
        self.owed: Counter[int] = Counter()  # request id -> replies owed
        self.got: Counter[int] = Counter()
        self.codes: Counter[str] = Counter()
        self.sent = 0
        self.invalid_replies: list[str] = []

    def send(self, frames: list, owed: int | None) -> None:
        self.socket.send_multipart(frames, copy=False)
        self.sent += 1
        if owed is not None:
            self.owed[owed] += 1

    def drain(self) -> int:
        n = 0
        while self.socket.poll(0):
            frames = self.socket.recv_multipart()
            n += 1
            try:
                msg = wire.decode(frames)
            except ProtocolError as exc:
                self.invalid_replies.append(str(exc))
                continue
            self.got[msg.rid] += 1
            self.codes[msg.body.code if msg.op is Op.ERROR else "reply"] += 1
        return n

    def missing(self) -> Counter[int]:
        return self.owed - self.got

    def request(self, op: Op, fields: dict, payloads=()) -> None:
        """A valid request whose reply must come (its id is unique to this test)."""
        self.sent += 1
        rid = 10**12 + self.sent
        self.socket.send_multipart(wire.encode(op, rid, fields, list(payloads)))
        self.owed[rid] += 1

    def close(self) -> None:
        self.socket.close(0)


def _memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def _legitimate_job(address: str) -> None:
    """Two workers, a dense and a 2-bit key of several chunks each, three steps, exact sums."""
    n = 3 * PARTITION // 4 + 17  # several chunks of the small partition

    def grads(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(1000 * step + rank)
        dense = rng.standard_normal(n).astype(np.float32)
        # values in {-t, 0, t}: 2-bit sends them exactly and keeps no residual
        quantized = (rng.integers(-1, 2, n) * THRESHOLD).astype(np.float32)
        return dense, quantized

    def worker(rank: int, compression: str) -> None:
        with connect([address], rank=rank, num_workers=2, partition_bytes=PARTITION) as kv:
            params = {"threshold": THRESHOLD} if compression == "2bit" else {}
            kv.set_gradient_compression({"type": compression, **params})
            kv.init("k", np.zeros(n, np.float32))
            for step in range(3):
                grad = grads(rank, step)[compression == "2bit"]
                kv.push("k", grad)
                out = np.zeros(n, np.float32)
                kv.pull("k", out=out)
                first, second = grads(0, step), grads(1, step)
                expected = first[compression == "2bit"] + second[compression == "2bit"]
                assert out.tobytes() == expected.tobytes(), (compression, step)

    for compression in ("none", "2bit"):
        run_ranks(2, functools.partial(worker, compression=compression), timeout=120)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_fuzzed_messages_then_a_legitimate_job(tmp_path):
    log = tmp_path / "server.log"
    with log.open("w") as stderr:
        servers = start_servers(
            1, 2, env={"KVSTORE_PARTITION_BYTES": str(PARTITION)}, stderr=stderr
        )
    server = servers[0]
    pid = server.process.pid
    context = zmq.Context()
    peers: list[Peer] = []
    try:
        _legitimate_job(server.address)  # warm: kernels loaded, buffers allocated
        baseline = _memory_kib(pid, "VmHWM")

        # Four peers hold every rank and lane of the job, and have initialised two keys.
        holders = [Peer(context, server.address, f"holder{i}") for i in range(4)]
        strangers = [Peer(context, server.address, f"stranger{i}") for i in range(4)]
        oversize = Peer(context, server.address, "oversize")
        peers = [*holders, *strangers, oversize]
        for i, peer in enumerate(holders):
            hello = {"r": i % 2, "nw": 2, "ns": 1, "si": 0, "m": "dist_sync", "ln": i // 2}
            peer.request(Op.HELLO, hello)
        for peer, payloads in ((holders[0], True), (holders[1], False)):
            for fields, values in _REALISTIC[Op.INIT]:
                peer.request(Op.INIT, fields, values if payloads else [])
        _await(holders, "the holders' handshakes and inits")
        assert all(p.codes["reply"] == p.sent for p in holders), [p.codes for p in holders]

        rng = random.Random(SEED)
        templates = _templates()
        rid = 0
        malformed = 0
        while rid < MESSAGES:
            rid += 1
            peer = rng.choice(holders + strangers)
            frames = _generate(rng, templates, rid)
            try:
                valid = wire.decode(frames)
            except ProtocolError:
                valid = None
            if valid is None:
                malformed += 1
                peer.send(frames, owed=wire.peek_request_id(frames))
            elif peer in strangers:
                peer.send(frames, owed=valid.rid)  # refused, but answered
            elif valid.op not in _SESSION_SKIPS:
                peer.send(frames, owed=None)  # may wait for a round or a collective
            if rid % 2000 == 0:
                payload = np.zeros(HUGE_FRAME if rid % 4000 == 0 else LIMIT + 1, np.uint8)
                header = wire.encode(Op.PUSH, rid, {"k": 1, "c": 0, "n": 1}, [payload])[0]
                oversize.send([header, payload], owed=None)
            if rid % 64 == 0:
                for p in peers:
                    p.drain()
        _await(peers, "replies to the fuzzed messages")
        assert malformed > 5000  # most of the fuzz was malformed (and the rest exercised)
        for peer in peers:
            assert not peer.invalid_replies, (peer.name, peer.invalid_replies[:3])
        for peer in strangers:
            assert sum(peer.got.values()) == peer.sent, peer.name  # one reply each, no more
        codes = sum((p.codes for p in peers), Counter())
        assert codes["bad_message"] >= malformed
        assert server.process.poll() is None

        # The holders leave; the server forgets their job and serves a real one.
        for peer in holders:
            peer.request(Op.BYE, {})
        _await(holders, "goodbyes")
        text = log.read_text()
        assert "unexpected error" not in text and "internal error" not in text, text[-3000:]
        _legitimate_job(server.address)
        peak = _memory_kib(pid, "VmHWM")
        connections = len(peers) + 4  # the fuzzers, and the two workers' two lanes each
        queued_kib = connections * RECV_QUEUE * (LIMIT + wire.MAX_HEADER_BYTES) // 1024
        ceiling = baseline + queued_kib + 64 * 1024  # + 64 MiB for the allocator's slack
        assert peak <= ceiling, f"peak {peak} KiB > {ceiling} KiB (baseline {baseline} KiB)"
        assert peak - baseline < HUGE_FRAME // 1024  # no 128 MiB frame was ever taken in
    finally:
        for peer in peers:
            peer.close()
        context.term()
        stop_processes([s.process for s in servers])


def _await(peers: list[Peer], what: str, deadline_s: float = 120.0) -> None:
    """Drain until every owed reply came (the deadline only guards against a hang)."""
    deadline = time.monotonic() + deadline_s
    while any(p.missing() for p in peers):
        if time.monotonic() > deadline:
            missing = {p.name: sorted(p.missing())[:10] for p in peers if p.missing()}
            raise AssertionError(f"no reply to some {what}: {missing}")
        zmq.select([p.socket for p in peers], [], [], 0.1)
        for p in peers:
            p.drain()
