"""Push+pull on loopback: kvstore (dense and 2-bit) against bare pyzmq, in the same run.

Layout: 1 server process and W worker processes on 127.0.0.1; one key of ``--elements`` fp32
values; each step every worker pushes the key and pulls it back (``dist_sync``, no optimizer).

* ``bare pyzmq``: the same processes move the same bytes with nothing else: each worker sends
  its value (``copy=False``) to a ROUTER; once all W arrived, the server sends a preallocated
  value of the same size back to each; workers receive with ``copy=False``.
* ``bare pyzmq pipelined``: the same, cut into messages of ``KVSTORE_PARTITION_BYTES`` (4 MiB),
  all sent back to back, each replied to as soon as all workers' copies of it arrived: what bare
  pyzmq does at its best. Both bare variants get the same malloc tuning as kvstore
  (:mod:`kvstore._malloc`), and kvstore is compared with the faster of the two.
* ``kvstore none``: ``kv.push`` + ``kv.pull`` uncompressed.
* ``kvstore 2bit``: the same with 2-bit compressed pushes; without an optimizer the pull of the
  round's sum is relayed (the W pushes, summed by the worker: bit-identical, W/16 of the bytes).
* ``kvstore 2bit dense pull``: 2-bit pushes with ``pull_relay=False``: dense fp32 pulls, the
  traffic of a job with an optimizer on the server.
* ``kvstore none pushpull``: ``kv.pushpull`` uncompressed, one round trip per chunk instead of
  a push and a pull request.
* ``kvstore none borrow``: ``kv.push(..., borrow=True)`` + ``kv.pull`` uncompressed: the
  gradient is sent from its own memory instead of copied first.
* ``kvstore none curve``, ``kvstore 2bit curve``: ``kvstore none`` and ``kvstore 2bit`` with the
  job's CURVE keys (:mod:`kvstore.auth`), as every ``kvstore-launch`` job runs: every message
  encrypted and authenticated. Every other configuration runs without keys.
* ``kvstore none without gate``, ``kvstore none curve without gate``: the same with
  ``KVSTORE_ADMISSION_GATE=0``: the server's ZeroMQ socket listens itself instead of behind its
  admission gate (:mod:`kvstore.server.gate`), which relays every byte once more.

Configurations run in alternation for ``--rounds`` rounds (so machine noise hits all of them
alike); each reports the median seconds per step over all rounds' steps. Ratios: kvstore dense
over bare pyzmq, each 2-bit configuration over dense, pushpull and borrowed pushes over push +
pull, each CURVE configuration over the same one without keys, with the gate over without it. One
JSON line per configuration,
then a summary line.

``--speedups`` measures the optional speed-ups of this path instead: "kvstore none" and
"kvstore 2bit" with each one turned off by its variable (:data:`SPEEDUP_SWITCHES`), in
alternation with both configurations as they are; the summary gives each off/on ratio.

    python -m benchmarks.bench_pushpull --preset smoke
    python -m benchmarks.bench_pushpull --preset full
    python -m benchmarks.bench_pushpull --preset full --speedups
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, NamedTuple

from benchmarks.common import REPO, emit, machine, module_command, start_server, stop_processes
from kvstore._malloc import tune_malloc
from kvstore.auth import JobKeys, role_env
from kvstore.config import DEFAULT_PARTITION_BYTES

PRESETS = {
    "smoke": {"elements": 1_000_000, "workers": 2, "steps": 5, "rounds": 1},
    "full": {"elements": 10_000_000, "workers": 2, "steps": 15, "rounds": 5},
}


# child roles ---------------------------------------------------------------------------------


def _parts(elements: int) -> list[tuple[int, int]]:
    size = DEFAULT_PARTITION_BYTES // 4
    return [(lo, min(elements, lo + size)) for lo in range(0, elements, size)]


def _bare_socket(kind: int) -> tuple[Any, Any]:
    """(context, socket) as both bare roles use them: unbounded queues, kvstore's malloc tuning."""
    import zmq

    tune_malloc()
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return ctx, sock


def bare_server(workers: int, elements: int, steps: int, pipelined: bool) -> None:
    import numpy as np
    import zmq

    ctx, sock = _bare_socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"KVSTORE_READY tcp://127.0.0.1:{port}", flush=True)
    reply = np.ones(elements, np.float32)
    parts = [reply[lo:hi] for lo, hi in _parts(elements)] if pipelined else [reply]
    for _ in range(steps + 1):  # one warm-up step
        arrived: dict[int, list[bytes]] = {}
        for _ in range(workers * len(parts)):
            frames = sock.recv_multipart(copy=False)
            index = int.from_bytes(frames[1].bytes[:4], "little") if pipelined else 0
            arrived.setdefault(index, []).append(frames[0].bytes)
            if len(arrived[index]) == workers:  # this part's "round" is complete
                for identity in arrived[index]:
                    sock.send_multipart([identity, parts[index]], copy=False)
    sock.close(linger=30_000)  # let the last replies leave before exiting
    ctx.term()


def bare_worker(address: str, elements: int, steps: int, pipelined: bool) -> None:
    import numpy as np
    import zmq

    ctx, sock = _bare_socket(zmq.DEALER)
    sock.connect(address)
    value = np.ones(elements, np.float32)
    bounds = _parts(elements) if pipelined else [(0, elements)]
    for lo, hi in bounds:  # the first 4 bytes of each part name it (a stand-in for a header)
        value[lo : lo + 1].view(np.uint32)[0] = bounds.index((lo, hi))
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        for lo, hi in bounds:
            sock.send(value[lo:hi], copy=False)
        for lo, hi in bounds:  # only received: no copy into an output array (strict baseline)
            frame = sock.recv(copy=False)
            assert len(frame) == 4 * (hi - lo)
        if step:
            times.append(time.perf_counter() - start)
    print(json.dumps({"times": times}), flush=True)
    sock.close(0)
    ctx.term()


class KvConfig(NamedTuple):
    """How a kvstore configuration's workers run their steps."""

    codec: str
    relay: bool = True  # pull_relay
    pushpull: bool = False  # kv.pushpull instead of push + pull
    borrow: bool = False  # push(..., borrow=True)
    curve: bool = False  # with the job's CURVE keys (authenticated, encrypted)
    env: tuple[tuple[str, str], ...] = ()  # variables of the server and the workers


KV_CONFIGS = {
    "kvstore none": KvConfig("none"),
    "kvstore 2bit": KvConfig("2bit"),
    "kvstore 2bit dense pull": KvConfig("2bit", relay=False),
    "kvstore none pushpull": KvConfig("none", pushpull=True),
    "kvstore none borrow": KvConfig("none", borrow=True),
    "kvstore none curve": KvConfig("none", curve=True),
    "kvstore 2bit curve": KvConfig("2bit", curve=True),
    "kvstore none without gate": KvConfig("none", env=(("KVSTORE_ADMISSION_GATE", "0"),)),
    "kvstore none curve without gate": KvConfig(
        "none", curve=True, env=(("KVSTORE_ADMISSION_GATE", "0"),)
    ),
}
"""Configuration name -> how its workers run."""

SPEEDUP_SWITCHES = {
    "inline work": "KVSTORE_INLINE_WORK",
    "acks on pulls": "KVSTORE_ACKS_ON_PULLS",
    "native sends": "KVSTORE_NATIVE_SENDS",
    "value prefetch": "KVSTORE_VALUE_PREFETCH",
    "malloc tuning": "KVSTORE_MALLOC_TUNING",
}
"""``--speedups``: each speed-up of the loopback path, by the variable that turns it off
(docs/internals.md). Relayed pulls are "kvstore 2bit dense pull" above; the push lead and
TOS marking act on shaped links with more workers (bench_cluster)."""

SPEEDUP_CONFIGS = {
    f"kvstore {codec} without {name}": KvConfig(codec, env=((variable, "0"),))
    for name, variable in SPEEDUP_SWITCHES.items()
    for codec in ("none", "2bit")
}


def kv_worker(
    address: str,
    rank: int,
    workers: int,
    elements: int,
    steps: int,
    codec: str,
    relay: bool,
    pushpull: bool = False,
    borrow: bool = False,
) -> None:
    import numpy as np

    import kvstore

    kv = kvstore.create(
        "dist_sync", servers=[address], rank=rank, num_workers=workers, pull_relay=relay
    )
    if codec != "none":
        kv.set_gradient_compression({"type": codec, "threshold": 0.5})
    grad = np.random.default_rng(rank).standard_normal(elements).astype(np.float32)
    out = np.empty(elements, np.float32)
    kv.init("w", out)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        if pushpull:
            kv.pushpull("w", grad, out=out)
        else:
            kv.push("w", grad, borrow=borrow)
            kv.pull("w", out=out)
        if step:
            times.append(time.perf_counter() - start)
    kv.barrier()
    kv.close()
    print(json.dumps({"times": times}), flush=True)


# orchestration -------------------------------------------------------------------------------


def run_config(name: str, workers: int, elements: int, steps: int) -> list[float]:
    """Start a server and the workers of one configuration; return all workers' step times."""
    py = sys.executable
    bare = name.startswith("bare")
    config = None if bare else {**KV_CONFIGS, **SPEEDUP_CONFIGS}[name]
    keys = JobKeys.generate() if config is not None and config.curve else None
    switches = dict(config.env) if config is not None else {}
    # (every credential variable set or blanked: none is inherited from this shell)
    server_env = {**os.environ, **role_env("server", keys), **switches}
    worker_env = {**os.environ, **role_env("worker", keys), **switches}
    if bare:
        server_cmd = module_command("bench_pushpull", "--role", "bare-server")
        server_cmd += ["--workers", str(workers)]
        server_cmd += ["--elements", str(elements), "--steps", str(steps)]
        server_cmd += ["--pipelined"] if name.endswith("pipelined") else []
    else:
        server_cmd = [py, "-m", "kvstore.server", "--num-workers", str(workers), "--threads", "2"]
    server, address = start_server(server_cmd, server_env)
    children: list[subprocess.Popen] = []
    try:
        for rank in range(workers):
            command = module_command("bench_pushpull", "--address", address)
            command += ["--elements", str(elements)]
            command += ["--steps", str(steps), "--workers", str(workers), "--rank", str(rank)]
            if bare:
                command += ["--role", "bare-worker"]
                command += ["--pipelined"] if name.endswith("pipelined") else []
            else:
                assert config is not None
                command += ["--role", "kv-worker", "--codec", config.codec]
                command += [] if config.relay else ["--no-relay"]
                command += ["--pushpull"] if config.pushpull else []
                command += ["--borrow"] if config.borrow else []
            children.append(
                subprocess.Popen(
                    command, stdout=subprocess.PIPE, text=True, env=worker_env, cwd=REPO
                )
            )
        times: list[float] = []
        for child in children:
            out, _ = child.communicate(timeout=600)
            if child.returncode != 0:
                raise RuntimeError(f"{name} worker failed with {child.returncode}")
            times += json.loads(out.strip().splitlines()[-1])["times"]
        return times
    finally:
        stop_processes(children)
        if server.poll() is None:
            server.terminate()
        server.wait(30)


def report_speedups(
    medians: dict[str, float], samples: dict[str, list[float]], workers: int, elements: int
) -> None:
    """One line per configuration, then the seconds per step of each codec with each speed-up
    off over the same codec with all on (above 1: the speed-up saves that much)."""
    for config, median in medians.items():
        emit(
            {
                "bench": "pushpull",
                "config": config,
                "workers": workers,
                "elements": elements,
                "seconds_per_step": round(median, 5),
                "steps_measured": len(samples[config]),
            }
        )
    ratios = {
        f"{codec} without {name}": round(
            medians[f"kvstore {codec} without {name}"] / medians[f"kvstore {codec}"], 3
        )
        for name in SPEEDUP_SWITCHES
        for codec in ("none", "2bit")
    }
    emit({"bench": "pushpull", "summary": True, "off_over_on": ratios, "machine": machine()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--elements", type=int)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument(
        "--speedups",
        action="store_true",
        help="measure each speed-up instead: dense and 2-bit with it turned off, against both "
        "with every speed-up on (in alternation, like the default configurations)",
    )
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--codec", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--pipelined", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-relay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pushpull", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--borrow", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    elements = args.elements or preset["elements"]
    workers = args.workers or preset["workers"]
    steps = args.steps or preset["steps"]
    if args.role == "bare-server":
        bare_server(workers, elements, steps, args.pipelined)
        return 0
    if args.role == "bare-worker":
        bare_worker(args.address, elements, steps, args.pipelined)
        return 0
    if args.role == "kv-worker":
        kv_worker(
            args.address,
            args.rank,
            workers,
            elements,
            steps,
            args.codec,
            not args.no_relay,
            args.pushpull,
            args.borrow,
        )
        return 0

    if args.speedups:
        configs = ["kvstore none", "kvstore 2bit", *SPEEDUP_CONFIGS]
    else:
        configs = ["bare pyzmq", "bare pyzmq pipelined", *KV_CONFIGS]
    samples: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(args.rounds or preset["rounds"]):
        for config in configs:
            samples[config] += run_config(config, workers, elements, steps)
    medians = {c: statistics.median(v) for c, v in samples.items()}
    if args.speedups:
        report_speedups(medians, samples, workers, elements)
        return 0
    bare_best = min(medians["bare pyzmq"], medians["bare pyzmq pipelined"])
    nbytes = 4 * elements
    for config in configs:
        codec, relay, *_ = KV_CONFIGS.get(config, KvConfig("none", relay=False))
        push_bytes = nbytes // 16 if codec == "2bit" else nbytes
        pull_bytes = workers * nbytes // 16 if codec == "2bit" and relay else nbytes
        emit(
            {
                "bench": "pushpull",
                "config": config,
                "workers": workers,
                "servers": 1,
                "elements": elements,
                "bytes_per_worker_step": push_bytes + pull_bytes,
                "seconds_per_step": round(medians[config], 5),
                "steps_measured": len(samples[config]),
            }
        )
    emit(
        {
            "bench": "pushpull",
            "summary": True,
            "dense_over_bare_pyzmq": round(medians["kvstore none"] / bare_best, 3),
            "twobit_over_dense": round(medians["kvstore 2bit"] / medians["kvstore none"], 3),
            "twobit_dense_pull_over_dense": round(
                medians["kvstore 2bit dense pull"] / medians["kvstore none"], 3
            ),
            "pushpull_over_push_and_pull": round(
                medians["kvstore none pushpull"] / medians["kvstore none"], 3
            ),
            "borrow_over_push_and_pull": round(
                medians["kvstore none borrow"] / medians["kvstore none"], 3
            ),
            "curve_over_plain_dense": round(
                medians["kvstore none curve"] / medians["kvstore none"], 3
            ),
            "curve_over_plain_2bit": round(
                medians["kvstore 2bit curve"] / medians["kvstore 2bit"], 3
            ),
            "gate_over_no_gate_dense": round(
                medians["kvstore none"] / medians["kvstore none without gate"], 3
            ),
            "gate_over_no_gate_curve": round(
                medians["kvstore none curve"] / medians["kvstore none curve without gate"], 3
            ),
            "machine": machine(),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
