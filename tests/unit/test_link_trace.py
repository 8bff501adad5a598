"""The link tracer of the cluster benchmark: its sampler on a real interface, its summaries."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from benchmarks.bench_cluster import _host_roles
from benchmarks.link_trace import LinkTrace, by_role, summarize

RATE = 125e6  # bytes/s: 1 Gbit/s


def _ramp(times: np.ndarray, rate_of) -> np.ndarray:
    """Cumulative bytes of a link whose rate at time t is ``rate_of(t)`` (1 ms steps)."""
    return np.concatenate(([0.0], np.cumsum(rate_of(times[:-1]) * np.diff(times))))


def test_summary_sorts_a_links_time_into_full_partial_and_idle_bins():
    times = np.arange(0, 1.0001, 0.001)
    busy_then_idle = _ramp(times, lambda t: np.where(t < 0.5, RATE, 0.0))
    half_rate = _ramp(times, lambda t: np.full_like(t, RATE / 2))
    counters = np.stack([busy_then_idle, half_rate], axis=1)
    first, second = summarize(times, counters, RATE, [(0.0, 1.0)])
    assert first["utilization"] == pytest.approx(0.5, abs=0.01)
    assert first["full"] == pytest.approx(0.5, abs=0.01)
    assert first["idle"] == pytest.approx(0.5, abs=0.01)
    assert second["utilization"] == pytest.approx(0.5, abs=0.01)
    assert second["partial"] == pytest.approx(1.0, abs=0.01)
    assert first["sample_gap_ms"] == pytest.approx(1.0, abs=0.01)
    assert (first["head_ms"], first["tail_ms"]) == (0.0, 500.0)  # idle for its second half
    assert (second["head_ms"], second["tail_ms"]) == (0.0, 0.0)


def test_summary_counts_only_the_steps_not_the_time_between_them():
    times = np.arange(0, 1.0001, 0.001)
    # two steps at full rate with an idle barrier between them
    steps = [(0.1, 0.4), (0.5, 0.8)]

    def rate(t):
        return np.where(((t >= 0.1) & (t < 0.4)) | ((t >= 0.5) & (t < 0.8)), RATE, 0.0)

    (summary,) = summarize(times, _ramp(times, rate)[:, None], RATE, steps)
    assert summary["full"] == pytest.approx(1.0, abs=0.02)
    assert summary["utilization"] == pytest.approx(1.0, abs=0.02)
    (whole,) = summarize(times, _ramp(times, rate)[:, None], RATE, [(0.1, 0.8)])
    assert whole["idle"] == pytest.approx(1 / 7, abs=0.02)
    assert whole["head_ms"] == 0.0 and whole["tail_ms"] == 0.0  # the idle part is inside
    late = lambda t: np.where((t >= 0.13) & (t < 0.38), RATE, 0.0)  # noqa: E731
    (summary,) = summarize(times, _ramp(times, late)[:, None], RATE, [(0.1, 0.4)])
    assert summary["head_ms"] == pytest.approx(30.0, abs=5.0)
    assert summary["tail_ms"] == pytest.approx(20.0, abs=5.0)


def test_summary_counts_only_the_window_and_reports_the_samplers_gaps():
    times = np.concatenate((np.arange(0, 0.5, 0.001), np.arange(0.52, 1.0001, 0.001)))
    idle_then_busy = _ramp(times, lambda t: np.where(t >= 0.6, RATE, 0.0))
    (summary,) = summarize(times, idle_then_busy[:, None], RATE, [(0.6, 0.9)])
    assert summary["full"] == pytest.approx(1.0, abs=0.02)
    assert summary["utilization"] == pytest.approx(1.0, abs=0.02)
    (whole,) = summarize(times, idle_then_busy[:, None], RATE, [(0.0, 1.0)])
    assert whole["sample_gap_ms"] == pytest.approx(21.0, abs=0.5)  # 0.499 to 0.52 s
    # a window the samples do not cover, or shorter than a bin, has no summary
    assert summarize(times, idle_then_busy[:, None], RATE, [(0.5, 1.5)]) is None
    assert summarize(times, idle_then_busy[:, None], RATE, [(0.5, 0.501)]) is None


def test_links_are_grouped_by_their_hosts_role_and_the_busiest_is_named():
    def shares(utilization):
        return {"utilization": utilization, "full": utilization, "partial": 0.0,
                "idle": 1 - utilization, "head_ms": 10.0, "tail_ms": 20.0,
                "sample_gap_ms": 1.5}  # fmt: skip

    # hosts: server 0, server 1, worker 0; per host its uplink then its downlink
    summaries = [shares(0.8), shares(0.6), shares(0.4), shares(0.9), shares(0.5), shares(0.7)]
    links = by_role(summaries, ["server", "server", "worker"])
    assert links["server uplink"]["utilization"] == pytest.approx(0.6)
    assert links["server downlink"]["utilization"] == pytest.approx(0.75)
    assert links["worker uplink"]["idle"] == pytest.approx(0.5)
    assert links["busiest"] == {"link": "server 1 downlink", "utilization": 0.9, "full": 0.9,
                                "partial": 0.0, "idle": pytest.approx(0.1), "head_ms": 10.0,
                                "tail_ms": 20.0}  # fmt: skip
    assert links["worker downlink"]["tail_ms"] == 20.0
    assert links["sample_gap_ms"] == 1.5


def test_host_roles_follow_the_placement():
    assert _host_roles([0, 1], [2, 3, 4]) == ["server", "server", "worker", "worker", "worker"]
    assert _host_roles([0, 1], [0, 1, 2]) == ["server+worker", "server+worker", "worker"]


def test_the_sampler_reads_a_real_interfaces_counters():
    """On loopback (every machine has one): bytes sent through it show in its counters."""
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with LinkTrace(["lo"]) as trace:
            for _ in range(200):
                sender.sendto(b"x" * 1000, receiver.getsockname())
                receiver.recv(2000)
    finally:
        sender.close()
        receiver.close()
    assert len(trace.times) >= 2 and np.all(np.diff(trace.times) > 0)
    assert trace.counters.shape == (len(trace.times), 2)
    sent, received = trace.counters[-1] - trace.counters[0]
    assert sent >= 200 * 1000 and received >= 200 * 1000  # loopback: what it sends it receives


def test_a_sampler_that_cannot_read_its_counters_fails_the_block():
    with pytest.raises(RuntimeError, match="failed to start"):
        with LinkTrace(["no-such-interface"]):
            pass
