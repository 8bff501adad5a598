"""Push+pull on a shaped-link cluster (network namespaces), next to its wire floor, and gloo.

Every host is a network namespace with a full-duplex link shaped to ``--rate`` Mbit/s (default
1000) to a bridge (:mod:`netns`). Servers run on hosts of their own (``separate``) or on the
workers' hosts (``colocated``: server i on worker host i). Each worker runs ``dist_sync`` steps
of ``push`` of every key (backward order: last layer first) and ``pull`` of every key. Codecs:

* ``none``: uncompressed, SGD (momentum 0.9) on the servers, dense weights pulled;
* ``2bit``: the same with 2-bit pushes;
* ``2bit-agg``: 2-bit pushes and no server optimizer: workers pull the round's summed gradient
  (what allreduce returns; they would step their own optimizer), which the servers relay as the
  round's pushes (N/16 of the dense bytes while N <= 8);
* ``2bit-both``: 2-bit pushes, SGD on the servers, and 2-bit compressed pulls of the weights'
  change (``kv.set_pull_compression``, threshold :data:`PULL_THRESHOLD`): 1/16 of the dense
  bytes both ways.

Workloads: ``key10m``, one 10M-element fp32 key; ``resnet50``, the 161 parameter tensors of
ResNet-50 (25.6M parameters, ``benchmarks/data/resnet50_param_shapes.json``).

The wire floor of a configuration is the busiest link direction's payload bytes per step over
the link rate, computed from the real placement (the same topology the workers use): a worker's
push crosses its uplink and the server's downlink, the pull comes back the other way, and
traffic between processes of one host crosses no link. Reported: seconds per step (after
untimed warm-up steps, about ``--warmup-seconds`` at the floor's pace; every step starts at a
barrier; a step's time is its slowest worker's; the median over steps), the floor,
their ratio, and ``cpu_busy``: the share of this machine's cores in use during the measured
steps. All hosts share this machine's cores, kernel networking included, so where ``cpu_busy``
is near 1 the CPU, not the links, set the pace. It is split into ``cpu_job`` (the job's
processes), ``cpu_steal`` (taken by the hypervisor for other virtual machines) and
``cpu_others`` (anything else, including kernel work charged to no process of the job), so that
a cell slowed by load from outside the job shows it.

Every host uses the TCP congestion control ``--tcp-cc`` (default ``cubic``, Linux's default;
``default`` keeps the machine's own, which on the development machine is ``bbr``: the README
compares the two).

Hosts send TCP in units of up to ``--gso-kib`` (default 192 KiB where the kernel allows it,
Linux 6.3 and later; Linux's own default is 64): the emulated links and switch then handle a
third of the packets, on the cores the job needs (see :mod:`netns`). Each record says what the
kernel took (``gso_max_bytes``).

Baselines on the same shaped hosts: ``torch.distributed`` gloo allreduce of the same tensors in
fp32 and fp16, bucketed like DDP (25 MB buckets, backward order), with its ring floor
``2 (N-1)/N x bytes / rate``; and, with ``--baselines zmq`` (not in the presets: one more cell
per configuration), bare pyzmq moving the dense push+pull's bytes in the same chunks between
processes placed like kvstore's (:mod:`bare_cluster`), run right after the configuration's
kvstore cells. It has the dense floor; its ratio to it is how close this machine gets to the
floor at all.

With ``--per-host K,...`` (the ``hierarchy`` preset: 2 and 4 worker hosts of 1, 2 and 4
workers, against gloo on the same hosts) K consecutive workers share each worker host and
aggregate there (``KVSTORE_LOCAL_SIZE``, :mod:`kvstore.worker.host_group`); ``--hierarchy
both`` also runs each such cell with every worker on its own (``KVSTORE_HIERARCHY=0``), the
flat job of the same N. Records of K > 1 say ``workers_per_host`` (and ``hierarchy``), the floor
counts one push and pull per host where they aggregate, and every kvstore record says
``host_up_bytes_per_step`` and ``host_down_bytes_per_step``: the payload bytes the busiest
worker host's link carried per step, from its workers' counters.

With ``--replicas R,...`` (the ``replication`` preset: 4 workers and 4 servers on hosts of
their own, R = 1 and 2) the servers keep every shard on R servers (``KVSTORE_REPLICAS``,
:mod:`kvstore.server.replication`): each round crosses a primary's link once more per backup
before it is answered. Records say ``replicas``; with ``--link-trace`` the server hosts' bytes
show what replication adds between servers.

With ``--push-borrow`` the kvstore workers push with ``borrow=True`` (their dense gradients
are sent from their own memory instead of copied first; see ``KVStore.push``).

With ``--auth on`` the kvstore cells run with the job's CURVE keys (:mod:`kvstore.auth`: every
connection authenticated and encrypted, as every ``kvstore-launch`` job runs); ``--auth both``
runs each kvstore cell without and then with them, one after the other, so that their ratio is
the cost of encryption on the same machine state. Records say ``auth`` where it was asked for;
the default (``off``) runs without keys.

With ``--link-trace`` a record also says how busy each role's links were during the timed
steps, and how long they stood idle at a step's start and end (:mod:`link_trace`). With
``--pin-hosts on`` each host's processes run on its own share of this machine's cores
(:func:`netns.host_cpus`); records say ``pinned``.

    python -m benchmarks.bench_cluster --preset smoke
    python -m benchmarks.bench_cluster --preset full --out results/cluster.jsonl
    python -m benchmarks.bench_cluster --preset hierarchy --hierarchy both
    python -m benchmarks.bench_cluster --preset replication --link-trace

Needs root for ``ip netns``; without it, prints one "skipped" line and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import (
    RESNET50_SHAPES,
    append_jsonl,
    emit,
    machine,
    module_command,
    server_addresses,
)
from benchmarks.link_trace import LinkTrace, by_role, summarize
from benchmarks.netns import DEFAULT_GSO_MAX_BYTES, check_gso_max_bytes

BUCKET_BYTES = 25 * 1024 * 1024

PRESETS = {
    "smoke": {
        "workloads": ["key1m"],
        "codecs": ["none", "2bit", "2bit-agg"],
        "workers": [2],
        "servers": [1],
        "placements": ["separate"],
        "per_host": [1],
        "replicas": [1],
        "baselines": [],
        "steps": 2,
        "warmup_seconds": 0.0,
        "rate": 1000.0,
    },
    "full": {
        "workloads": ["key10m", "resnet50"],
        "codecs": ["none", "2bit", "2bit-agg", "2bit-both"],
        "workers": [1, 2, 4, 8],
        "servers": [1, 2, 4],
        "placements": ["separate", "colocated"],
        "per_host": [1],
        "replicas": [1],
        "baselines": ["gloo-fp32", "gloo-fp16"],
        "steps": 5,
        "warmup_seconds": 8.0,
        "rate": 1000.0,
    },
    # hosts of 1, 2 and 4 workers (2 and 4 worker hosts), against the same workers each on its
    # own (--hierarchy both) and gloo on the same hosts
    "hierarchy": {
        "workloads": ["key10m", "resnet50"],
        "codecs": ["none", "2bit-both"],
        "workers": [2, 4, 8, 16],
        "servers": [2],
        "placements": ["separate"],
        "per_host": [1, 2, 4],
        "replicas": [1],
        "baselines": ["gloo-fp32"],
        "steps": 5,
        "warmup_seconds": 8.0,
        "rate": 1000.0,
    },
    # every shard on 1 and on 2 servers, one cell after the other on the same machine state
    "replication": {
        "workloads": ["key10m", "resnet50"],
        "codecs": ["none", "2bit-both"],
        "workers": [4],
        "servers": [4],
        "placements": ["separate"],
        "per_host": [1],
        "replicas": [1, 2],
        "baselines": [],
        "steps": 5,
        "warmup_seconds": 8.0,
        "rate": 1000.0,
    },
}


HOST_COUNTS = {"hierarchy": (2, 4)}
"""The worker-host counts a preset measures (others: any count its workers make)."""

HIERARCHY_MODES = {"on": (True,), "off": (False,), "both": (False, True)}
"""``--hierarchy`` -> whether the workers of a host of several aggregate there, in run order."""

AUTH_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
"""``--auth`` -> whether each kvstore cell runs with CURVE keys, in run order."""


# workloads -----------------------------------------------------------------------------------


def workload(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every tensor, in forward order."""
    if name == "key10m":
        return [("w", (10_000_000,))]
    if name == "key1m":
        return [("w", (1_000_000,))]
    if name == "resnet50":
        data = json.loads(RESNET50_SHAPES.read_text())
        return [(t["name"], tuple(t["shape"])) for t in data["tensors"]]
    raise ValueError(f"unknown workload {name!r}")


CODECS = ("none", "2bit", "2bit-agg", "2bit-both")
THRESHOLD = 0.5
"""The 2-bit threshold of the workers' pushes (their payload sizes set the floor)."""
PULL_THRESHOLD = 0.001
"""The 2-bit threshold of ``2bit-both``'s compressed pulls (of the weights' change)."""
GLOO_BASELINES = ("gloo-fp32", "gloo-fp16")
BARE = "zmq"
BASELINES = (*GLOO_BASELINES, BARE)


def codec_setup(name: str) -> tuple[str, bool]:
    """(compression type, server optimizer?) of a codec name of :data:`CODECS`."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {', '.join(CODECS)}")
    return name.removesuffix("-agg").removesuffix("-both"), not name.endswith("-agg")


def pull_compressed(name: str) -> bool:
    """Whether a codec name of :data:`CODECS` compresses pulls too (``2bit-both``: 2-bit
    pushes, a server SGD and 2-bit pulls of the weights' change)."""
    return name.endswith("-both")


def floor_seconds(
    keys: list[tuple[str, tuple[int, ...]]],
    codec: str,
    num_workers: int,
    server_hosts: list[int],
    worker_hosts: list[int],
    rate_bytes: float,
    hierarchy: bool = False,
) -> tuple[float, float]:
    """(floor seconds, bytes of the busiest link direction) of one push+pull step. With
    ``hierarchy`` the workers that share a host push and pull once for it (their host's sum:
    :mod:`kvstore.worker.host_group`)."""
    from kvstore.codecs import get_codec
    from kvstore.config import DEFAULT_BIGARRAY_BOUND, DEFAULT_PARTITION_BYTES
    from kvstore.topology import partition_elems_for, plan_chunks

    compression, server_optimizer = codec_setup(codec)
    push_codec = get_codec(
        compression, **({} if compression == "none" else {"threshold": THRESHOLD})
    )
    up: dict[int, float] = {}
    down: dict[int, float] = {}
    # who pushes each chunk once per round: every worker, or every host of workers
    pushers = sorted(set(worker_hosts)) if hierarchy else list(worker_hosts)
    for key, shape in keys:
        numel = math.prod(shape)
        chunks = plan_chunks(
            key,
            numel,
            len(server_hosts),
            bigarray_bound=DEFAULT_BIGARRAY_BOUND,
            partition_elems=partition_elems_for(DEFAULT_PARTITION_BYTES, 4),
            wire_fraction=push_codec.pushed_fraction(numel, "float32"),
        )
        for chunk in chunks:
            push = sum(push_codec.payload_nbytes(chunk.numel, "float32"))
            relayed = not server_optimizer and len(pushers) <= push_codec.relay_limit(
                chunk.numel, "float32"
            )
            pull = len(pushers) * push if relayed else 4 * chunk.numel
            if pull_compressed(codec):  # the same 2-bit payload as a push
                pull = push
            server_host = server_hosts[chunk.server]
            for host in pushers:
                if host == server_host:
                    continue  # same host: no link crossed
                up[host] = up.get(host, 0) + push
                down[server_host] = down.get(server_host, 0) + push
                up[server_host] = up.get(server_host, 0) + pull
                down[host] = down.get(host, 0) + pull
    busiest = max([*up.values(), *down.values(), 0.0])
    return busiest / rate_bytes, busiest


# child roles ---------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace) -> None:
    import numpy as np

    import kvstore

    keys = workload(args.workload)
    kv = kvstore.create(
        "dist_sync",
        servers=args.addresses.split(","),
        rank=args.rank,
        num_workers=args.num_workers,
        local_rank=args.rank % args.local_size,
        local_size=args.local_size,
        hierarchy=args.host_sum == "on",
    )
    compression, server_optimizer = codec_setup(args.codec)
    if compression != "none":
        kv.set_gradient_compression({"type": compression, "threshold": THRESHOLD})
    if pull_compressed(args.codec):
        kv.set_pull_compression({"type": compression, "threshold": PULL_THRESHOLD})
    if server_optimizer:
        kv.set_optimizer("sgd", learning_rate=0.01, momentum=0.9, rescale_grad=1 / args.num_workers)
    rng = np.random.default_rng(args.rank)
    names = [k for k, _ in keys]
    params = [np.zeros(shape, np.float32) for _, shape in keys]
    grads = [rng.standard_normal(shape).astype(np.float32) for _, shape in keys]
    kv.init(names, params)
    backward_names, backward_grads = names[::-1], grads[::-1]

    def step() -> None:
        kv.push(backward_names, backward_grads, borrow=args.push_borrow)
        kv.pull(names, out=params)

    before = kv.stats()
    report = timed_steps(args.steps, kv.barrier, step, args.warmup_steps)
    after = kv.stats()
    steps = args.steps + args.warmup_steps
    report["pushed_bytes_per_step"] = (after.pushed_bytes - before.pushed_bytes) / steps
    report["pulled_bytes_per_step"] = (after.pulled_bytes - before.pulled_bytes) / steps
    kv.close()
    print(json.dumps(report), flush=True)


MAX_WARMUP_STEPS = 30
"""Most untimed steps a cell runs (cells whose floor is tens of milliseconds)."""


def warmup_steps(warmup_seconds: float, floor: float) -> int:
    """Untimed steps before the timed ones: about ``warmup_seconds`` at the floor's pace (at
    least 1, at most :data:`MAX_WARMUP_STEPS`).

    Warm-up is counted in time, not steps, because what it waits for takes time: new TCP
    connections take seconds to reach their steady window (``cubic`` grows it by time), and
    the first steps of a job also fault in its buffers, so the first steps of a cell are
    slower, and one warm-up step leaves the median of a few timed steps on that slope in some
    runs and not in others. Where a server's replies to several workers share its uplink the
    slope is longer: their flows leave slow start with heavy losses and ``cubic`` regrows their
    windows over seconds (the full preset's 8 s cover it; 3 s did not). Every process of a
    cell gets the same count (steps start at a barrier).
    """
    if warmup_seconds <= 0 or floor <= 0:
        return 1
    return max(1, min(MAX_WARMUP_STEPS, math.ceil(warmup_seconds / floor)))


def timed_steps(
    steps: int, barrier: Callable[[], None], step: Callable[[], None], warmup: int = 1
) -> dict:
    """Run ``warmup`` untimed steps and ``steps`` timed ones, each after a barrier.

    Returns the seconds of each timed step (``times``) and of each warm-up step
    (``warmup_times``), the wall-clock time each timed step started (``starts``), and the
    wall-clock window the timed steps span (the orchestrator reads the machine's CPU use over
    it).
    """
    times: list[float] = []
    warmup_times: list[float] = []
    starts: list[float] = []
    window = [0.0, 0.0]
    for index in range(warmup + steps):
        barrier()
        if index == warmup:
            window[0] = time.time()
        if index >= warmup:
            starts.append(time.time())
        start = time.perf_counter()
        step()
        (times if index >= warmup else warmup_times).append(time.perf_counter() - start)
    window[1] = time.time()
    barrier()
    return {"times": times, "warmup_times": warmup_times, "starts": starts, "window": window}


def run_gloo(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    keys = workload(args.workload)
    dtype = torch.float16 if args.codec == "gloo-fp16" else torch.float32
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.num_workers
    )
    grads = [torch.randn(math.prod(shape)).to(dtype) for _, shape in keys][::-1]
    buckets, current, size = [], [], 0
    for grad in grads:  # DDP-style buckets of about 25 MB, filled in backward order
        current.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= BUCKET_BYTES:
            buckets.append(torch.cat(current))
            current, size = [], 0
    if current:
        buckets.append(torch.cat(current))

    def step() -> None:
        works = [dist.all_reduce(bucket, async_op=True) for bucket in buckets]
        for work in works:
            work.wait()

    report = timed_steps(args.steps, dist.barrier, step, args.warmup_steps)
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


def run_bare_worker(args: argparse.Namespace) -> None:
    from benchmarks.bare_cluster import bare_worker

    barrier, step = bare_worker(args.addresses.split(","), workload(args.workload))
    report = timed_steps(args.steps, barrier, step, args.warmup_steps)
    print(json.dumps(report), flush=True)


# orchestration -------------------------------------------------------------------------------


class CpuMonitor:
    """Samples the machine's CPU use (``/proc/stat``), and that of the job's processes
    (``/proc/PID/stat``), every 100 ms in a background thread.

    The emulated hosts share this machine with whatever else runs on it, and on a virtual
    machine with the hypervisor's other guests: a cell measured while those took cores is
    slower for reasons that are not the job's, so the split of the busy time is recorded with
    every cell (:meth:`usage`).

    Args:
        pids: the job's processes (servers and workers; their threads are included).
        descendants: also count every process they start (a peer's daemon, say), found anew
            at every sample.
    """

    def __init__(self, pids: Sequence[int] = (), *, descendants: bool = False) -> None:
        # (time, total jiffies, idle jiffies, stolen jiffies, the job's jiffies)
        self.samples: list[tuple[float, int, int, int, int]] = []
        self._pids = list(pids)
        self._descendants = descendants
        self._job_ticks: dict[int, int] = {}  # last seen per process (kept once it exits)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree(self) -> list[int]:
        """The job's processes and, with ``descendants``, all the processes they started."""
        if not self._descendants:
            return self._pids
        found, todo = [], list(self._pids)
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        todo.extend(int(child) for child in f.read().split())
            except OSError:  # exited meanwhile
                continue
        return found

    def _job(self) -> int:
        for pid in self._tree():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # exited (its last value stays counted)
                continue
            self._job_ticks[pid] = int(fields[11]) + int(fields[12])  # utime + stime
        return sum(self._job_ticks.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            with open("/proc/stat") as f:
                values = [int(v) for v in f.readline().split()[1:]]
            steal = values[7] if len(values) > 7 else 0
            self.samples.append(
                (time.time(), sum(values), values[3] + values[4], steal, self._job())
            )
            self._stop.wait(0.1)

    def __enter__(self) -> CpuMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def usage(self, start: float, end: float) -> dict[str, float]:
        """The cores' time between ``start`` and ``end`` (wall-clock seconds), as shares.

        ``cpu_busy``: not idle (the three below together); ``cpu_job``: charged to
        the job's processes (user and system time of their threads); ``cpu_steal``: taken by
        the hypervisor for other guests; ``cpu_others``: the rest of the busy time, i.e. other
        processes, and kernel work charged to no process of the job (network interrupts
        handled in ``ksoftirqd``, for one). Empty when the window holds too few samples.
        """
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {}
        first, last = inside[0], inside[-1]
        total = last[1] - first[1]
        if not total:
            return {}
        busy = 1 - (last[2] - first[2]) / total
        steal = (last[3] - first[3]) / total
        job = min(busy - steal, (last[4] - first[4]) / total)
        return {
            "cpu_busy": round(busy, 2),
            "cpu_job": round(job, 2),
            "cpu_steal": round(steal, 2),
            "cpu_others": round(max(0.0, busy - steal - job), 2),
        }


def _slowest_per_step(per_worker: list[list[float]]) -> list[float]:
    """Each step's time for the job: its slowest worker's (every worker ran the same steps)."""
    return [max(step) for step in zip(*per_worker, strict=True)]


def _collect(
    processes: list[subprocess.Popen], what: str, timeout: float, results: list[dict] | None = None
) -> tuple[list[float], list[float], tuple[float, float], list[tuple[float, float]]]:
    """The job's time per timed step and per warm-up step (each step's slowest worker; steps
    start at a barrier), the wall-clock window of the timed steps, and each timed step's
    wall-clock span (from its first worker's start to its last worker's end); each process's
    report is appended to ``results``."""
    per_worker: list[list[float]] = []
    warmup_per_worker: list[list[float]] = []
    spans_per_worker: list[list[tuple[float, float]]] = []
    starts, ends = [], []
    deadline = time.monotonic() + timeout
    for process in processes:
        out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if process.returncode != 0:
            raise RuntimeError(f"{what} exited with {process.returncode}: {err[-2000:]}")
        result = json.loads(out.strip().splitlines()[-1])
        if results is not None:
            results.append(result)
        per_worker.append(result["times"])
        warmup_per_worker.append(result["warmup_times"])
        starts.append(result["window"][0])
        ends.append(result["window"][1])
        spans_per_worker.append(
            [(t0, t0 + t) for t0, t in zip(result["starts"], result["times"], strict=True)]
        )
    window = (max(starts), min(ends))
    spans = [
        (min(s[0] for s in step), max(s[1] for s in step))
        for step in zip(*spans_per_worker, strict=True)
    ]
    return _slowest_per_step(per_worker), _slowest_per_step(warmup_per_worker), window, spans


def _measure(
    cluster: Any,
    timed: list[subprocess.Popen],
    job: list[subprocess.Popen],
    what: str,
    timeout: float,
    floor: float,
    warmup: int,
    links: tuple[LinkTrace, Sequence[str]] | None = None,
    worker_hosts: Sequence[int] | None = None,
    **extra: Any,
) -> dict:
    """Collect the ``timed`` processes' step times while watching the CPU (the ``job``'s
    share apart), stop the cell's processes, and return the cell's record.

    Besides the median, the record keeps every step's time (``step_seconds``, and
    ``warmup_step_seconds`` for the untimed ones), so a cell whose steps had not settled
    shows it. With ``links`` (a started :class:`LinkTrace` of every host's link, and each
    host's role) the trace is stopped with the steps, and ``links`` says how busy the links
    were during the timed steps, the barriers between them left out
    (:func:`link_trace.by_role`).
    """
    reports: list[dict] = []
    with CpuMonitor([p.pid for p in job]) as cpu:
        times, warmup_times, window, spans = _collect(timed, what, timeout, reports)
    if links is not None:
        links[0].stop()
    cluster.stop_processes()
    seconds = statistics.median(times)
    record = {"seconds_per_step": round(seconds, 4), "floor_seconds": round(floor, 4),
              "over_floor": round(seconds / floor, 3) if floor else None, **extra,
              **cpu.usage(*window), "warmup_steps": warmup,
              "step_seconds": [round(t, 4) for t in times],
              "warmup_step_seconds": [round(t, 4) for t in warmup_times]}  # fmt: skip
    if links is not None:
        trace, roles = links
        summaries = summarize(trace.times, trace.counters, cluster.rate_bytes_per_s, spans)
        record["links"] = by_role(summaries, roles) if summaries else None
    if worker_hosts is not None and reports and "pushed_bytes_per_step" in reports[0]:
        record.update(host_bytes(reports, worker_hosts))
    return record


def host_bytes(reports: Sequence[dict], worker_hosts: Sequence[int]) -> dict[str, int]:
    """The payload bytes a worker host's link carried per step, from its workers' counters
    (pushes up, pulls down; the busiest host's)."""
    up: dict[int, float] = {}
    down: dict[int, float] = {}
    for report, host in zip(reports, worker_hosts, strict=True):
        up[host] = up.get(host, 0.0) + report["pushed_bytes_per_step"]
        down[host] = down.get(host, 0.0) + report["pulled_bytes_per_step"]
    return {"host_up_bytes_per_step": round(max(up.values())),
            "host_down_bytes_per_step": round(max(down.values()))}  # fmt: skip


def _host_roles(server_hosts: Sequence[int], worker_hosts: Sequence[int]) -> list[str]:
    """Each host's role for :func:`link_trace.by_role`: ``server``, ``worker`` or
    ``server+worker`` (a co-located server)."""
    servers, workers = set(server_hosts), set(worker_hosts)

    def role(host: int) -> str:
        if host in servers:
            return "server+worker" if host in workers else "server"
        return "worker"

    return [role(host) for host in range(max(servers | workers) + 1)]


def _placement(n: int, s: int, placement: str, per_host: int = 1) -> tuple[list[int], list[int]]:
    """(host of each server, host of each worker): ``per_host`` consecutive workers share a
    host."""
    hosts = n // per_host
    if placement == "separate":
        return list(range(s)), [s + rank // per_host for rank in range(n)]
    return [i % hosts for i in range(s)], [rank // per_host for rank in range(n)]


def run_kvstore(
    cluster,
    args,
    workload_name,
    codec,
    n,
    s,
    placement,
    auth=False,
    per_host=1,
    hierarchy=True,
    replicas=1,
) -> dict:
    from kvstore.auth import JobKeys, role_env

    py = sys.executable
    keys = JobKeys.generate() if auth else None  # fresh per cell, as the launcher makes them
    # (every credential variable set or blanked: none is inherited from this shell)
    replication = {"KVSTORE_REPLICAS": str(replicas)}
    env = {**os.environ, "KVSTORE_LOG_LEVEL": "WARNING", **role_env("server", keys), **replication}
    worker_env = {**os.environ, **role_env("worker", keys), **replication}

    def server(host: int, rank: int) -> list[str]:
        return [py, "-m", "kvstore.server", "--host", cluster.hosts[host].address, "--port", "0",
                "--server-rank", str(rank), "--num-servers", str(s), "--num-workers", str(n),
                "--threads", "2"]  # fmt: skip

    def worker(rank: int) -> list[str]:
        borrow = ["--push-borrow"] if args.push_borrow else []
        return ["--role", "worker", "--rank", str(rank), "--num-workers", str(n),
                "--codec", codec, "--local-size", str(per_host),
                "--host-sum", "on" if hierarchy else "off", *borrow]  # fmt: skip

    return _run_cell(cluster, args, workload_name, codec, n, s, placement, server, worker,
                     f"{codec} worker", server_env=env, worker_env=worker_env,
                     per_host=per_host, hierarchy=hierarchy)  # fmt: skip


def run_bare(cluster, args, workload_name, n, s, placement) -> dict:
    """The ``zmq`` baseline of one configuration (:mod:`bare_cluster`), with the dense floor."""

    def server(host: int, rank: int) -> list[str]:
        return module_command("bench_cluster", "--role", "bare-server", "--host",
                              cluster.hosts[host].address, "--num-workers", str(n))  # fmt: skip

    def worker(rank: int) -> list[str]:
        return ["--role", "bare-worker"]

    return _run_cell(cluster, args, workload_name, "none", n, s, placement, server, worker,
                     "bare worker")  # fmt: skip


def _run_cell(
    cluster: Any,
    args: argparse.Namespace,
    workload_name: str,
    codec: str,
    n: int,
    s: int,
    placement: str,
    server_argv: Callable[[int, int], list[str]],
    worker_role: Callable[[int], list[str]],
    what: str,
    server_env: dict[str, str] | None = None,
    worker_env: dict[str, str] | None = None,
    per_host: int = 1,
    hierarchy: bool = False,
) -> dict:
    """Start the servers (``server_argv(host, rank)``), then the workers (this module with
    ``worker_role(rank)`` and the addresses, workload, steps and warm-up), on the hosts of
    ``placement`` (``per_host`` workers a host); measure them against ``codec``'s floor."""
    server_hosts, worker_hosts = _placement(n, s, placement, per_host)
    servers = [
        cluster.popen(
            host, server_argv(host, rank), stdout=subprocess.PIPE, text=True, env=server_env
        )
        for rank, host in enumerate(server_hosts)
    ]
    addresses = server_addresses(servers)
    floor, busiest = floor_seconds(
        workload(workload_name),
        codec,
        n,
        server_hosts,
        worker_hosts,
        cluster.rate_bytes_per_s,
        hierarchy=hierarchy and per_host > 1,
    )
    warmup = warmup_steps(args.warmup_seconds, floor)
    roles = _host_roles(server_hosts, worker_hosts) if args.link_trace else None
    trace = LinkTrace([cluster.bridge_port(host) for host in range(len(roles))]) if roles else None
    if trace is not None:
        # Before the workers: a sampler started after them can come up, on a loaded machine,
        # only once their first timed step has begun, and a trace that misses it has no summary.
        trace.start()
    try:
        workers = []
        for rank, host in enumerate(worker_hosts):
            argv = module_command(
                "bench_cluster", *worker_role(rank), "--addresses", ",".join(addresses),
                "--workload", workload_name, "--steps", str(args.steps),
                "--warmup-steps", str(warmup),
            )  # fmt: skip
            workers.append(cluster.popen(host, argv, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True,
                                         env=worker_env))  # fmt: skip
        links = None if trace is None or roles is None else (trace, roles)
        return _measure(cluster, workers, servers + workers, what, args.timeout,
                        floor, warmup, links, worker_hosts,
                        busiest_link_bytes=int(busiest))  # fmt: skip
    finally:
        if trace is not None:
            trace.stop()  # (a cell that failed part-way; otherwise stopped already)


def run_baseline(cluster, args, workload_name, baseline, n, per_host=1) -> dict:
    master = f"{cluster.hosts[0].address}:29500"
    itemsize = 2 if baseline.endswith("fp16") else 4
    total = sum(math.prod(shape) for _, shape in workload(workload_name)) * itemsize
    floor = 2 * (n - 1) / n * total / cluster.rate_bytes_per_s
    warmup = warmup_steps(args.warmup_seconds, floor)
    processes = []
    for rank in range(n):
        argv = module_command(
            "bench_cluster", "--role", "gloo", "--master", master, "--rank", str(rank),
            "--num-workers", str(n), "--workload", workload_name, "--codec", baseline,
            "--steps", str(args.steps), "--warmup-steps", str(warmup),
        )  # fmt: skip
        host = rank // per_host
        env = {**os.environ, "GLOO_SOCKET_IFNAME": cluster.interface(host)}
        processes.append(cluster.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=env))  # fmt: skip
    return _measure(cluster, processes, processes, baseline, args.timeout, floor, warmup)


def _exit_on_signal(signum: int, frame: object) -> None:
    """Unwind like Ctrl-C, so the open cluster's ``with`` block tears its hosts down."""
    raise SystemExit(128 + signum)


def orchestrate(args: argparse.Namespace) -> int:
    from benchmarks.netns import Cluster, available, machine_tcp_cc

    # A benchmark stopped with kill (or its terminal closed) would otherwise die without
    # unwinding and leave namespaces, the bridge, server processes and the widened list of
    # allowed congestion controls behind.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    preset = PRESETS[args.preset]
    pick = {
        k: preset[k] if getattr(args, k) is None else getattr(args, k)
        for k in preset
        if k not in ("steps", "rate", "warmup_seconds")
    }
    try:  # unknown names fail here, before any host is built
        for name in pick["codecs"]:
            codec_setup(name)
        for name in pick["workloads"]:
            workload(name)
        unknown = [b for b in pick["baselines"] if b not in BASELINES]
        if unknown:
            raise ValueError(f"unknown baselines {unknown}; expected {', '.join(BASELINES)}")
        check_gso_max_bytes(args.gso_kib * 1024)
    except ValueError as exc:
        raise SystemExit(f"bench_cluster: {exc}") from None
    why_not = available()
    if why_not is not None:
        emit({"bench": "cluster", "skipped": why_not})
        return 0
    args.steps = args.steps or preset["steps"]
    if args.warmup_seconds is None:
        args.warmup_seconds = preset["warmup_seconds"]
    rate = args.rate or preset["rate"]
    tcp_cc = None if args.tcp_cc == "default" else args.tcp_cc
    tcp_cc_name = tcp_cc or machine_tcp_cc()  # what the records say the hosts ran
    pinned = args.pin_hosts == "on"
    links = {
        "mtu": args.mtu,
        "gso_max_bytes": args.gso_kib * 1024,
        "tcp_cc": tcp_cc,
        "pin_cpus": pinned,
    }
    started = time.time()
    configs = [
        (wl, n, s, placement, k)
        for wl, n, s, placement, k in itertools.product(
            pick["workloads"],
            pick["workers"],
            pick["servers"],
            pick["placements"],
            pick["per_host"],
        )  # fmt: skip
        if n % k == 0
        and n // k in HOST_COUNTS.get(args.preset, range(1, n + 1))
        and not (placement == "colocated" and s > n // k)  # more servers than hosts
    ]
    baselines = [(wl, n, b, k) for wl in pick["workloads"] for n in pick["workers"] if n > 1
                 for k in pick["per_host"] if n % k == 0
                 and n // k in HOST_COUNTS.get(args.preset, range(1, n + 1))
                 for b in pick["baselines"] if b in GLOO_BASELINES]  # fmt: skip

    def cell(record: dict, hosts: int, run: Callable[..., dict], *run_args: Any) -> None:
        """``run(cluster, *run_args)`` on a fresh cluster of ``hosts``; emit its record (or why
        it failed)."""
        try:
            with Cluster(hosts, rate, **links) as cluster:
                record["gso_max_bytes"] = cluster.gso_max_bytes  # what the kernel took
                record.update(run(cluster, *run_args))
        except Exception as exc:
            record["error"] = str(exc)[-500:]
        emit(record)
        append_jsonl(args.out, record)

    # How the hosts were linked and run, in every record.
    hosting = {"rate_mbit": rate, "mtu": args.mtu, "tcp_cc": tcp_cc_name, "pinned": pinned}
    for wl, n, s, placement, k in configs:
        hosts = n // k + s if placement == "separate" else n // k
        where = {"workers": n, "servers": s, "placement": placement, **hosting}
        if k > 1:
            where["workers_per_host"] = k
        for codec in [] if args.baselines_only else pick["codecs"]:
            for auth, hierarchy, replicas in itertools.product(
                AUTH_MODES[args.auth],
                HIERARCHY_MODES[args.hierarchy] if k > 1 else (True,),
                [r for r in pick["replicas"] if r <= s],
            ):
                record = {"bench": "cluster", "system": "kvstore", "workload": wl, "codec": codec,
                          **where, **({"push_borrow": True} if args.push_borrow else {}),
                          **({"auth": auth} if args.auth != "off" else {}),
                          **({"hierarchy": hierarchy} if k > 1 else {}),
                          **({"replicas": replicas} if pick["replicas"] != [1] else {}),
                          }  # fmt: skip
                cell(record, hosts, run_kvstore, args, wl, codec, n, s, placement, auth, k,
                     hierarchy, replicas)  # fmt: skip
        if BARE in pick["baselines"]:  # right after kvstore's cells: the same machine state
            record = {"bench": "cluster", "system": BARE, "workload": wl, **where}
            cell(record, hosts, run_bare, args, wl, n, s, placement)
    for wl, n, baseline, k in baselines:
        record = {"bench": "cluster", "system": baseline, "workload": wl, "workers": n,
                  **({"workers_per_host": k} if k > 1 else {}), **hosting}  # fmt: skip
        cell(record, n // k, run_baseline, args, wl, baseline, n, k)
    summary = {"bench": "cluster", "preset": args.preset, "machine": machine(),
               "wall_seconds": round(time.time() - started, 1)}  # fmt: skip
    emit(summary)
    append_jsonl(args.out, summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    csv = lambda t: lambda v: [t(x) for x in v.split(",") if x]  # noqa: E731
    parser.add_argument("--workloads", type=csv(str))
    parser.add_argument("--codecs", type=csv(str))
    parser.add_argument("--workers", type=csv(int))
    parser.add_argument("--servers", type=csv(int))
    parser.add_argument("--placements", type=csv(str))
    parser.add_argument(
        "--per-host",
        type=csv(int),
        help="workers on each worker host (a list; each must divide the worker counts)",
    )
    parser.add_argument(
        "--hierarchy",
        choices=sorted(HIERARCHY_MODES),
        default="on",
        help="with several workers per host, aggregate on the host (on, the default), each "
        "worker on its own (off), or each cell both ways (both)",
    )
    parser.add_argument("--baselines", type=csv(str))
    parser.add_argument(
        "--replicas", type=csv(int), help="servers holding each shard (KVSTORE_REPLICAS): 1,2"
    )
    parser.add_argument(
        "--baselines-only", action="store_true", help="run the baselines and not kvstore"
    )
    parser.add_argument("--steps", type=int)
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        help="untimed steps first, about this long at the floor's pace (full: "
        f"{PRESETS['full']['warmup_seconds']:g}, smoke: 0 = one step)",
    )
    parser.add_argument("--rate", type=float, help="link rate in Mbit/s")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument(
        "--gso-kib",
        type=int,
        default=DEFAULT_GSO_MAX_BYTES // 1024,
        help="largest TCP unit a host sends, KiB (default %(default)s; 64 is Linux's default)",
    )
    parser.add_argument(
        "--tcp-cc",
        default="cubic",
        help="TCP congestion control of every host (default cubic, Linux's default); "
        "'default' keeps this machine's",
    )
    parser.add_argument(
        "--pin-hosts",
        choices=["on", "off"],
        default="off",
        help="run each host's processes on its own share of this machine's cores (one core "
        "per host, hosts taking turns, where there are fewer cores than hosts); default "
        "%(default)s",
    )
    parser.add_argument(
        "--link-trace",
        action="store_true",
        help="sample every link's byte counters (about every ms, real-time priority) and "
        "report how busy each role's links were over the timed steps (benchmarks/link_trace.py)",
    )
    parser.add_argument(
        "--push-borrow",
        action="store_true",
        help="kvstore workers push with borrow=True (dense gradients sent from their own "
        "memory, not copied); records say push_borrow",
    )
    parser.add_argument(
        "--auth",
        choices=sorted(AUTH_MODES),
        default="off",
        help="kvstore cells with the job's CURVE keys (on), without (off, the default), or "
        "each cell both ways, one after the other (both); records say auth unless off",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="per configuration")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    # child roles
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--warmup-steps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--num-workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="key10m", help=argparse.SUPPRESS)
    parser.add_argument("--codec", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--addresses", help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--local-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--host-sum", choices=["on", "off"], default="on", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "worker":
        run_worker(args)
        return 0
    if args.role == "gloo":
        run_gloo(args)
        return 0
    if args.role == "bare-worker":
        run_bare_worker(args)
        return 0
    if args.role == "bare-server":
        from benchmarks.bare_cluster import bare_server

        bare_server(args.host, args.num_workers)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
