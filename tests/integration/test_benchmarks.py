"""Every benchmark runs its smoke preset and prints parseable JSON lines (no timing asserted)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtest import REPO

from benchmarks import time_to_accuracy
from benchmarks.bench_cluster import (
    MAX_WARMUP_STEPS,
    CpuMonitor,
    floor_seconds,
    timed_steps,
    warmup_steps,
)
from benchmarks.netns import (
    _ALLOWED_CC,
    _AVAILABLE_CC,
    LINUX_GSO_MAX_BYTES,
    Cluster,
    available,
    host_cpus,
)
from benchmarks.report import _cell

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def run(module: str, *args: str) -> list[dict]:
    """Run ``python -m benchmarks.<module> --preset smoke ARGS`` from the repository's root."""
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--preset", "smoke", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert records, "no output"
    return records


def test_codec_benchmark_smoke():
    records = run("bench_codecs")
    ops = {r.get("op") for r in records}
    assert {"a += b (numpy)", "2bit encode (numba)", "2bit decode+accumulate (numba)"} <= ops
    assert {"qsgd (levels 15) encode (numba)", "1bit decode+accumulate (numba)"} <= ops
    assert "powersgd worker step (numba)" in ops
    sketch = "sketch rows=5 columns=0.004"
    assert {f"{sketch} encode (numba)", f"{sketch} server round, 8 pushes (numba)"} <= ops
    assert {f"{sketch} topk server round, 8 pushes (numba)", f"{sketch} estimates (numba)"} <= ops
    assert all(r["ratio_to_add"] > 0 for r in records if "ratio_to_add" in r)
    assert "machine" in records[-1]


def test_host_reduce_benchmark_smoke():
    records = [r for r in run("bench_host_reduce") if "path" in r]
    assert [(r["path"], r["workers"]) for r in records] == [
        ("shared_memory", 2),
        ("shared_memory", 4),
    ]
    for record in records:  # (each worker checked its sums before timing)
        assert record["floor_ms"] > 0 and record["reduce_ms"] > 0 and record["meeting_ms"] > 0


def test_pushpull_benchmark_smoke():
    records = run("bench_pushpull")
    configs = {r.get("config") for r in records}
    assert {"bare pyzmq", "bare pyzmq pipelined", "kvstore none", "kvstore 2bit"} <= configs
    assert {"kvstore none pushpull", "kvstore none borrow"} <= configs
    summary = records[-1]
    assert summary["dense_over_bare_pyzmq"] > 0 and summary["twobit_over_dense"] > 0
    assert summary["twobit_dense_pull_over_dense"] > 0
    assert summary["pushpull_over_push_and_pull"] > 0
    assert summary["borrow_over_push_and_pull"] > 0
    # the same configurations with the job's CURVE keys, in the same run
    assert {"kvstore none curve", "kvstore 2bit curve"} <= configs
    assert summary["curve_over_plain_dense"] > 0 and summary["curve_over_plain_2bit"] > 0


def test_cluster_benchmark_smoke_or_reports_why_not(tmp_path):
    out = tmp_path / "cluster.jsonl"
    records = run("bench_cluster", "--out", str(out), "--baselines", "zmq", "--link-trace")
    if "skipped" in records[0]:  # no root or no iproute2 here: the harness says why
        assert records[0]["skipped"]
        return
    kv = [r for r in records if r.get("system") == "kvstore"]
    assert {r["codec"] for r in kv} == {"none", "2bit", "2bit-agg"}
    bare = [r for r in records if r.get("system") == "zmq"]
    assert len(bare) == 1, records  # one bare pyzmq cell per configuration
    dense = next(r for r in kv if r["codec"] == "none")
    assert bare[0]["floor_seconds"] == dense["floor_seconds"]  # the dense bytes, moved bare
    for r in [*kv, *bare]:
        assert "error" not in r, r
        timed = [r["seconds_per_step"], r["floor_seconds"], *r["step_seconds"]]
        assert min(timed) > 0, r  # times were measured (no bound: their values are the load's)
        assert r["tcp_cc"] == "cubic"
        # every step's time is kept; the reported time is their median
        assert len(r["step_seconds"]) == 2 and len(r["warmup_step_seconds"]) == r["warmup_steps"]
        median = statistics.median(r["step_seconds"])
        assert r["seconds_per_step"] == pytest.approx(median, abs=1e-3)
        # --link-trace: how busy each role's links were over the timed steps
        links = r["links"]
        assert links is not None, r  # the sampler covered the timed steps
        assert {"server uplink", "server downlink", "worker uplink", "worker downlink"} < set(links)
        for name in ("worker uplink", "server downlink", "busiest"):
            shares = links[name]
            assert 0 < shares["utilization"] <= 1.05, links  # the pushes crossed these links
            assert abs(shares["full"] + shares["partial"] + shares["idle"] - 1) < 0.01
    report = subprocess.run(
        [sys.executable, "-m", "benchmarks.report", str(out)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert "| key1m | 2 | 1 | separate |" in report.stdout
    assert "bare pyzmq, dense bytes" in report.stdout
    assert "steps: the fastest and slowest timed step" in report.stdout  # the legend says so


def test_cluster_warmup_is_about_the_requested_time_at_the_floors_pace():

    assert warmup_steps(3.0, 0.64) == 5
    assert warmup_steps(3.0, 2.7) == 2
    assert warmup_steps(3.0, 0.01) == MAX_WARMUP_STEPS
    assert warmup_steps(0.0, 0.64) == 1  # smoke: one step
    calls = []
    report = timed_steps(3, lambda: calls.append("barrier"), lambda: calls.append("step"), 2)
    assert len(report["times"]) == 3 and calls.count("step") == 5
    assert len(report["starts"]) == 3 and report["starts"] == sorted(report["starts"])
    assert report["window"][0] <= report["starts"][0] <= report["window"][1]
    assert len(report["warmup_times"]) == 2
    assert calls.count("barrier") == 6  # one before each step and one at the end


def test_cluster_report_names_cells_whose_steps_had_not_settled():

    base = {"seconds_per_step": 1.7, "over_floor": 1.04, "cpu_busy": 0.3}
    settled = _cell({**base, "step_seconds": [1.69, 1.70, 1.72, 1.71, 1.70]})
    unsettled = _cell({**base, "step_seconds": [2.35, 1.80, 1.77, 1.73, 1.71]})
    assert settled == "1.700 (1.04x, cpu 30%)"
    assert unsettled == "1.700 (1.04x, cpu 30%, steps 1.710-2.350 s)"
    assert _cell(base) == settled  # records from before step times were kept


# Waits for a line on stdin, then uses argv[1] seconds of CPU time (not of wall time: however
# long the machine's other work makes that take), says so, and waits for another line before it
# exits, so that a monitor reads its final count while it still runs.
_WORKER = """
import sys, time
print("ready", flush=True)
sys.stdin.readline()
start = time.process_time()
while time.process_time() - start < float(sys.argv[1]):
    pass
print("done", flush=True)
sys.stdin.readline()
"""

_SPIN_CPU_S = 0.5


def _ticks(monitor, start: float, end: float) -> dict[str, int]:
    """The monitor's counts (jiffies) between its first and last sample in [start, end]; the
    samples are ``(time, total, idle, stolen, job)`` (see ``CpuMonitor.__init__``)."""
    inside = [s for s in monitor.samples if start <= s[0] <= end]
    assert len(inside) >= 2, "the monitor took no samples in the window"
    first, last = inside[0], inside[-1]
    names = ("total", "idle", "steal", "job")
    return {name: last[i] - first[i] for i, name in enumerate(names, start=1)}


_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
print(child.pid, flush=True)
sys.stdin.read()
child.kill()
child.wait()
"""


def test_cpu_monitor_counts_the_processes_a_job_starts_only_when_asked():
    """A peer's daemon is a child of its worker: ``descendants`` charges it to the job."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        assert sorted(CpuMonitor([parent.pid], descendants=True)._tree()) == sorted(
            [parent.pid, child]
        )
        assert CpuMonitor([parent.pid])._tree() == [parent.pid]
    finally:
        parent.stdin.close()  # the parent stops its child, then exits
        parent.wait(timeout=60)
        parent.stdout.close()


def test_cluster_cpu_use_charges_the_job_with_its_own_processes_only():
    """Behaviour, not shares of the machine (those depend on whatever else runs): a process
    that spins for a known amount of CPU time is counted when it is in the job and not
    otherwise, one that sleeps is counted as ~0, and every field is a fraction."""

    hz = os.sysconf("SC_CLK_TCK")
    busy = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(_SPIN_CPU_S)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    idle = subprocess.Popen(
        [sys.executable, "-c", _WORKER, "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    monitors = {}
    try:
        for process in (busy, idle):  # started up: their start-up's CPU time is not counted
            assert process.stdout.readline() == "ready\n"

        def sampled_since(moment: float) -> None:
            # hang guard only: a sample comes every 100 ms
            deadline = time.monotonic() + 60
            while not all(m.samples and m.samples[-1][0] > moment for m in monitors.values()):
                assert time.monotonic() < deadline, "a monitor stopped sampling"
                time.sleep(0.01)

        with (
            CpuMonitor([busy.pid]) as monitors["busy"],
            CpuMonitor([idle.pid]) as monitors["idle"],
            CpuMonitor([]) as monitors["none"],
        ):
            start = time.time()
            sampled_since(start)  # every window opens before the spinning starts
            for process in (busy, idle):
                process.stdin.write("go\n")
                process.stdin.flush()
            for process in (busy, idle):
                assert process.stdout.readline() == "done\n"
            sampled_since(time.time())  # ... and closes after it ended, both still alive
            end = time.time()
    finally:
        for process in (busy, idle):
            process.kill()
            process.wait()
            process.stdin.close()
            process.stdout.close()
    ticks = {name: _ticks(monitor, start, end) for name, monitor in monitors.items()}
    # The spinner's CPU time, as the kernel counted it, is the job's when its pid is.
    assert ticks["busy"]["job"] >= 0.8 * _SPIN_CPU_S * hz, ticks
    assert ticks["idle"]["job"] <= 0.02 * hz, ticks  # a process blocked on a read
    assert ticks["none"]["job"] == 0, ticks
    # Outside the job, the spinner's work is still busy time: the rest's, not the job's.
    machine = ticks["idle"]
    rest = machine["total"] - machine["idle"] - machine["steal"] - machine["job"]
    assert rest >= 0.8 * ticks["busy"]["job"], ticks

    for monitor in monitors.values():
        usage = monitor.usage(start, end)
        assert set(usage) == {"cpu_busy", "cpu_job", "cpu_steal", "cpu_others"}
        assert all(0 <= share <= 1 for share in usage.values()), usage
        # the busy time is split three ways (each share is rounded to 0.01)
        parts = usage["cpu_job"] + usage["cpu_steal"] + usage["cpu_others"]
        assert usage["cpu_busy"] == pytest.approx(parts, abs=0.02), usage
    assert monitors["none"].usage(start, end)["cpu_job"] == 0
    assert monitors["busy"].usage(end + 10, end + 20) == {}  # no samples there


def test_cluster_floors_count_the_bytes_each_codec_moves():

    keys = [("w", (10_000_000,))]
    rate = 125e6  # 1 Gbit/s
    # 2 workers, 1 server on its own host: the server link carries both workers' traffic
    dense, dense_bytes = floor_seconds(keys, "none", 2, [0], [1, 2], rate)
    assert dense_bytes == 2 * 40e6 and dense == dense_bytes / rate
    _, push_2bit = floor_seconds(keys, "2bit", 2, [0], [1, 2], rate)
    assert push_2bit == 2 * 40e6  # the weights are pulled dense: the server's uplink
    _, relayed = floor_seconds(keys, "2bit-agg", 2, [0], [1, 2], rate)
    assert relayed == 2 * 2 * 2.5e6  # each worker pulls both pushes back
    _, both = floor_seconds(keys, "2bit-both", 2, [0], [1, 2], rate)
    assert both == 2 * 2.5e6  # compressed pulls: 2 bits per element back to each worker
    # 9 workers is past the relay limit (8): the sum is pulled dense again
    _, nine = floor_seconds(keys, "2bit-agg", 9, [0], list(range(1, 10)), rate)
    assert nine == 9 * 40e6
    # a worker on the server's host crosses no link
    _, colocated = floor_seconds(keys, "none", 1, [0], [0], rate)
    assert colocated == 0


@pytest.mark.parametrize("algorithm", ["reno", "cubic"])
def test_cluster_hosts_use_the_pinned_congestion_control(algorithm):

    why_not = available()
    if why_not is not None:
        pytest.skip(why_not)
    if algorithm not in _AVAILABLE_CC.read_text().split():
        pytest.skip(f"{algorithm} is not available in this kernel")
    allowed_before = _ALLOWED_CC.read_text()
    with Cluster(2, tcp_cc=algorithm) as cluster:
        for host in cluster.hosts:
            setting = subprocess.run(
                ["ip", "netns", "exec", host.namespace, "sysctl", "-n",
                 "net.ipv4.tcp_congestion_control"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            assert setting.stdout.strip() == algorithm
        namespaces = [host.namespace for host in cluster.hosts]
    # the machine is left as it was: its allowed list, and no namespace behind
    assert _ALLOWED_CC.read_text() == allowed_before
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in namespaces)


_REPORT_CORES = """
import os, threading
seen = []
thread = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
thread.start()
thread.join()
print(sorted(os.sched_getaffinity(0)), seen[0])
"""


def _cores_seen(cluster, host: int) -> str:
    """What a process started in ``host`` and a thread of it report as their cores."""
    child = cluster.popen(
        host, [sys.executable, "-c", _REPORT_CORES], stdout=subprocess.PIPE, text=True
    )
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    return out.strip()


def test_cluster_pins_each_hosts_processes_and_their_threads_to_its_cores():

    why_not = available()
    if why_not is not None:
        pytest.skip(why_not)
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed")
    cores = sorted(os.sched_getaffinity(0))
    with Cluster(3, pin_cpus=True) as cluster:
        assert [host.cpus for host in cluster.hosts] == host_cpus(3, cores)
        for host in cluster.hosts:
            assert _cores_seen(cluster, host.index) == f"{list(host.cpus)} {list(host.cpus)}"
    with Cluster(2) as cluster:  # unpinned: the machine's scheduler places them
        assert all(host.cpus is None for host in cluster.hosts)
        assert _cores_seen(cluster, 0) == f"{cores} {cores}"


_BULK_SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], 5555)) as conn:
    conn.sendall(bytes(32 << 20))
"""
_BULK_RECEIVER = """
import socket
with socket.create_server(("0.0.0.0", 5555)) as server:
    conn, _ = server.accept()
    with conn:
        while conn.recv(1 << 20):
            pass
"""


@pytest.mark.parametrize("gso_kib", [64, 192])
def test_cluster_hosts_send_tcp_in_units_of_the_requested_size(gso_kib):
    """32 MB from one host to another: the packets the sender's link carried average what the
    hosts were told to send (BIG TCP above 64 KiB), and no more."""

    why_not = available()
    if why_not is not None:
        pytest.skip(why_not)
    release = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    if gso_kib * 1024 > LINUX_GSO_MAX_BYTES and release < (6, 3):
        pytest.skip(f"Linux {os.uname().release} has no IPv4 units above 64 KiB (6.3 and later)")
    with Cluster(2, mtu=9000, gso_max_bytes=gso_kib * 1024) as cluster:
        assert cluster.gso_max_bytes == gso_kib * 1024
        receiver = cluster.popen(1, [sys.executable, "-c", _BULK_RECEIVER])
        counters = Path("/sys/class/net") / cluster.bridge_port(0) / "statistics"
        before = [int((counters / f).read_text()) for f in ("rx_bytes", "rx_packets")]
        deadline = time.monotonic() + 60  # a hang guard: the receiver starts in a second
        while True:  # until the receiver listens
            sender = cluster.popen(
                0, [sys.executable, "-c", _BULK_SENDER, cluster.hosts[1].address]
            )
            if sender.wait(timeout=60) == 0:
                break
            assert time.monotonic() < deadline, "the receiver never listened"
            time.sleep(0.1)
        assert receiver.wait(timeout=60) == 0
        after = [int((counters / f).read_text()) for f in ("rx_bytes", "rx_packets")]
    sent, packets = after[0] - before[0], after[1] - before[1]
    assert sent >= 32 << 20
    average = sent / packets  # data units, plus the handshake's few small packets
    assert average <= gso_kib * 1024 + 200
    assert average > (gso_kib * 1024) * 0.6, average


def test_cluster_refuses_units_larger_than_its_shapers_bucket():

    with pytest.raises(ValueError, match="gso_max_bytes=262144"):
        Cluster(2, burst_bytes=256 * 1024, gso_max_bytes=256 * 1024)


def test_cluster_benchmark_runs_each_kvstore_cell_without_and_with_keys():
    records = run("bench_cluster", "--codecs", "none", "--auth", "both")
    if "skipped" in records[0]:
        assert records[0]["skipped"]
        return
    kv = [r for r in records if r.get("system") == "kvstore"]
    assert [r["auth"] for r in kv] == [False, True], records  # one after the other
    for r in kv:
        assert "error" not in r, r
        assert "seconds_per_step" in r, r


def test_cluster_benchmark_hosts_of_two_workers_push_one_host_s_bytes():
    records = run("bench_cluster", "--codecs", "none", "--workers", "4", "--per-host", "2",
                  "--hierarchy", "both", "--steps", "1")  # fmt: skip
    if "skipped" in records[0]:
        assert records[0]["skipped"]
        return
    kv = [r for r in records if r.get("system") == "kvstore"]
    assert [(r["workers_per_host"], r["hierarchy"]) for r in kv] == [(2, False), (2, True)]
    for r in kv:
        assert "error" not in r, r
    flat, hier = kv
    model = 1_000_000 * 4  # key1m, dense both ways
    # each worker of a host on its own: the host's link carries both workers' pushes and
    # pulls; aggregated on the host: one model's bytes each way
    assert flat["host_up_bytes_per_step"] == pytest.approx(2 * model, rel=0.01)
    assert flat["host_down_bytes_per_step"] == pytest.approx(2 * model, rel=0.01)
    assert hier["host_up_bytes_per_step"] == pytest.approx(model, rel=0.01)
    assert hier["host_down_bytes_per_step"] == pytest.approx(model, rel=0.01)
    assert hier["floor_seconds"] == pytest.approx(flat["floor_seconds"] / 2, rel=0.01)


def test_a_cluster_benchmark_stopped_with_sigterm_tears_its_hosts_down(tmp_path):

    why_not = available()
    if why_not is not None:
        pytest.skip(why_not)
    allowed_before = _ALLOWED_CC.read_text()
    log = open(tmp_path / "stderr.txt", "w+")  # a file, not a pipe: nothing can block on it
    bench = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_cluster", "--preset", "smoke",
         "--codecs", "none", "--baselines=", "--steps", "100000"],
        stdout=subprocess.DEVNULL, stderr=log, text=True, cwd=REPO,
    )  # fmt: skip
    prefix = f"kvh{bench.pid % 100000}-"
    children: list[int] = []  # the finally below reads it even if the loop never ran
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not children:  # wait until the job runs
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
            for line in listed.stdout.splitlines():
                if line.startswith(prefix):
                    pids = subprocess.run(
                        ["ip", "netns", "pids", line.split()[0]], capture_output=True, text=True
                    )
                    children += [int(pid) for pid in pids.stdout.split()]
            time.sleep(0.2)
        assert children, "the benchmark started no process in its hosts"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM, log.read()[-2000:]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        log.close()
        bridge = f"kvbr{bench.pid % 100000}"
        left = _tear_down_leftovers(prefix, bridge, children, _ALLOWED_CC, allowed_before)
    assert left == [], f"the benchmark left behind: {left}"


def _tear_down_leftovers(
    prefix: str, bridge: str, pids: list[int], allowed_cc_file: Path, allowed_cc: str
) -> list[str]:
    """Remove what a stopped benchmark left (so a failing test cleans up too); says what it was."""
    left = []
    for pid in pids:
        if os.path.exists(f"/proc/{pid}"):
            left.append(f"process {pid}")
            os.kill(pid, signal.SIGKILL)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]:
        left.append(f"namespace {name}")
        subprocess.run(["ip", "netns", "del", name], check=False)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    if f" {bridge}:" in links:
        left.append(f"bridge {bridge}")
        subprocess.run(["ip", "link", "del", bridge], check=False)
    if allowed_cc_file.read_text() != allowed_cc:
        left.append(f"allowed congestion controls {allowed_cc_file.read_text().strip()!r}")
        allowed_cc_file.write_text(allowed_cc)
    return left


def test_time_to_accuracy_smoke_or_reports_why_not(tmp_path):
    out = tmp_path / "tta.jsonl"
    # A target one epoch of the MLP reaches: every run has a time, DiLoCo's a floor.
    records = run(
        "time_to_accuracy", "--out", str(out), "--table", str(tmp_path / "t.md"), "--target", "0.5"
    )
    if "skipped" in records[0] and "run" not in records[0]:  # no root or no iproute2 here
        assert records[0]["skipped"]
        return
    # The smoke preset runs no peer: it says for each peer's run whether it could run here.
    peers = [r for r in records if "skipped" in r]
    assert sorted(r["run"] for r in peers) == sorted(
        name for name, run in time_to_accuracy.RUNS.items() if "peer" in run
    )
    assert all(r["skipped"] for r in peers)
    epochs = [r for r in records if "epoch" in r]
    # one epoch each, then DiLoCo's again on links that cost nothing (its compute floor)
    assert [r["run"] for r in epochs] == ["ps-2bit", "ddp-fp32", "diloco", "diloco"]
    assert [r["rate_mbit"] for r in epochs] == [1000.0, 1000.0, 1000.0, 0.0]
    for r in epochs:
        assert 0 < r["accuracy"] <= 1, r
        # one epoch: its cumulative wall time is its own (times reported, their values not bound)
        assert isinstance(r["seconds"], float) and r["wall"] == r["seconds"], r
    assert epochs[0]["pulled_bytes"] > 0  # the compressed pulls' bytes are reported
    assert epochs[2]["diloco"].startswith("--diloco ") and epochs[2]["pushed_bytes"] > 0
    summary = [r for r in records if "seconds_to_target" in r]
    assert [r["run"] for r in summary] == ["ps-2bit", "ddp-fp32", "diloco"]
    # the runs not trained on free links get the compute floor, DiLoCo's (the one measured)
    assert summary[0]["floor_from"] == "diloco" == summary[2]["floor_from"]
    diloco = summary[2]
    assert diloco["floor_seconds"] == epochs[3]["wall"]
    assert diloco["over_floor"] == round(diloco["seconds_to_target"] / diloco["floor_seconds"], 2)
    # the table is rebuilt from the JSON lines alone
    again = run(
        "time_to_accuracy", "--from", str(out), "--table", str(tmp_path / "u.md"), "--target", "0.5"
    )
    assert [r for r in again if "seconds_to_target" in r] == summary
    assert (tmp_path / "u.md").read_text() == (tmp_path / "t.md").read_text()


def test_time_to_accuracy_races_the_language_model_the_same_way_on_every_system(tmp_path):
    """The language-model workload: the example's synchronous job and DDP train the same
    model the same way, so their first report's perplexity agrees to float rounding."""
    records = run(
        "time_to_accuracy", "--workload", "charlm", "--runs", "lm-ps-sync", "lm-ddp-fp32",
        "--steps", "4", "--eval-every", "2", "--target", "1000", "--table", str(tmp_path / "t.md"),
    )  # fmt: skip
    if "skipped" in records[0] and "run" not in records[0]:  # no root or no iproute2 here
        return
    reports = [r for r in records if "step" in r]
    assert [(r["run"], r["step"]) for r in reports] == [("lm-ps-sync", 2), ("lm-ddp-fp32", 2)]
    ps, ddp = reports
    assert ps["workload"] == ddp["workload"] == "charlm"
    assert ps["perplexity"] == pytest.approx(ddp["perplexity"], rel=1e-5)
    # (how a report's seconds become the run's wall: tests/unit/test_time_to_accuracy.py)
    assert {*time_to_accuracy.REPORT_CLOCKS, "sent_bytes_per_host"} <= ps.keys() and ps[
        "pushed_bytes"
    ] > 0
    summary = [r for r in records if "seconds_to_target" in r]
    assert [(s["metric"], s["to_target"]) for s in summary] == [("perplexity", 2)] * 2
    table = (tmp_path / "t.md").read_text()
    assert "| steps | seconds to perplexity 1000 | final perplexity |" in table


def test_hostile_input_probe_smoke():
    """Each scenario's record, and the behaviour it must show (never its timings): strangers
    get no reply, malformed messages only valid error replies, every job exact sums, every
    server stays up with no error logged, many-frame senders leave the server within its
    documented bound, and a flood or a forged identity cannot forge or flood its log."""
    records = run("probe_hostile")
    by_scenario = {r["scenario"]: r for r in records if "frames_per_message" not in r}
    frames = [r for r in records if r["scenario"] == "many_frames"]
    assert [r["scenario"] for r in records] == [
        "strangers", "malformed", "half_handshakes", "many_workers", "many_frames", "log_flood",
    ]  # fmt: skip
    for r in records:
        assert r["preset"] == "smoke" and "cores" in r["machine"], r
        assert r["alive"] and r["log_errors"] == 0 and r["log_tracebacks"] == 0, r
        jobs = [value for name, value in r.items() if name.startswith("job") and name != "job_warm"]
        assert jobs, r
        for job in jobs:
            assert job["exact"] and job["mismatches"] == 0 and job["values_checked"] > 0, r

    strangers = by_scenario["strangers"]
    assert set(strangers["messages_sent"]) == {"plain", "another_job", "random_client_key"}
    assert all(sent > 0 for sent in strangers["messages_sent"].values()), strangers
    assert all(replies == 0 for replies in strangers["replies"].values()), strangers

    malformed = by_scenario["malformed"]
    assert malformed["invalid_replies"] == 0 and malformed["other_replies"] == 0, malformed
    assert malformed["error_replies"] == malformed["messages"], malformed

    half = by_scenario["half_handshakes"]
    ends = ("failed_to_connect", "closed_at_once", "closed_later")
    assert sum(half[name] for name in ends) + half["still_open_after_s"]["open"] == 100, half
    assert half["fresh_connection_answered_during_flood"], half
    assert half["fresh_connection_answered_after_wait"], half

    many = by_scenario["many_workers"]
    assert many["workers"] == 2 and many["job"]["rounds"] > 0, many

    (attack,) = frames
    assert attack["frames_per_message"] == 48 and attack["bytes_offered"] > 0, attack
    assert 0 < attack["bound_kib"] and attack["peak_over_before_kib"] <= attack["bound_kib"]
    assert attack["within_bound"] and attack["connections_closed_seen_by_senders"] > 0, attack

    flood = by_scenario["log_flood"]
    assert flood["lines_with_control_characters"] == 0, flood
    assert not flood["forged_line_appears"], flood
    assert flood["log_lines"] < flood["bad_messages"] // 10, flood  # throttled


def test_diloco_convergence_smoke(tmp_path):
    """Per-step training and Streaming DiLoCo (H = 8) on the same data: every evaluation is
    reported, and DiLoCo moves about H times fewer bytes (the bytes of a run follow from its
    schedule; its accuracy is not bound)."""
    out = tmp_path / "dc.jsonl"
    records = run("diloco_convergence", "--out", str(out), "--table", str(tmp_path / "t.md"))
    points = [r for r in records if "quality" in r and "bytes_per_worker" not in r]
    assert {r["run"] for r in points} == {"sync", "streaming"}
    summary = {r["run"]: r for r in records if "bytes_per_worker" in r}
    assert summary["sync"]["bytes_fewer"] == 1.0 and summary["sync"]["sync_every"] is None
    streaming = summary["streaming"]
    assert streaming["sync_every"] == 8 and streaming["steps"] == summary["sync"]["steps"]
    assert 6 < streaming["bytes_fewer"] < 9, streaming
    assert 0 < streaming["quality"] <= 100
    again = run("diloco_convergence", "--from", str(out), "--table", str(tmp_path / "u.md"))
    assert [r for r in again if "bytes_per_worker" in r] == list(summary.values())
    assert (tmp_path / "u.md").read_text() == (tmp_path / "t.md").read_text()


def test_diloco_async_smoke():
    """A slow worker under dist_sync and under dist_async with delayed Nesterov: each run's
    epochs and summary (times reported, never bound)."""
    records = run("diloco_async")
    summary = [r for r in records if "seconds_to_target" in r]
    assert [r["run"] for r in summary] == ["sync", "async-delayed-nesterov"]
    for line in summary:
        assert 0 < line["final_accuracy"] <= 1 and line["epochs"] == 1, line
    setting = next(r for r in records if "preset" in r)
    assert setting["slowdown"] == 2.5 and setting["workers"] == 2


def test_failover_smoke():
    """A replicated job that loses a server finishes; one without replicas stops with
    ServerLostError (times reported, never bound)."""
    records = run("failover")
    by_run = {r["run"]: r for r in records if "run" in r}
    assert by_run["kill"]["finished"] and by_run["kill"]["errors"] == []
    assert by_run["kill"]["stalled_s"] is not None and by_run["kill"]["replicas"] == 2
    unreplicated = by_run["kill-unreplicated"]
    assert not unreplicated["finished"] and unreplicated["errors"] == ["ServerLostError"]
