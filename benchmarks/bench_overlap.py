"""Overlap of communication with backward: ``kvstore.torch.DistributedOptimizer`` against
push-after-backward, on shaped links, interleaved in the same run.

Two workers, each on a host of its own, and one or two servers on hosts of their own, as in
:mod:`bench_cluster` (network namespaces whose links are shaped to ``--rate`` Mbit/s each way,
:mod:`netns`). Each worker trains the same CPU model, a stack of ``--depth`` square Linear
layers of ``--width`` (ReLU between them, a mean squared error against random targets), on a
batch of its own, one torch thread per worker (the machine's cores are shared by every host).
Every step is timed from its ``zero_grad`` to the end of its optimizer step, each step starting
at a barrier; a step's time is its slowest worker's, and a mode's time is the median over its
timed steps. The modes run in turns, one step each, in the same processes, on the same hosts
and links (the order rotates every round), after untimed warm-up steps of each:

* ``push-after-backward``: backward completes, then every gradient is pushed (last layer first)
  and every key pulled, the mean taken and the optimizer stepped (the README's hand-written
  loop, with the wrapper's semantics: SGD on the workers, the mean gradient pulled);
* ``wrapper none``: ``DistributedOptimizer`` with ``bucket_plan="none"``, which pushes each
  gradient from a hook as soon as backward produced it; ``step()`` waits for the pulls. It
  uses the same keys as ``push-after-backward`` (one per parameter);
* ``wrapper bucket``: ``bucket_plan={"bucket_bytes": B}``, ``B`` a quarter of the model's bytes;
* ``wrapper mgs``: ``bucket_plan="mgs"`` (the planner's stated cost model);
* ``wrapper mgs-measured``: the MGS planner with the costs measured by the calibration
  (backward seconds per element, communication seconds per byte).

**Calibration.** The batch size is chosen so that backward takes about as long as the
communication: each worker measures push+pull of every key after a backward (after a few
untimed rounds that bring the TCP windows up) and backward alone (both workers computing at
once, as they will), the batch is scaled by their ratio twice, and rank 0's choice is taken by
both (through ``kv.init``, which keeps rank 0's value). Backward alone and communication alone
are then measured once more at the chosen batch and reported (each the median over repetitions
of the slowest worker).

**Why a mode is not faster** shows in its record: the time of each phase (forward, backward,
the wait for the communication after backward, the optimizer step), when the wrapper's first
and last push were made (from the start of backward) and how many of its bytes were pushed
before backward ended, the time the pushes took inside backward (encoding runs on the compute
thread), and how busy the machine's cores were during the mode's steps (``cpu_busy``; every
host shares them, the kernel's networking included).

Records (JSON lines): one per mode, then a summary with the ratio of each wrapper mode to
push-after-backward and the machine.

    python -m benchmarks.bench_overlap --preset smoke
    python -m benchmarks.bench_overlap --preset full --out results/overlap.jsonl

``--network netns`` (the full preset's) needs root for ``ip netns``; ``--network auto`` (the
smoke preset's) falls back to loopback where namespaces cannot be made (nothing is shaped there:
a loopback run shows that the harness works, not what overlap gains).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import REPO, append_jsonl, emit, machine, module_command, server_addresses

PUSH_AFTER_BACKWARD = "push-after-backward"
WRAPPER_PLANS = ("none", "bucket", "mgs", "mgs-measured")
"""The wrapper modes' bucket plans (``--plans``); each mode is ``wrapper <plan>``."""

CODECS: dict[str, dict[str, Any]] = {
    "none": {"type": "none"},
    "fp16": {"type": "fp16"},
    "2bit": {"type": "2bit", "threshold": 0.001},
}
"""``--codec`` -> the compression of every key (the wrappers' and push-after-backward's)."""

TARGET_RATIO = 0.75
"""The acceptance target: the wrapper's step at most this share of push-after-backward's."""

MGS_MESSAGE_SECONDS = 0.52e-3
"""The MGS planner's per-message cost (its stated constant, ``kvstore.torch.mgs``)."""

PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {
        "network": "auto",
        "rate": 1000.0,
        "width": 32,
        "depth": 4,
        "start_batch": 8,
        "max_batch": 64,
        "comm_warmup": 1,
        "calibration_repeats": 1,
        "warmup_steps": 1,
        "steps": 2,
    },
    "full": {
        "network": "netns",
        "rate": 1000.0,
        "width": 1024,
        "depth": 8,
        "start_batch": 256,
        "max_batch": 8192,
        "comm_warmup": 8,
        "calibration_repeats": 5,
        "warmup_steps": 3,
        "steps": 9,
    },
}


# the model and its data ----------------------------------------------------------------------


def make_model(width: int, depth: int) -> Any:
    """``depth`` Linear layers of ``width`` x ``width`` with ReLU between them, the same on
    every worker (seeded): the backward of each layer is one equal share of the whole."""
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for index in range(depth):
        layers.append(torch.nn.Linear(width, width))
        if index < depth - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def make_batch(rank: int, batch: int, width: int) -> tuple[Any, Any]:
    """A worker's own inputs and regression targets."""
    import torch

    generator = torch.Generator().manual_seed(1000 + rank)
    return (
        torch.randn(batch, width, generator=generator),
        torch.randn(batch, width, generator=generator),
    )


def loss_of(model: Any, batch: tuple[Any, Any]) -> Any:
    inputs, targets = batch
    return (model(inputs) - targets).square().mean()


def model_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# timing inside a worker ----------------------------------------------------------------------


@dataclass
class Phases:
    """Wall-clock marks of one step (``time.perf_counter``), and when it started
    (``time.time``, for the orchestrator's CPU monitor)."""

    started_at: float
    start: float
    forward_end: float
    backward_end: float
    communication_end: float
    end: float

    def record(self) -> dict[str, float]:
        return {
            "started_at": self.started_at,
            "seconds": self.end - self.start,
            "forward": self.forward_end - self.start,
            "backward": self.backward_end - self.forward_end,
            "wait": self.communication_end - self.backward_end,
            "update": self.end - self.communication_end,
        }


class PushClock:
    """The store, with the time of every ``push`` call recorded (for the wrapper, whose pushes
    run inside backward); everything else is the store's own."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv
        self.calls: list[tuple[float, float, int]] = []  # (start, end, bytes)

    def push(self, key: Any, value: Any, priority: int = 0, *, borrow: bool = False) -> None:
        start = time.perf_counter()
        self._kv.push(key, value, priority=priority, borrow=borrow)
        nbytes = value.numel() * value.element_size()
        self.calls.append((start, time.perf_counter(), nbytes))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


def push_timing(calls: Sequence[tuple[float, float, int]], phases: Phases) -> dict[str, Any]:
    """When a step's pushes were made, relative to the start of its backward (nothing where
    none was made)."""
    if not calls:
        return {}
    backward_start = phases.forward_end
    during = [c for c in calls if c[0] < phases.backward_end]
    total = sum(c[2] for c in calls)
    return {
        "pushes": len(calls),
        "pushes_in_backward": len(during),
        "bytes_in_backward": sum(c[2] for c in during) / total if total else 0.0,
        "first_push": calls[0][0] - backward_start,
        "last_push_end": calls[-1][1] - backward_start,
        "push_call_seconds_in_backward": sum(c[1] - c[0] for c in during),
    }


class PushAfterBackward:
    """Backward, then push every gradient (last layer first), pull every key, take the mean
    and step: the loop of the README, on the keys of a one-key-per-parameter wrapper."""

    name = PUSH_AFTER_BACKWARD

    def __init__(self, kv: Any, model: Any, keys: Sequence[str], names: Sequence[str]) -> None:
        import torch

        self.kv = kv
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        by_name = dict(model.named_parameters())
        self.keys = list(keys)  # in backward order
        self.params = [by_name[name] for name in names]
        self.num_keys = len(self.keys)

    def compute(self, batch: tuple[Any, Any]) -> tuple[float, float, float]:
        """zero_grad, forward and backward: (start, forward end, backward end)."""
        start = time.perf_counter()
        self.optimizer.zero_grad()
        loss = loss_of(self.model, batch)
        forward_end = time.perf_counter()
        loss.backward()
        return start, forward_end, time.perf_counter()

    def communicate(self) -> None:
        import torch

        grads = [p.grad for p in self.params]
        self.kv.push(self.keys, grads)
        self.kv.pull(self.keys, out=grads)
        with torch.no_grad():
            for grad in grads:
                grad.div_(self.kv.num_workers)

    def step(self, batch: tuple[Any, Any]) -> tuple[Phases, dict[str, Any]]:
        started_at = time.time()
        start, forward_end, backward_end = self.compute(batch)
        self.communicate()
        communication_end = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        return Phases(started_at, start, forward_end, backward_end, communication_end, end), {}


class WrapperMode:
    """``DistributedOptimizer`` over its own copy of the model: pushes from backward's hooks,
    ``synchronize()`` waits for the pulls, then the wrapped SGD steps."""

    def __init__(
        self, name: str, kv: Any, model: Any, bucket_plan: Any, compression: dict[str, Any]
    ) -> None:
        import torch

        import kvstore.torch as kvt

        self.name = name
        self.model = model
        self.clock = PushClock(kv)
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.optimizer = kvt.DistributedOptimizer(
            sgd,
            model.named_parameters(),
            kv=self.clock,
            compression=compression,
            bucket_plan=bucket_plan,
            key_prefix=f"overlap.{name.split()[-1]}/",  # each mode's keys of its own
        )
        self.num_keys = len(self.optimizer.keys)

    def step(self, batch: tuple[Any, Any]) -> tuple[Phases, dict[str, Any]]:
        self.clock.calls.clear()
        started_at = time.time()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        loss = loss_of(self.model, batch)
        forward_end = time.perf_counter()
        loss.backward()  # the hooks push
        backward_end = time.perf_counter()
        self.optimizer.synchronize()
        communication_end = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        phases = Phases(started_at, start, forward_end, backward_end, communication_end, end)
        return phases, push_timing(self.clock.calls, phases)


def timed(barrier: Callable[[], None], fn: Callable[[], Any]) -> float:
    barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def agree(kv: Any, name: str, value: float) -> float:
    """Rank 0's ``value`` on every worker (``init`` keeps the first worker's value)."""
    import numpy as np

    key = f"overlap.agree/{name}"
    kv.init(key, np.array([value], np.float64))
    out = np.zeros(1, np.float64)
    kv.pull(key, out=out)
    return float(out[0])


def calibrate(
    kv: Any, baseline: PushAfterBackward, rank: int, width: int, settings: dict[str, Any]
) -> dict[str, Any]:
    """Pick the batch whose backward takes about as long as push+pull of every key; measure
    both alone at that batch. Every worker makes the same calls (barriers, agreements)."""
    repeats = settings["calibration_repeats"]
    batch_size = settings["start_batch"]
    batch = make_batch(rank, batch_size, width)
    baseline.compute(batch)  # gradients to push
    for _ in range(settings["comm_warmup"]):  # untimed: TCP windows grow over the first rounds
        timed(kv.barrier, baseline.communicate)
    comm = statistics.median(timed(kv.barrier, baseline.communicate) for _ in range(repeats))
    comm = agree(kv, "comm", comm)
    choices = []
    for iteration in range(2):  # backward's cost per sample shrinks as the batch grows
        backward = statistics.median(_backward_seconds(kv, baseline, batch) for _ in range(repeats))
        wanted = round(batch_size * comm / backward)
        batch_size = int(agree(kv, f"batch{iteration}", min(settings["max_batch"], max(1, wanted))))
        choices.append(batch_size)
        batch = make_batch(rank, batch_size, width)
    forwards, backwards, comms = [], [], []
    for _ in range(repeats):
        kv.barrier()
        start, forward_end, backward_end = baseline.compute(batch)
        forwards.append(forward_end - start)
        backwards.append(backward_end - forward_end)
        comms.append(timed(kv.barrier, baseline.communicate))
    return {
        "batch": batch_size,
        "batch_choices": choices,
        "forward": forwards,
        "backward": backwards,
        "communication": comms,
    }


def _backward_seconds(kv: Any, baseline: PushAfterBackward, batch: tuple[Any, Any]) -> float:
    kv.barrier()
    _, forward_end, backward_end = baseline.compute(batch)
    return backward_end - forward_end


def bucket_plan(plan: str, kv: Any, model: Any, calibration: dict[str, Any]) -> Any:
    """The ``bucket_plan`` of a wrapper mode (:data:`WRAPPER_PLANS`)."""
    if plan == "bucket":  # two of the default model's eight layers per bucket
        return {"bucket_bytes": -(-model_bytes(model) // 4)}
    if plan == "mgs-measured":
        return measured_mgs_plan(kv, model, calibration)
    return plan  # "none", "mgs"


def measured_mgs_plan(kv: Any, model: Any, calibration: dict[str, Any]) -> Any:
    """The MGS planner with this run's costs (rank 0's: every worker must plan alike)."""
    from kvstore.torch import mgs

    numel = sum(p.numel() for p in model.parameters())
    per_element = agree(kv, "mgs.backward", statistics.median(calibration["backward"]) / numel)
    per_byte = agree(kv, "mgs.comm", statistics.median(calibration["communication"]) / (4 * numel))
    costs = mgs.ParameterCosts(
        comm=mgs.CommCost(MGS_MESSAGE_SECONDS, per_byte),
        backward_seconds_per_element=per_element,
    )
    return mgs.planner(costs)


def run_worker(args: argparse.Namespace) -> None:
    import torch

    import kvstore

    torch.set_num_threads(1)  # two workers share the machine's cores with every other host
    settings = json.loads(args.settings)
    width, depth = settings["width"], settings["depth"]
    compression = CODECS[settings["codec"]]
    # (the servers start while this process imports: their addresses come on stdin)
    addresses = sys.stdin.readline().split()
    kv = kvstore.create("dist_sync", servers=addresses, rank=args.rank, num_workers=2)
    base = make_model(width, depth)
    # push-after-backward pushes the keys of the one-key-per-parameter wrapper
    per_parameter = WrapperMode("wrapper none", kv, copy.deepcopy(base), "none", compression)
    names = [bucket[0] for bucket in per_parameter.optimizer.buckets]
    baseline = PushAfterBackward(kv, copy.deepcopy(base), per_parameter.optimizer.keys, names)
    calibration = calibrate(kv, baseline, args.rank, width, settings)
    batch = make_batch(args.rank, calibration["batch"], width)

    modes: list[Any] = [baseline]
    for plan in settings["plans"]:  # (made in the same order everywhere: init is collective)
        if plan == "none":
            modes.append(per_parameter)
            continue
        spec = bucket_plan(plan, kv, base, calibration)
        modes.append(WrapperMode(f"wrapper {plan}", kv, copy.deepcopy(base), spec, compression))

    results: dict[str, list[dict[str, Any]]] = {mode.name: [] for mode in modes}
    warmup = settings["warmup_steps"]
    for round_index in range(warmup + settings["steps"]):
        shift = round_index % len(modes)  # each mode follows each other one in turn
        for mode in modes[shift:] + modes[:shift]:
            kv.barrier()
            phases, pushes = mode.step(batch)
            if round_index >= warmup:
                results[mode.name].append({**phases.record(), **pushes})
    kv.barrier()
    report = {
        "torch": torch.__version__,
        "calibration": calibration,
        "keys": {mode.name: mode.num_keys for mode in modes},
        "steps": results,
    }
    kv.close()
    print(json.dumps(report), flush=True)


# orchestration -------------------------------------------------------------------------------


class LoopbackHosts:
    """:class:`netns.Cluster`'s face on this machine's loopback: every host is 127.0.0.1 and
    nothing is shaped (for the smoke preset where namespaces cannot be made)."""

    rate_mbit = None

    def __init__(self, num_hosts: int) -> None:
        from benchmarks.netns import Host

        self.hosts = [Host(i, "", "127.0.0.1") for i in range(num_hosts)]

    def __enter__(self) -> LoopbackHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_processes()

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` as :meth:`benchmarks.netns.Cluster.popen` does, on loopback."""
        process = subprocess.Popen(list(argv), start_new_session=True, **{"cwd": REPO, **kwargs})
        self.hosts[host].processes.append(process)
        return process

    def stop_processes(self, grace: float = 10.0) -> None:
        for host in self.hosts:
            for process in host.processes:
                if process.poll() is None:
                    process.terminate()
            for process in host.processes:
                try:
                    process.wait(grace)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            host.processes.clear()


def _hosts(network: str, num_hosts: int, rate: float) -> tuple[Any, str, str | None]:
    """The hosts to run on, which network that is, and why netns was not used (or None)."""
    from benchmarks.netns import Cluster, available

    if network == "loopback":
        return LoopbackHosts(num_hosts), "loopback", None
    why_not = available()
    if why_not is None:
        return Cluster(num_hosts, rate), "netns", None
    if network == "netns":
        raise SystemExit(f"bench_overlap.py: --network netns: {why_not}")
    return LoopbackHosts(num_hosts), "loopback", why_not


def _slowest(per_worker: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each step as its slowest worker saw it (every worker ran the same steps)."""
    return [max(step, key=lambda s: s["seconds"]) for step in zip(*per_worker, strict=True)]


def _median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 4)


def _slowest_median(per_worker: list[list[float]]) -> float:
    return _median([max(rep) for rep in zip(*per_worker, strict=True)])


def _mode_record(name: str, steps: list[dict[str, Any]], cpu: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "mode": name,
        "seconds_per_step": _median([s["seconds"] for s in steps]),
        "step_seconds": [round(s["seconds"], 4) for s in steps],
    }
    for phase in ("forward", "backward", "wait", "update"):
        record[f"{phase}_seconds"] = _median([s[phase] for s in steps])
    if "pushes" in steps[0]:
        record["pushes"] = steps[0]["pushes"]
        for field in ("pushes_in_backward", "bytes_in_backward", "first_push", "last_push_end",
                      "push_call_seconds_in_backward"):  # fmt: skip
            record[field] = _median([s[field] for s in steps])
    usages = [cpu.usage(s["started_at"], s["started_at"] + s["seconds"]) for s in steps]
    usages = [u for u in usages if u]  # (steps shorter than the monitor's sampling have none)
    for share in ("cpu_busy", "cpu_job", "cpu_others", "cpu_steal"):
        if usages:
            record[share] = round(statistics.mean(u[share] for u in usages), 2)
    return record


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The preset, with the options given on the command line (what every worker is told)."""
    unknown = [p for p in args.plans if p not in WRAPPER_PLANS]
    if unknown:
        raise SystemExit(f"bench_overlap.py: unknown plans {unknown}; expected {WRAPPER_PLANS}")
    settings = dict(PRESETS[args.preset])
    for name in ("network", "rate", "width", "depth", "steps", "warmup_steps", "max_batch"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    settings["codec"] = args.codec
    settings["plans"] = args.plans
    return settings


def _run_job(hosts: Any, settings: dict[str, Any], servers: int, timeout: float) -> tuple:
    """Start the servers (hosts ``0..servers-1``) and the two workers (the next two hosts);
    return the workers' reports and the CPU monitor that watched them."""
    from benchmarks.bench_cluster import CpuMonitor

    py = sys.executable
    worker_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    workers = []
    for rank in range(2):  # first: they import torch while the servers start
        argv = module_command("bench_overlap", "--role", "worker", "--rank", str(rank),
                              "--settings", json.dumps(settings))  # fmt: skip
        workers.append(
            hosts.popen(
                servers + rank,
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=worker_env,
            )  # fmt: skip
        )
    server_env = {**os.environ, "KVSTORE_LOG_LEVEL": "ERROR"}
    server_processes = []
    for rank in range(servers):
        argv = [py, "-m", "kvstore.server", "--host", hosts.hosts[rank].address, "--port", "0",
                "--server-rank", str(rank), "--num-servers", str(servers), "--num-workers", "2",
                "--threads", "2"]  # fmt: skip
        server_processes.append(
            hosts.popen(rank, argv, stdout=subprocess.PIPE, text=True, env=server_env)
        )
    addresses = " ".join(server_addresses(server_processes))
    for worker in workers:
        worker.stdin.write(addresses + "\n")
        worker.stdin.flush()  # (communicate() closes it)
    with CpuMonitor([p.pid for p in server_processes + workers]) as cpu:
        reports = _collect(workers, timeout)
    hosts.stop_processes()
    return reports, cpu


def orchestrate(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_signal)  # unwind: the hosts are torn down
    signal.signal(signal.SIGHUP, _exit_on_signal)
    settings = _settings(args)
    started = time.time()
    hosts, network, why_not = _hosts(settings["network"], args.servers + 2, settings["rate"])
    with hosts:
        reports, cpu = _run_job(hosts, settings, args.servers, args.timeout)

    calibrations = [r["calibration"] for r in reports]
    width, depth = settings["width"], settings["depth"]
    shared = {
        "network": network,
        **({"netns_unavailable": why_not} if why_not else {}),
        "rate_mbit": hosts.rate_mbit,
        "workers": 2,
        "servers": args.servers,
        "codec": args.codec,
        "width": width,
        "depth": depth,
        "params": depth * (width * width + width),
        "model_bytes": 4 * depth * (width * width + width),
        "batch": calibrations[0]["batch"],
        "backward_alone_seconds": _slowest_median([c["backward"] for c in calibrations]),
        "forward_alone_seconds": _slowest_median([c["forward"] for c in calibrations]),
        "communication_alone_seconds": _slowest_median([c["communication"] for c in calibrations]),
    }
    records = []
    for name in reports[0]["steps"]:
        steps = _slowest([r["steps"][name] for r in reports])
        record = {"bench": "overlap", **_mode_record(name, steps, cpu)}
        records.append({**record, "keys": reports[0]["keys"][name], **shared})
    baseline = next(r for r in records if r["mode"] == PUSH_AFTER_BACKWARD)
    for record in records:
        record["ratio_to_push_after_backward"] = round(
            record["seconds_per_step"] / baseline["seconds_per_step"], 3
        )
        # > 1: backward ran slower while the pushes travelled (the cores are shared)
        record["backward_over_push_after_backward"] = round(
            record["backward_seconds"] / baseline["backward_seconds"], 3
        )
        emit(record)
        append_jsonl(args.out, record)
    summary = {
        "bench": "overlap",
        "preset": args.preset,
        **shared,
        "batch_choices": calibrations[0]["batch_choices"],
        "communication_over_backward": round(
            shared["communication_alone_seconds"] / shared["backward_alone_seconds"], 3
        ),
        **_in_run(baseline),
        **_ratios(records, baseline),
        "machine": {**machine(), "torch": reports[0]["torch"]},
        "wall_seconds": round(time.time() - started, 1),
    }
    emit(summary)
    append_jsonl(args.out, summary)
    return 0


def _in_run(baseline: dict[str, Any]) -> dict[str, Any]:
    """Backward and communication as push-after-backward's steps took them in the timed run
    (interleaved with the other modes), and the ratio that perfect overlap would reach: the
    same steps with the shorter of the two hidden behind the longer, nothing else changed."""
    compute = baseline["forward_seconds"] + baseline["update_seconds"]
    backward, communication = baseline["backward_seconds"], baseline["wait_seconds"]
    return {
        "in_run_backward_seconds": backward,
        "in_run_communication_seconds": communication,
        "full_overlap_ratio": round(
            (compute + max(backward, communication)) / (compute + backward + communication), 3
        ),
    }


def _ratios(records: list[dict[str, Any]], baseline: dict[str, Any]) -> dict[str, Any]:
    ratios = {r["mode"]: r["ratio_to_push_after_backward"] for r in records if r is not baseline}
    return {
        "ratios": ratios,
        "best_ratio": min(ratios.values()) if ratios else None,
        "target_ratio": TARGET_RATIO,
    }


def _collect(workers: list[subprocess.Popen], timeout: float) -> list[dict[str, Any]]:
    """Each worker's report (its last stdout line); a worker that failed raises with its
    stderr."""
    reports = []
    deadline = time.monotonic() + timeout
    for rank, process in enumerate(workers):
        out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if process.returncode != 0:
            raise RuntimeError(f"worker {rank} exited with {process.returncode}: {err[-2000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument(
        "--network",
        choices=["auto", "netns", "loopback"],
        help="shaped hosts (netns, needs root), this machine's loopback, or netns where "
        "possible (auto; smoke's default; full's is netns)",
    )
    parser.add_argument("--rate", type=float, help="link rate in Mbit/s (netns)")
    parser.add_argument("--width", type=int, help="features of every Linear layer")
    parser.add_argument("--depth", type=int, help="Linear layers")
    parser.add_argument("--max-batch", type=int, help="largest batch the calibration may pick")
    parser.add_argument("--servers", type=int, choices=[1, 2], default=1)
    parser.add_argument("--codec", choices=sorted(CODECS), default="none")
    parser.add_argument(
        "--plans",
        type=lambda v: [x for x in v.split(",") if x],
        default=list(WRAPPER_PLANS),
        help=f"the wrapper modes' bucket plans (default {','.join(WRAPPER_PLANS)})",
    )
    parser.add_argument("--steps", type=int, help="timed steps of each mode")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps of each mode first")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "worker":
        run_worker(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
