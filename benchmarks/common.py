"""Shared helpers of the benchmarks: where the repository is and how a benchmark starts a process
of another benchmark module, JSON-lines output, an environment stamp, robust timing, starting a
server process."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
"""The repository's root: the working directory of every benchmark process started with
:func:`module_command` (``benchmarks`` is importable from there)."""

RESNET50_SHAPES = REPO / "benchmarks" / "data" / "resnet50_param_shapes.json"
"""ResNet-50's 161 parameter shapes (torchvision layout), in forward order."""


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs ``benchmarks.<module>`` with ``args`` in this interpreter; start it
    with ``cwd=REPO``."""
    return [sys.executable, "-m", f"benchmarks.{module}", *args]


def machine() -> dict[str, Any]:
    """Where the numbers were measured."""
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy

    stamp = {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
    }
    for name in ("numba", "zmq", "torch"):
        module = sys.modules.get(name)
        if module is not None:
            stamp[name] = getattr(module, "__version__", "?")
    return stamp


def emit(record: dict[str, Any]) -> None:
    """Print one JSON line (and flush, so a pipe sees it at once)."""
    print(json.dumps(record, sort_keys=False), flush=True)


def append_jsonl(path: str | None, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` (its folder made if needed); no path, no
    file."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median times of several functions measured in alternation (noise hits all alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def start_server(
    command: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """Start a server process from ``command`` and wait for its ``KVSTORE_READY`` line.

    Returns the process and its address. ``env`` defaults to this process's environment; the
    server logs errors only. It runs in :data:`REPO` (``command`` may be a
    :func:`module_command`). A server that prints anything else first is killed.
    """
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        text=True,
        env={**(os.environ if env is None else env), "KVSTORE_LOG_LEVEL": "ERROR"},
        cwd=REPO,
    )
    line = process.stdout.readline()
    if not line.startswith("KVSTORE_READY"):
        process.kill()
        process.wait()
        raise RuntimeError(f"server did not start: {line!r}")
    return process, line.split()[1]


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """Kill the processes still running (a run that failed part-way) and reap them all."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()


def server_addresses(servers: list[subprocess.Popen]) -> list[str]:
    """The servers' addresses, from the ``KVSTORE_READY`` line each prints once bound (their
    stdout a text pipe)."""
    addresses = []
    for process in servers:
        line = process.stdout.readline()
        if not line.startswith("KVSTORE_READY"):
            raise RuntimeError(f"a server did not start: {line!r}")
        addresses.append(line.split()[1])
    return addresses
