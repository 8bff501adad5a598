"""Wall time to a test accuracy: the parameter server, dense and compressed both ways, against
torch DDP (gloo allreduce, fp32 and torch's PowerSGD hook), on shaped links.

Each run trains the MNIST example's model (``--model``, CNN by default) with ``--workers``
workers, one per host of a shaped-link cluster (network namespaces, ``--rate`` Mbit/s full
duplex each, :mod:`netns`), and reads worker 0's per-epoch test accuracy and seconds. A run
ends at the first epoch whose test accuracy reaches ``--target`` (``--no-stop``: it trains on),
at ``--epochs`` epochs, or at ``--timeout`` seconds, whichever comes first: compressed runs need
more epochs than dense ones to get there (each of them far cheaper), so a fixed epoch budget
would measure where the runs stand, not when they arrive. Parameter-server runs put one
server on each worker's host (colocated: each host's link carries a share of the keys, like the
ring of allreduce) and run ``examples/mnist/train.py`` with the servers' SGD; DDP runs
:mod:`benchmarks.ddp_mnist` with the same model, data shards, batch, seed and SGD (both commands
and the reading of their epochs are the training runner's, :mod:`benchmarks.training`). Runs
(:data:`RUNS`):

* ``ps-dense``: dense pushes and pulls;
* ``ps-2bit``: 2-bit pushes (``residual_clip: 1``, for the servers' momentum) and 2-bit
  compressed pulls of the weights' change;
* ``ps-2bit-bf16``: 2-bit pushes and bf16 compressed pulls;
* ``ps-topk``: top-k pushes (ratio 0.01) and top-k compressed pulls (ratio 0.01);
* ``ddp-fp32``: DDP's allreduce of fp32 gradients;
* ``ddp-powersgd``: DDP with torch's PowerSGD hook, rank 4, compressing from step 2;
* ``ddp-fp16``: DDP with torch's fp16 compression hook (16-bit gradients on the wire, the fair
  uncompressed baseline; torch refuses its bf16 hook without NCCL);
* ``ddp-powersgd2-warmup``, ``ddp-powersgd4-warmup``: the PowerSGD hook at rank 2 and 4 after
  an epoch of fp32 allreduce (its documented warm-up, ``start_powerSGD_iter``), with its
  error feedback and warm start (torch's defaults);
* ``diloco``: the example's DiLoCo mode (``--diloco``, :mod:`kvstore.torch.DiLoCo`): the same
  SGD as every other run's, locally, and every 31 steps (an epoch) an outer step on the
  servers (the paper's Nesterov SGD, learning rate 0.7, momentum 0.9), dense pseudo-gradients
  and weights;
* ``diloco-topk``: top-k 10% pseudo-gradients (error feedback) and bf16 pulls, the outer step
  a plain average (outer SGD, learning rate 1, no momentum: error feedback in its place);
* ``diloco-topk-2bit``: ``topk2bit`` 10% both ways (top-k, the kept values in 2 bits), the
  outer step a plain average;
* ``torchft-diloco``: torchft's DiLoCo (:mod:`benchmarks.torchft_mnist`, set up as
  :mod:`benchmarks.torchft_peer` says) at the same H and outer Nesterov SGD as ``diloco``, on
  gloo, with its lighthouse on worker 0's host; it reports the last synced model's accuracy;
* ``torchft-localsgd``: torchft's LocalSGD (the workers' models averaged every H = 31 steps);
* ``hivemind-fp16``, ``hivemind-uint8``: ``hivemind.Optimizer``
  (:mod:`benchmarks.hivemind_mnist`, set up as :mod:`benchmarks.hivemind_peer` says) averaging
  every step's gradients, compressed by its ``Float16Compression`` or
  ``Uniform8BitQuantization``, one round per step of every worker, as DDP;
* ``hivemind-local-fp16``: its local updates (``use_local_updates``): every worker steps on its
  own gradients and the parameters are averaged (fp16) in the background every round.

``--workload charlm`` races the language-model example's transformer instead (4 workers of
``examples/charlm/train.py``, 300 AdamW steps by default, ``--steps``) to a held-out perplexity
(``--target``, 14 by default), evaluated every ``--eval-every`` steps:

* ``lm-ps-sync``: the example's synchronous mode (dense gradients pushed every step, AdamW on
  the workers);
* ``lm-diloco``: its DiLoCo mode, H = 20, the outer Nesterov SGD on the servers;
* ``lm-diloco-bf16``: the same DiLoCo with bf16 pseudo-gradients (error feedback) and bf16
  pulls, half the bytes;
* ``lm-ddp-fp32``, ``lm-ddp-fp16``, ``lm-ddp-powersgd4-warmup``: DDP on gloo
  (:mod:`benchmarks.ddp_charlm`, the same training as ``lm-ps-sync``), in fp32, with the fp16
  hook, and with PowerSGD at rank 4 after the example's 30 warm-up steps of fp32;
* ``lm-torchft-diloco``, ``lm-torchft-localsgd``: torchft's DiLoCo (the same H = 20 and outer
  Nesterov SGD as ``lm-diloco``) and LocalSGD (H = 20) around the example's inner AdamW
  (:mod:`benchmarks.torchft_charlm`);
* ``lm-hivemind-fp16``, ``lm-hivemind-uint8``, ``lm-hivemind-local-fp16``: ``hivemind.Optimizer``
  around the example's AdamW and schedule (:mod:`benchmarks.hivemind_charlm`), as the MNIST
  runs of the same names.

Peers run in the harness's interpreter: a run whose peer is not installed there (``pip install
'pskv[bench]'``) is skipped with a line saying so. The smoke preset runs no peer; it says for
each whether it is installed.

DiLoCo runs report the accuracy of the outer weights (the model the job agrees on).

``--rates`` trains every run at each link rate, in one invocation. Every epoch record also says
``sent_bytes_per_host``: the bytes each worker's host sent through its link since the run began
(counted at the bridge's end of its link, so everything counts: gradients, weights, headers,
retransmissions; a parameter-server host's colocated server included), the mean over hosts, and
the CPU split of the epoch as :mod:`benchmarks.bench_cluster` records it (``cpu_busy`` near 1:
this machine's cores, not the links, set the pace).
``--floor RUN ...`` also trains those runs on links that cost nothing (the same hosts, links
not shaped): the run's compute floor is their seconds per epoch there times the epochs the run
needed on shaped links, and the summary gives its time against it.

Prints a JSON line per epoch of each run (its cumulative seconds included) and one per run
with the seconds to ``--target`` (null when the run never got there); ``--table`` and
``--plot`` write a markdown table and a plot of accuracy against wall time.

    python -m benchmarks.time_to_accuracy --preset full --table tta.md --plot docs/img/tta.png
    python -m benchmarks.time_to_accuracy --from results/time_to_accuracy.jsonl --table t.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import append_jsonl, emit, machine, module_command, server_addresses
from benchmarks.training import (
    CHARLM,
    Training,
    ddp_command,
    epoch_record,
    example_command,
    steps_per_epoch,
)

DILOCO = ["--diloco", "31", "--outer-lr", "0.7", "--outer-momentum", "0.9"]
"""Dense DiLoCo's options: H = 31 inner steps per outer step (one epoch of 4 workers), the
paper's outer Nesterov SGD (learning rate 0.7, momentum 0.9)."""

DILOCO_AVERAGE = ["--diloco", "31", "--outer-lr", "1.0", "--outer-momentum", "0"]
"""Compressed DiLoCo's options: H = 31, the outer step the mean of the workers' models."""

RUNS: dict[str, dict[str, Any]] = {
    "ps-dense": {"push": "none", "pull": "none"},
    "ps-2bit": {"push": "2bit:threshold=0.01,residual_clip=1", "pull": "2bit:threshold=0.002"},
    "ps-2bit-bf16": {"push": "2bit:threshold=0.01,residual_clip=1", "pull": "bf16"},
    "ps-topk": {"push": "topk:ratio=0.01", "pull": "topk:ratio=0.01"},
    "ddp-fp32": {"ddp": 0},
    "ddp-powersgd": {"ddp": 4},
    "ddp-fp16": {"ddp": 0, "compress": "fp16"},
    "ddp-powersgd2-warmup": {"ddp": 2, "warmup_epochs": 1},
    "ddp-powersgd4-warmup": {"ddp": 4, "warmup_epochs": 1},
    "diloco": {"push": "none", "pull": "none", "diloco": DILOCO},
    "diloco-topk": {"push": "topk:ratio=0.1", "pull": "bf16", "diloco": DILOCO_AVERAGE},
    "diloco-topk-2bit": {"push": "topk2bit:ratio=0.1", "pull": "topk2bit:ratio=0.1",
                         "diloco": DILOCO_AVERAGE},
    "torchft-diloco": {"peer": "torchft", "mode": "diloco", "sync_every": 31,
                       "outer_lr": 0.7, "outer_momentum": 0.9},
    "torchft-localsgd": {"peer": "torchft", "mode": "localsgd", "sync_every": 31},
    "hivemind-fp16": {"peer": "hivemind", "compression": "fp16"},
    "hivemind-uint8": {"peer": "hivemind", "compression": "uint8"},
    "hivemind-local-fp16": {"peer": "hivemind", "compression": "fp16", "local_updates": True},
}  # fmt: skip

LM_DILOCO = ["--mode", "diloco", "--sync-every", "20", "--outer-lr", "0.7",
             "--outer-momentum", "0.9"]  # fmt: skip
"""The language model's DiLoCo: H = 20 inner AdamW steps, the paper's outer Nesterov SGD."""

RUNS.update({
    "lm-ps-sync": {"workload": "charlm", "push": "none", "pull": "none", "lm": ["--mode", "sync"]},
    "lm-diloco": {"workload": "charlm", "push": "none", "pull": "none", "lm": LM_DILOCO},
    "lm-ddp-fp32": {"workload": "charlm", "ddp": 0},
    "lm-ddp-fp16": {"workload": "charlm", "ddp": 0, "compress": "fp16"},
    "lm-ddp-powersgd4-warmup": {"workload": "charlm", "ddp": 4, "warmup_steps": 30},
    "lm-diloco-bf16": {"workload": "charlm", "push": "bf16", "pull": "bf16", "lm": LM_DILOCO},
    "lm-torchft-diloco": {"workload": "charlm", "peer": "torchft", "mode": "diloco",
                          "sync_every": 20, "outer_lr": 0.7, "outer_momentum": 0.9},
    "lm-torchft-localsgd": {"workload": "charlm", "peer": "torchft", "mode": "localsgd",
                            "sync_every": 20},
    "lm-hivemind-fp16": {"workload": "charlm", "peer": "hivemind", "compression": "fp16"},
    "lm-hivemind-uint8": {"workload": "charlm", "peer": "hivemind", "compression": "uint8"},
    "lm-hivemind-local-fp16": {"workload": "charlm", "peer": "hivemind", "compression": "fp16",
                               "local_updates": True},
})  # fmt: skip

WORKLOADS = {
    "mnist": {"target": 0.97, "baselines": ("ps-dense", "ddp-fp32")},
    "charlm": {"target": 14.0, "baselines": ("lm-ps-sync", "lm-ddp-fp32")},
}
"""Each workload's default target (MNIST: test accuracy to reach; the language model:
held-out perplexity to get down to) and the runs its table compares every run with."""

PEER_MODULES = {
    ("torchft", "mnist"): "torchft_mnist",
    ("torchft", "charlm"): "torchft_charlm",
    ("hivemind", "mnist"): "hivemind_mnist",
    ("hivemind", "charlm"): "hivemind_charlm",
}
"""Each peer's worker for each workload, ``benchmarks.<module>``; the peer itself comes with the
``bench`` extra."""

SERVERS = {"kvstore": "colocated"}
"""Where each system's servers run, for the table: the parameter server's on the workers' hosts,
one each (DDP, torchft and hivemind have none)."""

PRESETS = {
    "smoke": {"runs": ["ps-2bit", "ddp-fp32", "diloco"], "floor": ["diloco"], "epochs": 1,
              "rate": 1000.0, "workers": 2, "model": "mlp", "peers": "report"},
    "full": {"runs": [name for name, run in RUNS.items() if "workload" not in run],
             "epochs": 24, "rate": 100.0, "workers": 4, "model": "cnn"},
    "slow": {"runs": ["ddp-powersgd", "ps-topk", "ps-2bit", "diloco-topk", "diloco-topk-2bit"],
             "epochs": 24, "rate": 10.0, "workers": 4, "model": "cnn"},
}  # fmt: skip


def _training(args: argparse.Namespace) -> Training:
    """What every run's workers train (the runner's default batch of 32 images per worker)."""
    return Training(args.model, args.epochs, args.lr, args.momentum, args.seed)


def _lm_schedule(args: argparse.Namespace) -> list[str]:
    """The language model's training options every one of its runs shares."""
    return ["--steps", str(args.steps), "--eval-every", str(args.eval_every),
            "--seed", str(args.seed)]  # fmt: skip


def progress_record(line: str) -> dict[str, Any] | None:
    """Worker 0's report in a line of its output: an MNIST epoch (``epoch``, ``accuracy``, its
    ``seconds``) or a language-model evaluation (``step``, ``perplexity``, ``seconds`` since
    training began); None for any other line."""
    epoch = epoch_record(line)
    if epoch is not None or not line.startswith("{"):
        return epoch
    record = json.loads(line)
    return record if isinstance(record, dict) and "perplexity" in record else None


REPORT_CLOCKS = ("seconds", "wall")
"""The clocks of every report record: the report's own seconds and the run's wall seconds
after it (what the tables and plots read)."""


def report_point(report: dict[str, Any], wall: float) -> tuple[dict[str, Any], float]:
    """What a run's record keeps of worker 0's ``report`` (:func:`progress_record`), and the
    run's wall seconds after it, given ``wall`` before it: an MNIST epoch brings its own
    seconds, a language-model evaluation the seconds since training began."""
    if "epoch" in report:
        point = {"epoch": report["epoch"], "accuracy": report["accuracy"]}
        seconds = report["seconds"]
    else:
        point = {"step": report["step"], "perplexity": report["perplexity"]}
        seconds = report["seconds"] - wall
    return {**point, "seconds": round(seconds, 3)}, wall + seconds


def reached(record: dict[str, Any], target: float) -> bool:
    """Whether a run's record is at ``target``: a test accuracy at least it, or a perplexity
    at most it."""
    if "perplexity" in record:
        return bool(record["perplexity"] <= target)
    return bool(record["accuracy"] >= target)


def quality(record: dict[str, Any]) -> float:
    """A record's test accuracy, or its perplexity."""
    return float(record["accuracy"] if "accuracy" in record else record["perplexity"])


def run_ps(cluster: Any, args: argparse.Namespace, run: dict[str, Any]) -> subprocess.Popen:
    """Start colocated servers and the workers of a parameter-server run; worker 0's process."""
    n, py = args.workers, sys.executable
    env = {**os.environ, "KVSTORE_LOG_LEVEL": "ERROR"}
    servers = [
        cluster.popen(
            host,
            [
                py,
                "-m",
                "kvstore.server",
                "--host",
                cluster.hosts[host].address,
                "--port",
                "0",
                "--server-rank",
                str(host),
                "--num-servers",
                str(n),
                "--num-workers",
                str(n),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for host in range(n)
    ]
    addresses = ",".join(server_addresses(servers))
    workers = []
    for rank in range(n):
        worker_env = {**env, "KVSTORE_SERVERS": addresses, "KVSTORE_RANK": str(rank),
                      "KVSTORE_NUM_WORKERS": str(n)}  # fmt: skip
        if run.get("workload") == "charlm":
            argv = [py, str(CHARLM / "train.py"), *run["lm"], "--compression", run["push"],
                    "--pull-compression", run["pull"], *_lm_schedule(args),
                    "--json", "-"]  # fmt: skip
        else:
            argv = example_command(
                _training(args),
                push=run["push"],
                pull=run["pull"],
                optimizer="server",
                json_to="-",
                extra=run.get("diloco", ()),
            )
        workers.append(
            cluster.popen(
                rank,
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=worker_env,
            )  # fmt: skip
        )
    return workers[0]


def start_gloo_workers(
    cluster: Any, args: argparse.Namespace, command: Callable[[int], list[str]]
) -> subprocess.Popen:
    """Start ``command(rank)`` on every worker's host, with gloo on that host's interface;
    worker 0's process (its output, stderr included, in its ``stdout``)."""
    workers = [
        cluster.popen(
            rank,
            command(rank),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "GLOO_SOCKET_IFNAME": cluster.interface(rank)},
        )
        for rank in range(args.workers)
    ]
    return workers[0]


def ddp_worker_command(
    args: argparse.Namespace, run: dict[str, Any], master: str, rank: int
) -> list[str]:
    """Rank ``rank``'s DDP worker of ``run``: the MNIST one or the language model's."""
    if run.get("workload") == "charlm":
        return module_command(
            "ddp_charlm", "--master", master, "--rank", str(rank),
            "--num-workers", str(args.workers), *_lm_schedule(args),
            "--powersgd", str(run["ddp"]), "--powersgd-start", str(run.get("warmup_steps", 2)),
            "--compress", run.get("compress", "none"),
        )  # fmt: skip
    training = _training(args)
    warmup = 2  # steps of fp32 before PowerSGD, unless the run asks for epochs of it
    if "warmup_epochs" in run:
        warmup = run["warmup_epochs"] * steps_per_epoch(training, args.workers)
    return ddp_command(
        training,
        master=master,
        rank=rank,
        num_workers=args.workers,
        powersgd=run["ddp"],
        powersgd_start=warmup,
        compress=run.get("compress", "none"),
    )


def run_ddp(cluster: Any, args: argparse.Namespace, run: dict[str, Any]) -> subprocess.Popen:
    """Start the DDP workers; worker 0's process."""
    master = f"{cluster.hosts[0].address}:29511"
    return start_gloo_workers(
        cluster, args, lambda rank: ddp_worker_command(args, run, master, rank)
    )


def peer_missing(name: str) -> str | None:
    """Why run ``name``'s peer cannot run in this interpreter (None: it can, or it is no peer's)."""
    peer = RUNS[name].get("peer")
    if peer is None or importlib.util.find_spec(peer) is not None:
        return None
    return f"{peer} is not installed in {sys.executable} (pip install 'pskv[bench]')"


def peer_command(
    cluster: Any, args: argparse.Namespace, run: dict[str, Any], rank: int, meeting: Path
) -> list[str]:
    """Rank ``rank``'s worker of a peer's run; ``meeting``: a fresh file path the workers may
    use to find each other (hivemind's rank 0 writes its addresses there)."""
    address = cluster.hosts[rank].address
    workload = run.get("workload", "mnist")
    module = PEER_MODULES[run["peer"], workload]
    training = _lm_schedule(args) if workload == "charlm" else _training(args).flags()
    if run["peer"] == "hivemind":
        return module_command(
            module, "--rank", str(rank), "--num-workers", str(args.workers),
            "--host", address, "--peer-file", str(meeting),
            "--compression", run["compression"],
            *(["--local-updates"] if run.get("local_updates") else []), *training,
        )  # fmt: skip
    if run["peer"] == "torchft":
        lighthouse = f"{cluster.hosts[0].address}:29510"
        outer = ["--outer-lr", str(run["outer_lr"]), "--outer-momentum",
                 str(run["outer_momentum"])] if run["mode"] == "diloco" else []  # fmt: skip
        return module_command(
            module, "--rank", str(rank), "--num-workers", str(args.workers),
            "--host", address, "--lighthouse", lighthouse,
            *(["--start-lighthouse"] if rank == 0 else []),
            "--mode", run["mode"], "--sync-every", str(run["sync_every"]), *outer, *training,
        )  # fmt: skip
    raise ValueError(f"no worker command for the peer {run['peer']!r}")


def run_peer(
    cluster: Any, args: argparse.Namespace, run: dict[str, Any], scratch: Path
) -> subprocess.Popen:
    """Start a peer's workers, one per host; worker 0's process. ``scratch``: a folder of
    this run's, which every host sees."""
    meeting = scratch / "rank0"
    return start_gloo_workers(
        cluster, args, lambda rank: peer_command(cluster, args, run, rank, meeting)
    )


def start_run(
    cluster: Any, args: argparse.Namespace, run: dict[str, Any], scratch: Path
) -> subprocess.Popen:
    """Start any run's processes; worker 0's."""
    if "peer" in run:
        return run_peer(cluster, args, run, scratch)
    return (run_ddp if "ddp" in run else run_ps)(cluster, args, run)


def run_one(args: argparse.Namespace, name: str, rate: float) -> list[dict[str, Any]]:
    """Train run ``name`` on a fresh cluster with links of ``rate`` Mbit/s (0: not shaped)
    until worker 0 reports the target (unless ``args.no_stop``), the run's last report
    (:func:`reports_expected`) or ``args.timeout`` seconds; the records of worker 0's reports
    (cumulative seconds in ``wall``).

    Raises:
        RuntimeError: the workers stopped before any of those, or reported nothing.
    """
    from benchmarks.bench_cluster import CpuMonitor
    from benchmarks.netns import Cluster

    run = RUNS[name]
    records: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="tta-") as scratch,
        Cluster(args.workers, rate) as cluster,
    ):
        lead = start_run(cluster, args, run, Path(scratch))
        started_sent = host_sent_bytes(cluster)
        job = [process.pid for host in cluster.hosts for process in host.processes]
        deadline = time.monotonic() + args.timeout
        output = []
        wall = 0.0
        arrived = timed_out = False
        with CpuMonitor(job, descendants=True) as cpu:
            report_began = time.time()
            for line in lines_until(lead.stdout, deadline):
                if line is None:  # the deadline passed with no line: a round may take longer
                    timed_out = True
                    break
                output.append(line)
                report = progress_record(line)
                if report is not None:
                    point, wall = report_point(report, wall)
                    sent = [now - then for now, then in
                            zip(host_sent_bytes(cluster), started_sent, strict=True)]  # fmt: skip
                    records.append({"bench": "time_to_accuracy", "run": name, **_spec(run),
                                    "rate_mbit": rate,
                                    "pushed_bytes": report.get("pushed_bytes_total"),
                                    "sent_bytes_per_host": round(sum(sent) / len(sent)),
                                    **point, "wall": round(wall, 3),
                                    **cpu.usage(report_began, time.time()),
                                    **({"pulled_bytes": report["pulled_bytes"]}
                                       if "pulled_bytes" in report else {})})  # fmt: skip
                    report_began = time.time()
                    arrived = reached(records[-1], args.target) and not args.no_stop
                    if arrived:
                        break  # the rest of the run would not change its time
        cluster.stop_processes()
        expected = reports_expected(args)
        if timed_out and not records:
            raise RunTimedOut(f"{NO_REPORT} {args.timeout:g} s timeout")
        if not records or not (arrived or timed_out or len(records) == expected):
            raise RuntimeError(f"{name}: the workers stopped after {len(records)} of "
                               f"{expected} reports; worker 0 said "
                               f"{''.join(output[-20:])[-1500:]}")  # fmt: skip
    return records


NO_REPORT = "no report within the"
"""How a run that reported nothing before its timeout is described: slower than that per report."""


class RunTimedOut(RuntimeError):
    """A run reported nothing before its timeout: it is slower than the timeout per report,
    not broken."""


def lines_until(stream: Any, deadline: float) -> Iterator[str | None]:
    """The lines of ``stream`` until it ends, then None if ``deadline`` (``time.monotonic()``)
    passes first: a reader thread, so that a worker silent for longer than the timeout (a
    peer's epoch on a slow link) cannot hold the run past it."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        try:
            for line in stream:
                lines.put(line)
        except (OSError, ValueError):  # closed under it: the run is over, nobody reads on
            pass
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            yield None
            return
        if line is None:
            return
        yield line


def reports_expected(args: argparse.Namespace) -> int:
    """How many reports worker 0 makes in a whole run: an epoch's each, or an evaluation's
    every ``--eval-every`` steps and after the last."""
    if args.workload == "charlm":
        return -(-args.steps // args.eval_every)
    return int(args.epochs)


def host_sent_bytes(cluster: Any) -> list[int]:
    """What each host has sent through its link so far: the receive counter of the bridge's
    end of the link (in this namespace, so no process inside the hosts is asked)."""
    counters = (Path("/sys/class/net") / cluster.bridge_port(host) / "statistics" / "rx_bytes"
                for host in range(cluster.num_hosts))  # fmt: skip
    return [int(counter.read_text()) for counter in counters]


def system_of(run: dict[str, Any]) -> str:
    """The system a run of :data:`RUNS` trains with: ``kvstore``, ``ddp`` or its peer's name."""
    if "peer" in run:
        return str(run["peer"])
    return "ddp" if "ddp" in run else "kvstore"


def _spec(run: dict[str, Any]) -> dict[str, Any]:
    if "peer" in run:
        return {"system": run["peer"], **{k: v for k, v in run.items() if k != "peer"}}
    if "ddp" in run:
        spec = {"system": "ddp", "powersgd_rank": run["ddp"]}
        if run.get("workload"):
            spec["workload"] = run["workload"]
        if run.get("compress", "none") != "none":
            spec["compress"] = run["compress"]
        if run.get("warmup_epochs"):
            spec["powersgd_warmup_epochs"] = run["warmup_epochs"]
        return spec
    spec = {"system": "kvstore", "push": run["push"], "pull": run["pull"]}
    if run.get("workload"):
        spec.update(workload=run["workload"], lm=" ".join(run["lm"]))
    return {**spec, "diloco": " ".join(run["diloco"])} if "diloco" in run else spec


def time_to(records: list[dict[str, Any]], target: float) -> float | None:
    """The wall seconds at the end of the first epoch at or above ``target``."""
    return next((r["wall"] for r in records if reached(r, target)), None)


Runs = dict[tuple[str, float], list[dict[str, Any]]]
"""Each run's epoch records, by run name and link rate (Mbit/s)."""


def summaries(
    by_run: Runs,
    target: float,
    floors: dict[str, list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """One line per run and rate: seconds to ``target``, epochs, bytes worker 0 pushed and its
    host sent, the busiest CPU share of its epochs; and its compute floor (``floor_seconds``:
    seconds per report on links that cost nothing times the reports needed here) and the ratio
    to it. A run trained on free links itself (``floors``) has its own floor; any other run
    the workload's compute floor (:func:`compute_floor`), named in ``floor_from``."""
    per_report = {name: records[-1]["wall"] / len(records)
                  for name, records in (floors or {}).items() if records}  # fmt: skip
    fallback = compute_floor(per_report)
    lines = []
    for (name, rate), records in by_run.items():
        seconds = time_to(records, target)
        at = next((i for i, r in enumerate(records) if reached(r, target)), None)
        there = None if at is None else records[at]
        line = {
            "bench": "time_to_accuracy",
            "run": name,
            "rate_mbit": rate,
            "system": records[0].get("system") if records else None,
            "target": target,
            "seconds_to_target": seconds,
            "metric": "perplexity" if records and "perplexity" in records[0] else "accuracy",
            "final_quality": quality(records[-1]) if records else None,
            "reports": len(records),
            "to_target": None if there is None else there.get("epoch", there.get("step")),
            "pushed_bytes_to_target": None if there is None else there.get("pushed_bytes"),
            "sent_bytes_per_host_to_target": (
                None if there is None else there.get("sent_bytes_per_host")
            ),
            "sent_bytes_per_host_final": (
                records[-1].get("sent_bytes_per_host") if records else None
            ),
            "cpu_busy_max": max((r["cpu_busy"] for r in records if "cpu_busy" in r), default=None),
        }  # fmt: skip
        # Its reports on free links, as many as it needed here: a run of the same training
        # need not reach the target at the same report (the servers' sums are taken in arrival
        # order, which changes their float rounding).
        floor_from = name if name in per_report else fallback
        if floor_from is not None and at is not None and seconds is not None:
            line["floor_from"] = floor_from
            line["floor_seconds"] = round(per_report[floor_from] * (at + 1), 3)
            line["over_floor"] = round(seconds / line["floor_seconds"], 2)
        lines.append(line)
    return lines


def compute_floor(per_report: dict[str, float]) -> str | None:
    """The run whose reports on free links took the least seconds each (None: no such run): the
    workload's compute floor, the model's own computation with next to no communication (a
    DiLoCo run syncs once in many steps), for the runs not trained on free links themselves.
    Every run computes the same model on the same batches, so its floor is that run's seconds
    per report times the reports it needed."""
    return min(per_report, key=per_report.__getitem__, default=None)


def last_words(error: str) -> str:
    """The last line a failed run's worker 0 wrote (its error, when it names one), for a table
    cell."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return (lines[-1] if lines else "no output").replace("|", "/")


def write_table(
    path: Path,
    summary: list[dict[str, Any]],
    target: float,
    failures: dict[tuple[str, float], str] | None = None,
) -> None:
    """One row per run and rate; the ratios compare runs at the same rate (above 1: the run
    reached the target sooner than the one named). "Best peer" is the fastest run of another
    system (DDP, hivemind, torchft) at that rate. A run that could not train keeps its row,
    with the last line its worker 0 wrote (``failures``)."""
    times = {(s["run"], s["rate_mbit"]): s["seconds_to_target"] for s in summary}
    perplexity = any(s["metric"] == "perplexity" for s in summary)
    dense, allreduce = WORKLOADS["charlm" if perplexity else "mnist"]["baselines"]
    best_peer = {}
    for s in summary:
        if s["system"] != "kvstore" and s["seconds_to_target"] is not None:
            best = best_peer.get(s["rate_mbit"])
            if best is None or s["seconds_to_target"] < best[1]:
                best_peer[s["rate_mbit"]] = (s["run"], s["seconds_to_target"])

    def ratio(base: float | None, t: float | None) -> str:
        return f"{base / t:.2f}x" if base and t else "-"

    goal = f"perplexity {target:g}" if perplexity else f"{target:.0%}"
    unit, final = ("steps", "final perplexity") if perplexity else ("epochs", "final accuracy")
    header = (f"| Mbit/s | run | servers | {unit} | seconds to {goal} | {final} "
              "| MB sent per host | CPU busy (max) | dense PS / run | DDP fp32 / run "
              "| best peer / run | over compute floor |")  # fmt: skip
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for s in summary:
        t, rate = s["seconds_to_target"], s["rate_mbit"]
        shown = f"{t:.1f}" if t is not None else "not reached"
        floor = "-"
        if s.get("over_floor"):
            source = "" if s["floor_from"] == s["run"] else f" ({s['floor_from']}'s)"
            floor = f"{s['over_floor']:.2f}x{source}"
        # a run that did not get there: the reports it made, and what it sent for them
        sent = s.get(
            "sent_bytes_per_host_to_target" if t is not None else "sent_bytes_per_host_final"
        )
        sent_mb = f"{sent / 1e6:.1f}" if sent is not None else "-"
        done = s["to_target"] if t is not None else f"{s['reports']} done"
        cpu = f"{s['cpu_busy_max']:.2f}" if s.get("cpu_busy_max") is not None else "-"
        peer = best_peer.get(rate)
        peer_ratio = f"{ratio(peer[1], t)} ({peer[0]})" if peer else "-"
        last = f"{s['final_quality']:.2f}" if perplexity else f"{s['final_quality']:.2%}"
        lines.append(f"| {rate:g} | {s['run']} | {SERVERS.get(s['system'], '-')} "
                     f"| {done} | {shown} | "
                     f"{last} | {sent_mb} | {cpu} | "
                     f"{ratio(times.get((dense, rate)), t)} | "
                     f"{ratio(times.get((allreduce, rate)), t)} | {peer_ratio} "
                     f"| {floor} |")  # fmt: skip
    for (name, rate), error in (failures or {}).items():
        why = error if error.startswith(NO_REPORT) else f"did not train: {last_words(error)}"
        servers = SERVERS.get(system_of(RUNS[name]), "-") if name in RUNS else "-"
        lines.append(f"| {rate:g} | {name} | {servers} | {why} | | | | | | | | |")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, by_run: Runs, target: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = {rate for _, rate in by_run}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, rate), records in by_run.items():
        label = name if len(rates) == 1 else f"{name}, {rate:g} Mbit/s"
        ax.plot([r["wall"] for r in records], [quality(r) for r in records], marker="o",
                label=label)  # fmt: skip
    perplexity = any("perplexity" in records[0] for records in by_run.values() if records)
    shown = f"{target:g}" if perplexity else f"{target:.0%}"
    ax.axhline(target, color="grey", linestyle=":", label=f"target {shown}")
    ax.set_xscale("log")  # runs 15x apart in speed stay readable side by side
    ax.set_xlabel("wall seconds, log scale (training and worker 0's evaluation)")
    if perplexity:
        ax.set_ylabel("held-out perplexity")
        ax.set_yscale("log")
    else:
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.8, 1.0)
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS))
    parser.add_argument("--workers", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--rate", type=float, help="Mbit/s of every host's link")
    parser.add_argument(
        "--rates", type=float, nargs="+", help="train every run at each of these rates (Mbit/s)"
    )
    parser.add_argument("--model", choices=["mlp", "cnn"])
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="mnist",
        help="the MNIST example's model, or the language-model example's transformer",
    )
    parser.add_argument("--steps", type=int, default=300, help="the language model's steps")
    parser.add_argument(
        "--eval-every", type=int, default=25, help="the language model's steps between reports"
    )
    parser.add_argument(
        "--target",
        type=float,
        help="test accuracy to reach (MNIST, 0.97 by default) or held-out perplexity to get "
        "down to (the language model, 14 by default)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--no-stop", action="store_true",
                        help="train every epoch, not only until the target")  # fmt: skip
    parser.add_argument(
        "--floor",
        nargs="*",
        choices=sorted(RUNS),
        metavar="RUN",
        help="also train these runs on links that cost nothing (not shaped)",
    )
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    parser.add_argument("--table", type=Path, help="write a markdown table")
    parser.add_argument("--plot", type=Path, help="write a PNG of accuracy against wall time")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        help="train nothing: rebuild --table and --plot from earlier JSON lines (with --rates: "
        "only those rates' runs)",
    )
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.target is None:
        args.target = WORKLOADS[args.workload]["target"]
    if args.runs is None and args.workload == "charlm":
        args.runs = [name for name, run in RUNS.items() if run.get("workload") == "charlm"]
    for name in ("runs", "workers", "epochs", "rate", "model"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    if args.floor is None:
        args.floor = preset.get("floor", []) if args.workload == "mnist" else []
    wrong = [n for n in {*args.runs, *args.floor}
             if RUNS[n].get("workload", "mnist") != args.workload]  # fmt: skip
    if wrong:
        parser.error(f"not runs of the {args.workload} workload: {', '.join(sorted(wrong))}")
    rates = args.rates or [args.rate]
    by_run: Runs = {}
    floors: dict[str, list[dict[str, Any]]] = {}
    failures: dict[tuple[str, float], str] = {}  # a run that stopped early: what it said
    if args.source is not None:
        for line in args.source.read_text().splitlines():
            record = json.loads(line)
            reports = "epoch" in record or "step" in record
            rate = record.get("rate_mbit")
            if args.rates and rate and rate not in args.rates and "preset" not in record:
                continue  # --rates: only these rates' rows (and every floor)
            if reports and rate == 0:
                floors.setdefault(record["run"], []).append(record)
            elif reports:
                by_run.setdefault((record["run"], record["rate_mbit"]), []).append(record)
            elif "error" in record and record.get("rate_mbit"):
                failures[record["run"], record["rate_mbit"]] = record["error"]
            elif "preset" in record:  # the setting the plot's title names
                args.workers = record.get("workers", args.workers)
                rates = args.rates or record.get("rates_mbit", [record.get("rate_mbit", args.rate)])
                args.model = record.get("model", args.model)
    else:
        from benchmarks.netns import available

        why_not = available()
        if why_not is not None:
            emit({"bench": "time_to_accuracy", "skipped": why_not})
            return 0
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: namespaces go
        started = time.time()
        missing = {name: peer_missing(name) for name in sorted({*args.runs, *args.floor})}
        for name, why in missing.items():
            if why is not None:
                emit(skipped := {"bench": "time_to_accuracy", "run": name, "skipped": why})
                append_jsonl(args.out, skipped)
        if preset.get("peers") == "report":  # the smoke preset runs none: it says which could
            for name in (n for n in RUNS if "peer" in RUNS[n] and n not in args.runs):
                why = peer_missing(name) or "installed; the smoke preset runs no peer"
                emit({"bench": "time_to_accuracy", "run": name, "skipped": why})
        args.runs = [name for name in args.runs if missing[name] is None]
        args.floor = [name for name in args.floor if missing[name] is None]
        planned = [(name, rate) for rate in rates for name in args.runs]
        planned += [(name, 0.0) for name in args.floor]
        for name, rate in planned:
            try:
                records = run_one(args, name, rate)
            except Exception as exc:
                emit(failed := {"bench": "time_to_accuracy", "run": name, "rate_mbit": rate,
                                "error": str(exc)[-1500:]})  # fmt: skip
                append_jsonl(args.out, failed)
                if rate:
                    failures[name, rate] = failed["error"]
                continue
            if rate == 0:
                floors[name] = records
            else:
                by_run[name, rate] = records
            for record in records:
                emit(record)
                append_jsonl(args.out, record)
        setting = {"bench": "time_to_accuracy", "preset": args.preset, "machine": machine(),
                   "workload": args.workload, "model": args.model, "workers": args.workers,
                   "rate_mbit": rates[0],
                   "rates_mbit": rates,
                   "wall_seconds": round(time.time() - started, 1)}  # fmt: skip
        emit(setting)
        append_jsonl(args.out, setting)
    summary = summaries(by_run, args.target, floors)
    for line in summary:
        emit(line)
    if args.table is not None:
        write_table(args.table, summary, args.target, failures)
    if args.plot is not None and by_run:
        shown = ", ".join(f"{rate:g}" for rate in rates)
        what = "Language model" if args.workload == "charlm" else f"MNIST {args.model.upper()}"
        title = f"{what}, {args.workers} workers, {shown} Mbit/s links"
        plot(args.plot, by_run, args.target, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
