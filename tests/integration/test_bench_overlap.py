"""The overlap benchmark's smoke preset runs its modes end to end and reports them (no timing
is asserted: the values are the machine's), and its bookkeeping adds up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvtest import REPO

from benchmarks.bench_overlap import Phases, _in_run, push_timing

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WRAPPER_MODES = {"wrapper none", "wrapper bucket", "wrapper mgs", "wrapper mgs-measured"}


def test_smoke_preset_reports_every_mode_against_push_after_backward():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_overlap", "--preset", "smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    modes = {r["mode"]: r for r in records if "mode" in r}
    summary = records[-1]
    assert set(modes) == {"push-after-backward", *WRAPPER_MODES}
    assert summary["network"] in ("netns", "loopback")  # loopback where netns is unavailable

    depth = summary["depth"]
    baseline = modes["push-after-backward"]
    # one key per parameter (weight and bias of each layer), shared by the two unbucketed modes
    assert baseline["keys"] == modes["wrapper none"]["keys"] == 2 * depth
    assert modes["wrapper bucket"]["keys"] < 2 * depth  # a quarter of the bytes per bucket
    assert baseline["ratio_to_push_after_backward"] == 1.0
    for name, record in modes.items():
        assert len(record["step_seconds"]) == 2, record  # the smoke preset's timed steps
        for field in ("seconds_per_step", "ratio_to_push_after_backward"):  # reported, not bounded
            assert isinstance(record[field], float), (name, field)
        for field in ("rate_mbit", "params", "batch", "backward_alone_seconds",
                      "communication_alone_seconds"):  # fmt: skip
            assert field in record, (name, field)
    for name in WRAPPER_MODES:
        record = modes[name]
        # every key is pushed once a step, all of them from backward's hooks (every parameter
        # of the model has a gradient), the first before backward ended
        assert record["pushes"] == record["keys"], record
        assert record["pushes_in_backward"] == record["keys"], record
        assert record["bytes_in_backward"] == 1.0
        assert 0 <= record["first_push"] <= record["last_push_end"]
    assert "pushes" not in baseline  # its pushes come after backward

    assert summary["ratios"] == {
        name: modes[name]["ratio_to_push_after_backward"] for name in WRAPPER_MODES
    }
    assert summary["best_ratio"] == min(summary["ratios"].values())
    assert 1 <= summary["batch"] <= 64  # the smoke preset's largest batch
    assert 0 < summary["full_overlap_ratio"] <= 1
    assert "cpu" in summary["machine"] and "torch" in summary["machine"]


def test_perfect_overlap_hides_the_shorter_of_backward_and_communication():
    steps = {"forward_seconds": 1.0, "update_seconds": 0.5, "backward_seconds": 2.0}
    equal = _in_run({**steps, "wait_seconds": 2.0})
    assert equal["full_overlap_ratio"] == pytest.approx((1.5 + 2.0) / (1.5 + 4.0), abs=1e-3)
    longer = _in_run({**steps, "wait_seconds": 3.0})  # communication longer than backward
    assert longer["full_overlap_ratio"] == pytest.approx((1.5 + 3.0) / (1.5 + 5.0), abs=1e-3)


def test_push_timing_is_relative_to_backward_and_counts_what_it_covered():
    phases = Phases(started_at=0.0, start=10.0, forward_end=11.0, backward_end=13.0,
                    communication_end=14.0, end=14.5)  # fmt: skip
    # (start, end, bytes): two pushes inside backward, one made by step() after it
    calls = [(11.5, 11.6, 300), (12.5, 12.7, 100), (13.2, 13.3, 600)]
    timing = push_timing(calls, phases)
    assert timing["pushes"] == 3 and timing["pushes_in_backward"] == 2
    assert timing["bytes_in_backward"] == pytest.approx(0.4)
    assert timing["first_push"] == pytest.approx(0.5)
    assert timing["last_push_end"] == pytest.approx(2.3)
    assert timing["push_call_seconds_in_backward"] == pytest.approx(0.3)
    assert push_timing([], phases) == {}
