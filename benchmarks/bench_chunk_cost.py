"""CPU cost of a chunk: loopback push+pull of one key cut into few and into many chunks.

A key's chunks pipeline encode, send, the server's sum and the reply; the more chunks a
server's slice has, the closer a step gets to the wire floor on a shaped link (a round waits
for one chunk from every worker, so the step costs about one chunk's round more than the
slice's transfer). But every chunk costs CPU on the worker and the server whatever its size:
its push, its pull request, the reply, their headers and bookkeeping. This benchmark measures
that cost, so the partition size can be chosen against it.

Layout: 1 server process (``--threads 2``) and W worker processes on 127.0.0.1, one fp32 key of
``--elements`` values, ``dist_sync`` push then pull per step, no optimizer. The same job runs
with the default ``KVSTORE_PARTITION_BYTES`` (the baseline) and with ``--small-partition``
bytes, alternating for ``--rounds`` rounds. Each worker measures its own CPU time (user and
system, all threads) over its timed steps; the server's is read from ``/proc`` between the
workers' first and last barrier. Per configuration: CPU milliseconds per step for one worker
and for the server, and the chunks per step. The summary line gives the extra CPU per extra
chunk (small partitions against the baseline, medians over rounds), per worker and for the
server: the fixed cost of one chunk.

    python benchmarks/bench_chunk_cost.py --preset smoke
    python benchmarks/bench_chunk_cost.py --preset full
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, machine, start_server, stop_processes  # noqa: E402

from kvstore.config import DEFAULT_PARTITION_BYTES  # noqa: E402

HERE = Path(__file__).resolve()

PRESETS = {
    "smoke": {"elements": 1_000_000, "workers": 2, "steps": 5, "rounds": 1},
    "full": {"elements": 10_000_000, "workers": 2, "steps": 20, "rounds": 3},
}

SMALL_PARTITION_BYTES = 256 * 1024


def _cpu_seconds_of(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` (all threads), from ``/proc``."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def kv_worker(address: str, rank: int, workers: int, elements: int, steps: int) -> None:
    """One worker: warm up, barrier, timed steps, barrier; prints its CPU and chunk count."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync", servers=[address], rank=rank, num_workers=workers)
    grad = np.random.default_rng(rank).standard_normal(elements).astype(np.float32)
    out = np.empty(elements, np.float32)
    kv.init("w", out)
    for _ in range(3):
        kv.push("w", grad)
        kv.pull("w", out=out)
    kv.barrier()
    if rank == 0:
        print("MEASURE", flush=True)  # the orchestrator reads the server's CPU now
    cpu, wall = _own_cpu_seconds(), time.perf_counter()
    for _ in range(steps):
        kv.push("w", grad)
        kv.pull("w", out=out)
    cpu, wall = _own_cpu_seconds() - cpu, time.perf_counter() - wall
    kv.barrier()
    if rank == 0:
        print("MEASURED", flush=True)
    chunks = kv.stats().push_messages // (steps + 3)
    kv.close()
    print(json.dumps({"cpu": cpu / steps, "wall": wall / steps, "chunks": chunks}), flush=True)


def run_config(partition_bytes: int, workers: int, elements: int, steps: int) -> dict[str, float]:
    """One job at ``partition_bytes``; per-step CPU of a worker (mean) and of the server."""
    env = {**os.environ, "KVSTORE_PARTITION_BYTES": str(partition_bytes)}
    py = sys.executable
    server, address = start_server(
        [py, "-m", "kvstore.server", "--num-workers", str(workers), "--threads", "2"], env
    )
    children: list[subprocess.Popen] = []
    try:
        for rank in range(workers):
            command = [py, str(HERE), "--role", "kv-worker", "--address", address]
            command += ["--rank", str(rank), "--workers", str(workers)]
            command += ["--elements", str(elements), "--steps", str(steps)]
            children.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env))
        first = children[0].stdout
        if first.readline().strip() != "MEASURE":
            raise RuntimeError("worker 0 did not reach its timed steps")
        server_cpu = _cpu_seconds_of(server.pid)
        if first.readline().strip() != "MEASURED":
            raise RuntimeError("worker 0 did not finish its timed steps")
        server_cpu = _cpu_seconds_of(server.pid) - server_cpu
        results = []
        for child in children:
            out, _ = child.communicate(timeout=600)
            if child.returncode != 0:
                raise RuntimeError(f"a worker failed with exit code {child.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return {
            "worker_cpu_ms": 1000 * statistics.mean(r["cpu"] for r in results),
            "server_cpu_ms": 1000 * server_cpu / steps,
            "step_ms": 1000 * statistics.median(r["wall"] for r in results),
            "chunks": results[0]["chunks"],
        }
    finally:
        stop_processes(children)
        if server.poll() is None:
            server.terminate()
        server.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--elements", type=int)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument(
        "--small-partition",
        type=int,
        default=SMALL_PARTITION_BYTES,
        help="KVSTORE_PARTITION_BYTES of the many-chunk configuration (default 256 KiB)",
    )
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    elements = args.elements or preset["elements"]
    workers = args.workers or preset["workers"]
    steps = args.steps or preset["steps"]
    if args.role == "kv-worker":
        kv_worker(args.address, args.rank, workers, elements, steps)
        return 0

    configs = {
        "default partition": DEFAULT_PARTITION_BYTES,
        "small partition": args.small_partition,
    }
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for _ in range(args.rounds or preset["rounds"]):
        for name, partition in configs.items():
            samples[name].append(run_config(partition, workers, elements, steps))
    medians: dict[str, dict[str, Any]] = {}
    for name, partition in configs.items():
        runs = samples[name]
        medians[name] = {
            metric: statistics.median(run[metric] for run in runs)
            for metric in ("worker_cpu_ms", "server_cpu_ms", "step_ms", "chunks")
        }
        emit(
            {
                "bench": "chunk_cost",
                "config": name,
                "partition_bytes": partition,
                "workers": workers,
                "elements": elements,
                "rounds": len(runs),
                **{metric: round(value, 3) for metric, value in medians[name].items()},
            }
        )
    base, small = medians["default partition"], medians["small partition"]
    extra = small["chunks"] - base["chunks"]
    summary: dict[str, Any] = {"bench": "chunk_cost", "summary": True, "extra_chunks": extra}
    if extra > 0:
        for role in ("worker", "server"):
            per_chunk = (small[f"{role}_cpu_ms"] - base[f"{role}_cpu_ms"]) / extra
            summary[f"{role}_cpu_ms_per_chunk"] = round(per_chunk, 4)
    summary["machine"] = machine()
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
