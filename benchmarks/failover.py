"""How long a job stops when a server fails, with and without replication.

Each run starts S server processes and N workers (threads of this process) on loopback, with
``KVSTORE_HEARTBEAT_TIMEOUT`` = ``--heartbeat``; the workers run ``dist_sync`` steps (2-bit
pushes, server SGD with momentum, 2-bit pulls, keys sliced over the servers) and worker 0 records
when each step ended. At step ``--fault-step`` the fault happens (the runs, :data:`RUNS`):

* ``kill``: a server is killed (SIGKILL): its connections close at once;
* ``stop``: a server is stopped (SIGSTOP): it is lost after the heartbeat timeout;
* ``replace``: a server is killed, then a replacement is started on its port with the job's
  addresses: it is caught up from the live replicas and the workers take it back;
* ``kill-unreplicated``: a server is killed in a job with R = 1: every worker's next call raises
  ``ServerLostError`` (the job must be restarted from its last checkpoint).

Each run prints one JSON line: the median step time before the fault, the seconds from the
fault to the end of the first step after it (``stalled_s``: the time until training goes on,
minus nothing), whether the job finished, and for ``replace`` the seconds from the replacement's
start to every worker having taken it back (``rejoined_s``, its catch-up included) and the bytes
of state it received.

    python -m benchmarks.failover --preset full --out results/failover.jsonl --table f.md
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import append_jsonl, emit, machine

RUNS = ("kill", "stop", "replace", "kill-unreplicated")

PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {"runs": ["kill", "kill-unreplicated"], "steps": 10, "fault_step": 4,
              "elements": 200_000, "heartbeat": 2.0},
    "full": {"runs": list(RUNS), "steps": 40, "fault_step": 15, "elements": 4_000_000,
             "heartbeat": 5.0},
}  # fmt: skip

WORKERS = SERVERS = 3


def _servers(args: argparse.Namespace, replicas: int) -> tuple[list[subprocess.Popen], list[str]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from kvtest import start_servers  # noqa: PLC0415  (the test suite's server starter)

    env = {"KVSTORE_REPLICAS": str(replicas), "KVSTORE_HEARTBEAT_TIMEOUT": str(args.heartbeat)}
    started = start_servers(SERVERS, WORKERS, env=env)
    return [s.process for s in started], [s.address for s in started]


def _replacement(args: argparse.Namespace, rank: int, addresses: list[str]) -> subprocess.Popen:
    port = addresses[rank].rsplit(":", 1)[1]
    env = {
        **os.environ,
        "KVSTORE_LOG_LEVEL": "ERROR",
        "KVSTORE_REPLICAS": "2",
        "KVSTORE_HEARTBEAT_TIMEOUT": str(args.heartbeat),
        "KVSTORE_SERVERS": ",".join(addresses),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "kvstore.server", "--port", port, "--server-rank", str(rank),
         "--num-servers", str(SERVERS), "--num-workers", str(WORKERS)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
    )  # fmt: skip


def run_one(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One run: the record of worker 0's steps around the fault."""
    import kvstore  # noqa: PLC0415

    replicas = 1 if name == "kill-unreplicated" else 2
    processes, addresses = _servers(args, replicas)
    victim = 1
    sizes = [args.elements // 2, args.elements // 4, args.elements // 4]
    keys = ["w0", "w1", "w2"]
    ended: list[float] = []
    fault: dict[str, float] = {}
    stores: list[Any] = []
    errors: list[str] = []

    rejoined = threading.Event()

    def replace() -> None:
        start = time.monotonic()
        processes.append(_replacement(args, victim, addresses))
        processes[-1].stdout.readline()  # its READY line
        guard = start + 120
        while any(kv._shared.transport.is_lost(victim) for kv in stores):
            if time.monotonic() > guard:
                return
            time.sleep(0.01)
        fault["rejoined_s"] = time.monotonic() - start
        rejoined.set()

    def worker(rank: int) -> None:
        kv = kvstore.create(
            "dist_sync", servers=addresses, rank=rank, num_workers=WORKERS, timeout=120,
            heartbeat_timeout=args.heartbeat, bigarray_bound=10_000, replicas=replicas,
        )  # fmt: skip
        stores.append(kv)
        with kv:
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.05})
            kv.set_pull_compression({"type": "2bit", "threshold": 0.01})
            kv.set_optimizer("sgd", learning_rate=0.1, momentum=0.9)
            kv.init(keys, [np.zeros(n, np.float32) for n in sizes])
            outs = [np.empty(n, np.float32) for n in sizes]
            rng = np.random.default_rng(rank)
            grads = [rng.normal(0, 0.05, n).astype(np.float32) for n in sizes]
            for step in range(args.steps):
                if rank == 0 and step == args.fault_step:
                    how = signal.SIGSTOP if name == "stop" else signal.SIGKILL
                    fault["at"] = time.monotonic()
                    os.kill(processes[victim].pid, how)
                    if name == "replace":
                        processes[victim].wait()
                        threading.Thread(target=replace, daemon=True).start()
                if rank == 0 and name == "replace" and step == args.fault_step + 5:
                    rejoined.wait(120)  # (the job waits: the replacement is timed while it runs)
                kv.push(keys, grads)
                kv.pull(keys, out=outs)
                if rank == 0:
                    ended.append(time.monotonic())

    def guarded(rank: int) -> None:
        try:
            worker(rank)
        except Exception as exc:  # (kill-unreplicated: every worker's call raises)
            errors.append(f"{type(exc).__name__}")
            if "at" in fault and "error_s" not in fault:
                fault["error_s"] = time.monotonic() - fault["at"]

    threads = [threading.Thread(target=guarded, args=(rank,)) for rank in range(WORKERS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
    finally:
        for process in processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
    before = [b - a for a, b in zip(ended, ended[1 : args.fault_step], strict=False)]
    after = [t for t in ended if t > fault.get("at", float("inf"))]
    record: dict[str, Any] = {
        "bench": "failover",
        "run": name,
        "replicas": replicas,
        "heartbeat_s": args.heartbeat,
        "elements": args.elements,
        "step_s": round(statistics.median(before), 4) if before else None,
        "stalled_s": round(after[0] - fault["at"], 3) if after else None,
        "finished": len(ended) == args.steps,
        "errors": sorted(set(errors)),
    }
    for extra in ("rejoined_s", "error_s"):
        if extra in fault:
            record[extra] = round(fault[extra], 3)
    return record


def table(records: list[dict[str, Any]]) -> str:
    """The runs as a markdown table."""
    lines = [
        "| fault | R | step before (s) | fault to next step (s) | job | other |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        other = []
        if "rejoined_s" in r:
            other.append(f"replacement taken back after {r['rejoined_s']} s")
        if "error_s" in r:
            other.append(f"{', '.join(r['errors'])} after {r['error_s']} s")
        lines.append(
            f"| {r['run']} | {r['replicas']} | {r['step_s']} | {r['stalled_s'] or '-'} | "
            f"{'finished' if r['finished'] else 'stopped'} | {'; '.join(other)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--runs", nargs="+", choices=RUNS)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--fault-step", type=int)
    parser.add_argument("--elements", type=int, help="model elements, over three keys")
    parser.add_argument("--heartbeat", type=float, help="KVSTORE_HEARTBEAT_TIMEOUT, seconds")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--table", help="write a markdown table")
    args = parser.parse_args(argv)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    setting = {"bench": "failover", "preset": args.preset, "machine": machine(),
               "workers": WORKERS, "servers": SERVERS, "heartbeat_s": args.heartbeat}  # fmt: skip
    emit(setting)
    append_jsonl(args.out, setting)
    records = []
    for name in args.runs:
        record = run_one(args, name)
        emit(record)
        append_jsonl(args.out, record)
        records.append(record)
    if args.table:
        Path(args.table).write_text(table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
