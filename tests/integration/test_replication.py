"""Server replication (``KVSTORE_REPLICAS``): a job that loses a server goes on with the
shard's next replica, and ends with every key bit-identical to a job that lost none.

The job: 3 workers (threads of the test) and 3 server processes, R = 2, keys split over the
servers (small keys whole on one server, a large one sliced over all three), 2-bit pushes,
server SGD with momentum, 2-bit pulls. A server is killed (SIGKILL) or stopped (SIGSTOP) at a
random moment of a random step; the reference is the same job without replication and without
a loss. Times asserted are hang guards, never measurements.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
from typing import Any

import numpy as np
import pytest
from kvtest import run_ranks, start_servers, stop_processes

import kvstore

pytestmark = pytest.mark.integration

WORKERS = SERVERS = 3
HEARTBEAT = 2.0
"""KVSTORE_HEARTBEAT_TIMEOUT of servers and workers: a stopped server is lost after it."""
STEPS = 24
KEYS = ["a", "b", "c", "d", 7]
SIZES = [5000, 300, 1000, 70_000, 20]
"""Elements per key; with a bound of 10,000 elements, "d" is sliced over the three servers."""


def _gradients(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * rank + step)
    return [rng.normal(0, 0.05, n).astype(np.float32) for n in SIZES]


class Job:
    """Servers of one job, started with ``replicas``; ``run`` trains the workers on them."""

    def __init__(self, replicas: int, log: Any = subprocess.DEVNULL) -> None:
        env = {"KVSTORE_REPLICAS": str(replicas), "KVSTORE_HEARTBEAT_TIMEOUT": str(HEARTBEAT)}
        self.replicas = replicas
        self.servers = start_servers(SERVERS, WORKERS, env=env, stderr=log)
        self.addresses = [server.address for server in self.servers]

    def run(self, at_step: dict[int, Any] | None = None) -> list[list[np.ndarray]]:
        """Every rank's pulled values after the last step; ``at_step``: step -> a callable
        that worker 0 starts on a thread of its own as it begins that step."""
        at_step = at_step or {}

        def worker(rank: int) -> list[np.ndarray]:
            kv = kvstore.create(
                "dist_sync",
                servers=self.addresses,
                rank=rank,
                num_workers=WORKERS,
                timeout=60,
                heartbeat_timeout=HEARTBEAT,
                bigarray_bound=10_000,
                partition_bytes=16 * 1024,
                replicas=self.replicas,
            )
            with kv:
                kv.set_gradient_compression({"type": "2bit", "threshold": 0.05})
                kv.set_pull_compression({"type": "2bit", "threshold": 0.01})
                kv.set_optimizer("sgd", learning_rate=0.1, momentum=0.9)
                kv.init(KEYS, [np.linspace(-1, 1, n, dtype=np.float32) for n in SIZES])
                outs = [np.empty(n, np.float32) for n in SIZES]
                for step in range(STEPS):
                    if rank == 0 and step in at_step:
                        threading.Thread(target=at_step[step], daemon=True).start()
                    kv.push(KEYS, _gradients(rank, step))
                    kv.pull(KEYS, out=outs)
                return [out.copy() for out in outs]

        return run_ranks(WORKERS, worker, timeout=180)

    def stop(self) -> None:
        for server in self.servers:  # (a stopped server cannot take SIGTERM)
            if server.process.poll() is None:
                os.kill(server.process.pid, signal.SIGCONT)
        stop_processes([server.process for server in self.servers], grace=5)


@pytest.fixture(scope="module")
def reference() -> list[list[np.ndarray]]:
    """The values of a job without replication that lost no server."""
    job = Job(replicas=1)
    try:
        return job.run()
    finally:
        job.stop()


def _assert_identical(values: list[list[np.ndarray]], reference: list[list[np.ndarray]]) -> None:
    for rank, (got, want) in enumerate(zip(values, reference, strict=True)):
        for key, a, b in zip(KEYS, got, want, strict=True):
            assert np.array_equal(a, b), f"rank {rank} key {key!r}: max diff {np.abs(a - b).max()}"


@pytest.mark.parametrize(
    "how, seed",
    [("SIGKILL", 1), ("SIGKILL", 2), ("SIGKILL", 3), ("SIGSTOP", 4)],
)
def test_a_job_that_loses_a_server_ends_bit_identical(reference, how, seed):
    chance = random.Random(seed)
    victim, step, pause = chance.randrange(SERVERS), chance.randrange(2, STEPS - 4), chance.random()
    job = Job(replicas=2)
    try:

        def lose() -> None:  # at a random moment of the step
            threading.Event().wait(0.02 * pause)
            os.kill(job.servers[victim].process.pid, getattr(signal, how))

        values = job.run({step: lose})
        assert job.servers[victim].process.poll() is not None or how == "SIGSTOP"
    finally:
        job.stop()
    _assert_identical(values, reference)


def test_replication_alone_changes_no_value(reference):
    job = Job(replicas=2)
    try:
        values = job.run()
    finally:
        job.stop()
    _assert_identical(values, reference)
