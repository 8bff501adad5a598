"""A server's log cannot be forged or flooded by what peers send (see ``docs/operations.md``).

A real server without keys, with its log in a file, gets messages from raw DEALER sockets whose
routing ids and fields carry line breaks, terminal escapes and Unicode separators; then 10,000
bad messages from one identity and from many. The log must keep one line per logged warning
with no control character in it, stay within the bound the warning throttle's settings give,
and the server must still serve a legitimate job with exact sums.
"""

from __future__ import annotations

import math
import time
import unicodedata
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from kvtest import RawClient, ServerProcess, connect, run_ranks, start_servers, stop_processes

from kvstore import wire
from kvstore.safe_text import WARNING_INTERVAL, WARNINGS_PER_PEER, WARNINGS_TOTAL
from kvstore.wire import Op

pytestmark = pytest.mark.integration

FORGED_LINE = b"2026-11-28 04:40:00,000 CRITICAL [server 0] kvstore.server.server: FORGED"
GARBAGE = b"\xc1\xc1 not msgpack"


def _start_logged_server(tmp_path: Path) -> tuple[ServerProcess, Path]:
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        (server,) = start_servers(1, 2, env={"KVSTORE_LOG_LEVEL": "WARNING"}, stderr=log)
    return server, log_path


def _log_lines(log_path: Path) -> list[str]:
    return log_path.read_bytes().decode("utf-8").split("\n")[:-1]


def _control_characters(line: str) -> list[str]:
    return [c for c in line if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


def _bad_message_replies(client: RawClient, count: int, batch: int = 200) -> None:
    """Send ``count`` garbage messages, each answered by an error (batches keep the server's
    replies within the sockets' queues)."""
    for start in range(0, count, batch):
        n = min(batch, count - start)
        for _ in range(n):
            client.socket.send(GARBAGE)
        for _ in range(n):
            reply = client.receive(timeout=30)
            assert reply.op is Op.ERROR and reply.body.code == "bad_message"


def _assert_exact_sums(address: str) -> None:
    def job(rank: int) -> list[float]:
        with connect([address], rank, 2) as kv:
            kv.init("w", np.zeros(6, np.float32))
            kv.push("w", np.full(6, rank + 1, np.float32))
            out = np.zeros(6, np.float32)
            kv.pull("w", out=out)
            return out.tolist()

    assert run_ranks(2, job) == [[3.0] * 6, [3.0] * 6]


def test_a_forged_identity_and_forged_fields_make_one_clean_line_each(tmp_path: Path) -> None:
    server, log_path = _start_logged_server(tmp_path)
    identity = b"x\n" + FORGED_LINE + b"\x1b[2J\x1b]0;owned\x07\xe2\x80\xa8\xe2\x80\xae\xff"
    client = RawClient(server.address, identity=identity)
    try:
        client.socket.send(GARBAGE)
        assert client.receive().op is Op.ERROR
        hello = {
            "v": wire.PROTOCOL_VERSION,
            "op": int(Op.HELLO),
            "id": 7,
            "nb": [],
            "r": 0,
            "nw": 2,
            "ns": 1,
            "si": 0,
            "ln": 0,
            "m": "dist_sync\n" + FORGED_LINE.decode() + "-MODE\x1b[31m\u2029",
        }
        client.socket.send(msgpack.packb(hello))
        assert client.receive().op is Op.ERROR
        _assert_exact_sums(server.address)
    finally:
        client.close()
        stop_processes([server.process])
    lines = _log_lines(log_path)
    assert lines, "the server logged nothing"
    for line in lines:
        assert not _control_characters(line), line
        assert not line.startswith(FORGED_LINE[:23].decode()), line
    # one line per bad message (the garbage, the forged mode), each naming the identity once
    bad = [line for line in lines if "bad message from" in line]
    assert len(bad) == 2, lines
    shown_identity = (
        "x\\n2026-11-28 04:40:00,000 CRITICAL [server 0] kvstore.server.server: FORGED"
        "\\x1b[2J\\x1b]0;owned\\x07\\u2028\\u202e\\xff"
    )
    assert all(line.count(shown_identity) == 1 for line in bad), bad
    assert "not valid msgpack" in bad[0]
    assert "dist_sync" in bad[1]
    # every line mentioning the forged text is a warning of the server's own, with its prefix
    for line in lines:
        if "FORGED" in line:
            assert " WARNING [server 0] kvstore.server." in line, line


def test_ten_thousand_bad_messages_make_a_bounded_log(tmp_path: Path) -> None:
    server, log_path = _start_logged_server(tmp_path)
    started = time.monotonic()
    clients: list[RawClient] = []
    try:
        flooder = RawClient(server.address, identity=b"flooder")
        clients.append(flooder)
        _bad_message_replies(flooder, 6_000)
        for i in range(100):  # many identities: a stranger can make as many as it likes
            stranger = RawClient(server.address, identity=f"stranger-{i}".encode())
            clients.append(stranger)
            _bad_message_replies(stranger, 40)
        _assert_exact_sums(server.address)
    finally:
        for client in clients:
            client.close()
        stop_processes([server.process])
    windows = math.ceil((time.monotonic() - started) / WARNING_INTERVAL) + 1
    lines = _log_lines(log_path)
    bad = [line for line in lines if "bad message from" in line]
    assert 0 < len(bad) <= WARNINGS_TOTAL * windows, len(bad)
    from_flooder = [line for line in bad if "bad message from flooder:" in line]
    assert 0 < len(from_flooder) <= WARNINGS_PER_PEER * windows, len(from_flooder)
    assert len(lines) <= WARNINGS_TOTAL * windows + 20, len(lines)  # and a few of its own
    assert all(not _control_characters(line) for line in lines)


def test_the_bound_holds_for_many_connections_at_once(tmp_path: Path) -> None:
    """Interleaved senders, each with its own identity, all sending before any reply is read."""
    server, log_path = _start_logged_server(tmp_path)
    started = time.monotonic()
    context = zmq.Context()
    sockets = []
    try:
        for i in range(50):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, f"burst-{i}\n".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.address)
            sockets.append(sock)
        for _ in range(20):
            for sock in sockets:
                sock.send(GARBAGE)
        for sock in sockets:
            for _ in range(20):
                assert sock.poll(30_000), "no reply from the server"
                assert wire.decode(sock.recv_multipart()).op is Op.ERROR
    finally:
        for sock in sockets:
            sock.close(0)
        context.term()
        stop_processes([server.process])
    windows = math.ceil((time.monotonic() - started) / WARNING_INTERVAL) + 1
    bad = [line for line in _log_lines(log_path) if "bad message from" in line]
    assert 0 < len(bad) <= WARNINGS_TOTAL * windows, len(bad)
    assert all("burst-" in line and "\\n" in line for line in bad)
