"""The local reduce of hierarchical aggregation against the memory's copy bandwidth, in the same
run.

k worker processes of one host (``kvstore.worker.host_group``, no servers) sum a key of M bytes
per call: each copies its value into its slot (reads M, writes M), then sums its 1/k slice of the
k slots into the host's sum (over all workers: reads kM, writes M). The host moves (3k + 1) M
bytes per call. The baseline, timed between the calls: every worker copies its value into a
buffer of its own at once, then they meet (``copy_ms``: 2kM bytes, at the bandwidth the k
workers get together, and one meeting). The **floor** is the call's bytes at that bandwidth,
``floor = (3k + 1) / 2k * copy_ms``; ``ratio_to_floor`` is the median call (``reduce_ms``, two
meetings) over it. ``meeting_ms`` is the median call of a 16-element key: the fixed cost of the
host's two meetings.

With ``--gpu`` (CuPy and a device), the k processes share the one GPU and sum CuPy values in GPU
memory that they map through CUDA IPC (:mod:`kvstore.worker.host_gpu`), against device-to-device
copies; the same values summed through host memory (the path a host whose GPUs cannot map each
other's memory takes: each value copied to the host) are timed too, as ``path: host_memory``,
against the same device copies. Without ``--gpu`` the values and the sum are in host shared
memory.

Every path's sum is checked (integer-valued values) before anything is timed.

    python -m benchmarks.bench_host_reduce --preset smoke
    python -m benchmarks.bench_host_reduce --preset full --gpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.common import REPO, emit, machine, module_command, stop_processes

PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {"mbytes": [4], "repeats": 5},
    "full": {"mbytes": [16, 100, 400], "repeats": 15},
}


def _worker(local_rank: int, size: int, numel: int, gpu: bool, repeats: int, tag: str) -> None:
    """One worker of the host: time ``repeats`` host sums of each path, and the host's copies
    between them; worker 0 prints its medians as one JSON line."""
    from kvstore.config import ClusterConfig
    from kvstore.worker.host_group import HostGroup
    from kvstore.worker.request import Deadline

    xp: Any = np
    if gpu:
        import cupy

        xp = cupy
    cluster = ClusterConfig((tag,), local_rank, size, local_rank, size)
    host = HostGroup(cluster, connect_timeout=120)
    deadline = Deadline(600)
    try:
        paths = {"cuda_ipc": 0, "host_memory": None} if gpu else {"shared_memory": None}
        for path, device in paths.items():
            host.add_key(path, numel, "float32", deadline, device)
            host.add_key(f"{path}/meeting", 16, "float32", deadline, device)
            if (device is not None) != host.summed_on_gpu(path):
                raise RuntimeError(f"{path}: the host did not sum on the GPU as asked")
        value = xp.full(numel, local_rank + 1, np.float32)
        small = xp.full(16, local_rank + 1, np.float32)
        expected = size * (size + 1) / 2
        copy_target = xp.empty_like(value)
        out: dict[str, Any] = {}
        for path in paths:
            [total] = host.host_sums([(path, value)], deadline)
            if not bool((total == expected).all()):
                raise RuntimeError(f"{path}: the host's sum is wrong")
            calls, meetings, copies = [], [], []
            for _ in range(repeats):
                start = time.perf_counter()
                host.host_sums([(path, value)], deadline)
                calls.append(time.perf_counter() - start)
                start = time.perf_counter()
                host.host_sums([(f"{path}/meeting", small)], deadline)
                meetings.append(time.perf_counter() - start)
                start = time.perf_counter()
                copy_target[...] = value
                if gpu:
                    xp.cuda.Device().synchronize()
                host.meet(("copied", path, len(copies)), deadline)
                copies.append(time.perf_counter() - start)
            out[path] = {
                "reduce": statistics.median(calls),
                "meeting": statistics.median(meetings),
                "copy": statistics.median(copies),
            }
        if local_rank == 0:
            print(json.dumps(out), flush=True)
    finally:
        host.close()


def run(mbytes: int, workers: int, gpu: bool, repeats: int) -> list[dict[str, Any]]:
    """The records of one key size: one per path."""
    numel = mbytes * 1_000_000 // 4
    tag = f"ipc://{tempfile.gettempdir()}/bench-host-reduce-{os.getpid()}-{mbytes}-{workers}"
    # (processes of their own, as a job's workers are: each its own CUDA context and tracker
    # of shared memory)
    processes = [
        subprocess.Popen(
            module_command(
                "bench_host_reduce",
                "--role",
                "worker",
                "--local-rank",
                str(rank),
                "--workers",
                str(workers),
                "--numel",
                str(numel),
                "--repeats",
                str(repeats),
                "--tag",
                tag,
                *(["--gpu"] if gpu else []),
            ),
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(workers)
    ]
    try:
        outputs = [process.communicate(timeout=900)[0] for process in processes]
    finally:
        stop_processes(processes)
    if any(process.returncode for process in processes):
        raise RuntimeError("a worker failed (its traceback is above)")
    measured = json.loads(outputs[0])
    records = []
    for path, times in measured.items():
        # (the copies are of the memory the values are on: the GPU's for both GPU paths)
        floor = (3 * workers + 1) / (2 * workers) * times["copy"]
        records.append(
            {
                "bench": "host_reduce",
                "device": "gpu" if gpu else "cpu",
                "path": path,
                "workers": workers,
                "mbytes": mbytes,
                "reduce_ms": round(times["reduce"] * 1e3, 3),
                "copy_ms": round(times["copy"] * 1e3, 3),
                "floor_ms": round(floor * 1e3, 3),
                "ratio_to_floor": round(times["reduce"] / floor, 2),
                "copy_gbps": round(2 * workers * mbytes / 1e3 / times["copy"], 1),
                "meeting_ms": round(times["meeting"] * 1e3, 3),
            }
        )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--gpu", action="store_true", help="CuPy values on the one GPU")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--local-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "worker":
        [workers] = args.workers
        _worker(args.local_rank, workers, args.numel, args.gpu, args.repeats, args.tag)
        return 0
    preset = PRESETS[args.preset]
    emit({"bench": "host_reduce", "machine": machine(), "preset": args.preset})
    for mbytes in preset["mbytes"]:
        for workers in args.workers:
            for record in run(mbytes, workers, args.gpu, preset["repeats"]):
                emit(record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
