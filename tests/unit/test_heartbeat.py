"""Heartbeat bookkeeping, settings and errors, without sockets (the integration tests are in
``tests/integration/test_faults.py``)."""

from __future__ import annotations

import pytest

from kvstore import ServerLostError, WorkerLostError, wire
from kvstore.config import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    ServerConfig,
    WorkerOptions,
    heartbeat_interval,
)
from kvstore.errors import ConfigError, ConnectionLostError, ErrorCode, error_from_code
from kvstore.heartbeat import Liveness
from kvstore.wire import Op, ReplyFields
from kvstore.worker.request import Deadline


def _checks(liveness: Liveness, start: float, end: float) -> dict[float, list]:
    """Call ``overdue`` on time, every period from ``start`` to ``end``; its answers by time."""
    answers = {}
    steps = round((end - start) / liveness.period)
    for i in range(steps + 1):
        now = start + i * liveness.period
        answers[now] = liveness.overdue(now)
    return answers


def test_a_peer_is_overdue_once_silent_for_longer_than_the_timeout():
    liveness = Liveness(timeout=3.0, period=0.5)
    liveness.heard.update({"a": 10.0, "b": 11.2})
    answers = _checks(liveness, 10.0, 15.0)
    assert [t for t, late in answers.items() if late == []] == [
        10.0,
        10.5,
        11.0,
        11.5,
        12.0,
        12.5,
        13.0,
    ]
    assert answers[13.5] == answers[14.0] == ["a"]
    assert answers[14.5] == answers[15.0] == ["a", "b"]  # oldest first
    assert liveness.silence("a", 15.0) == pytest.approx(5.0)


def test_a_stall_of_our_own_is_not_taken_for_the_peers_silence():
    liveness = Liveness(timeout=3.0, period=0.5)
    liveness.heard["a"] = 10.0
    assert _checks(liveness, 10.0, 12.0)[12.0] == []
    # This process was stopped for 20 s: its peers' messages wait unread, so nobody is late yet.
    assert liveness.overdue(32.0) == []
    assert liveness.silence("a", 32.0) == 0.0
    answers = _checks(liveness, 32.5, 36.0)
    assert answers[35.0] == [] and answers[35.5] == ["a"]  # a timeout after, still silent
    liveness.heard["a"] = 36.2
    assert liveness.overdue(36.5) == []


def test_liveness_needs_positive_times():
    with pytest.raises(ValueError):
        Liveness(0, 1)


def test_heartbeat_settings():
    assert ServerConfig.from_env({}).heartbeat_timeout == DEFAULT_HEARTBEAT_TIMEOUT == 30.0
    assert ServerConfig.from_env({"KVSTORE_HEARTBEAT_TIMEOUT": "1.5"}).heartbeat_timeout == 1.5
    assert ServerConfig.from_env({"KVSTORE_HEARTBEAT_TIMEOUT": "0"}).heartbeat_timeout == 0.0
    for bad in ("-1", "x", "0.01", "nan"):
        with pytest.raises(ConfigError, match="KVSTORE_HEARTBEAT_TIMEOUT"):
            ServerConfig.from_env({"KVSTORE_HEARTBEAT_TIMEOUT": bad})
    assert WorkerOptions.from_env({"KVSTORE_HEARTBEAT_TIMEOUT": "2"}).heartbeat_timeout == 2.0
    assert WorkerOptions.from_env({}, heartbeat_timeout=0).heartbeat_timeout == 0.0
    assert WorkerOptions().heartbeat_timeout == 30.0
    assert ServerConfig().heartbeat_timeout == 0.0  # (in-process servers: off)
    with pytest.raises(ConfigError):
        ServerConfig(heartbeat_timeout=-1)
    assert heartbeat_interval(30) == 5.0  # at most 5 s
    assert heartbeat_interval(1.5) == 0.25  # a sixth of the timeout


def test_lost_peers_errors():
    error = error_from_code(ErrorCode.WORKER_LOST, "rank 2 lost", "server 0 (tcp://h:1)", 2)
    assert isinstance(error, WorkerLostError) and isinstance(error, ConnectionError)
    assert error.rank == 2 and str(error) == "server 0 (tcp://h:1): rank 2 lost"
    server = ServerLostError("gone", 1, "tcp://h:2")
    assert isinstance(server, ConnectionLostError)  # code catching that keeps working
    assert (server.server, server.address) == (1, "tcp://h:2")


def test_wire_carries_the_lost_rank_and_the_servers_heartbeat():
    frames = wire.error(7, ErrorCode.WORKER_LOST, "lost", lost_rank=3)
    message = wire.decode(frames)
    assert message.op is Op.ERROR and message.body.lost_rank == 3
    assert "lr" not in wire.decode(wire.error(7, ErrorCode.BAD_VALUE, "no")).fields
    assert (
        wire.decode(wire.reply(1, ReplyFields(server_rank=0, heartbeat_ms=1500))).body.heartbeat_ms
        == 1500
    )
    assert wire.decode(wire.encode(Op.PING, 9)).op is Op.PING


def test_a_deadline_is_shared_by_the_waits_of_one_call():
    assert Deadline(None).remaining() is None
    deadline = Deadline(1000.0)
    first = deadline.remaining()
    assert first is not None and 999.0 < first <= 1000.0
    assert Deadline(0.0).remaining() == 0.0
