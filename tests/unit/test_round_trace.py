"""The round tracer of the cluster benchmark: its hooks on a server class, its summaries."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from kvtest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from round_trace import instrument, summarize  # noqa: E402


def _round(events, server_key, chunk, push_times, reply_times):
    """Append one round of ``chunk``: a push per worker at ``push_times``, a reply per worker at
    ``reply_times``."""
    for rank, t in enumerate(push_times):
        events.append(("push", t, rank, server_key, chunk))
    for rank, t in enumerate(reply_times):
        events.append(("reply", t, rank, server_key, chunk))


def test_summary_measures_spread_lag_and_step_landmarks():
    server = []
    # step 1 spans [10.0, 10.5]: chunk 0's pushes 20 ms apart, answered 1 ms after the last;
    # chunk 1's 40 ms apart, answered 3 ms after.
    _round(server, "w", 0, [10.010, 10.030], [10.031, 10.032])
    _round(server, "w", 1, [10.100, 10.140], [10.143, 10.150])
    # step 2 spans [11.0, 11.5], the same pattern shifted by a second
    _round(server, "w", 0, [11.010, 11.030], [11.031, 11.032])
    _round(server, "w", 1, [11.100, 11.140], [11.143, 11.150])
    # between the steps (a barrier): outside every span, not counted
    _round(server, "w", 0, [10.700, 10.900], [10.950, 10.960])
    summary = summarize([server], [(10.0, 10.5), (11.0, 11.5)], num_workers=2)
    assert summary["rounds"] == 4
    assert summary["first_push_ms"] == pytest.approx(10.0)
    assert summary["first_round_ms"] == pytest.approx(30.0)
    assert summary["last_push_ms"] == pytest.approx(140.0)
    assert summary["last_reply_ms"] == pytest.approx(150.0)
    assert summary["step_ms"] == pytest.approx(500.0)
    assert summary["spread_ms"] == pytest.approx(30.0)  # median of 20, 40, 20, 40
    assert summary["spread_p90_ms"] == pytest.approx(40.0)
    assert summary["reply_lag_ms"] == pytest.approx(2.0)  # median of 1, 3, 1, 3
    assert summary["reply_lag_p90_ms"] == pytest.approx(3.0)


def test_a_round_needs_every_workers_push_and_keys_with_the_same_chunk_stay_apart():
    server = []
    _round(server, "a", 0, [1.01, 1.02, 1.03], [1.04])  # complete with 3 workers
    _round(server, "b", 0, [1.05, 1.06], [])  # one push short: not a round
    summary = summarize([server], [(1.0, 2.0)], num_workers=3)
    assert summary["rounds"] == 1
    assert summary["spread_ms"] == pytest.approx(20.0)
    assert summary["reply_lag_ms"] == pytest.approx(10.0)
    assert summary["last_push_ms"] == pytest.approx(60.0)  # the incomplete round still counts
    assert summarize([server], [(5.0, 6.0)], num_workers=3) is None  # no round in the span
    assert summarize([[]], [(1.0, 2.0)], num_workers=3) is None


def test_rounds_of_several_servers_are_pooled():
    first, second = [], []
    _round(first, "w", 0, [1.010, 1.020], [1.021, 1.021])
    _round(second, "w", 1, [1.010, 1.050], [1.060, 1.060])
    summary = summarize([first, second], [(1.0, 2.0)], num_workers=2)
    assert summary["rounds"] == 2
    assert summary["first_round_ms"] == pytest.approx(35.0)  # median of the servers' 20 and 50


def test_instrument_records_pushes_and_value_replies_and_calls_through():
    calls = []

    class Server:
        def _on_push(self, identity, rank, msg):
            calls.append(("push", identity, rank, msg["c"]))

        def _send_value(self, reply, chunk, *acks):
            calls.append(("reply", reply.rank, chunk.spec.index, acks))

    events = []
    instrument(Server, events)
    server = Server()
    server._on_push(b"id", 1, {"k": "w", "c": 3})
    chunk = SimpleNamespace(spec=SimpleNamespace(key="w", index=3))
    server._send_value(SimpleNamespace(rank=1), chunk)
    server._send_value(SimpleNamespace(rank=0), chunk, [7])
    assert calls == [("push", b"id", 1, 3), ("reply", 1, 3, ()), ("reply", 0, 3, ([7],))]
    assert [(kind, rank, key, index) for kind, _, rank, key, index in events] == [
        ("push", 1, "w", 3),
        ("reply", 1, "w", 3),
        ("reply", 0, "w", 3),
    ]
    assert events[0][1] <= events[1][1] <= events[2][1]
