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
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from kvtest import ServerProcess, read_ready, run_ranks, start_servers, stop_processes

import kvstore

pytestmark = pytest.mark.integration

WORKERS = SERVERS = 3
HEARTBEAT = 5.0
"""KVSTORE_HEARTBEAT_TIMEOUT of servers and workers: a stopped server is lost after it (long
enough that a busy machine's peers are not taken for lost: a worker that took both replicas of
a shard for lost would end the job)."""
STEPS = 24
KEYS = ["a", "b", "c", "d", 7]
SIZES = [5000, 300, 1000, 70_000, 20]
"""Elements per key; with a bound of 10,000 elements, "d" is sliced over the three servers."""


def _gradients(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * rank + step)
    return [rng.normal(0, 0.05, n).astype(np.float32) for n in SIZES]


def _store(
    mode: str, addresses: list[str], rank: int, replicas: int, heartbeat: float = HEARTBEAT
) -> Any:
    """A worker's store in these jobs: keys of 10,000 elements or more sliced over the
    servers, chunks of at most 16 KiB."""
    return kvstore.create(
        mode,
        servers=addresses,
        rank=rank,
        num_workers=WORKERS,
        timeout=60,
        heartbeat_timeout=heartbeat,
        bigarray_bound=10_000,
        partition_bytes=16 * 1024,
        replicas=replicas,
    )


class Job:
    """Servers of one job, started with ``replicas``; ``run`` trains the workers on them."""

    def __init__(self, replicas: int, log: Any = subprocess.DEVNULL) -> None:
        env = {"KVSTORE_REPLICAS": str(replicas), "KVSTORE_HEARTBEAT_TIMEOUT": str(HEARTBEAT)}
        self.replicas = replicas
        self.servers = start_servers(SERVERS, WORKERS, env=env, stderr=log)
        self.addresses = [server.address for server in self.servers]
        self.heartbeats: dict[int, float] = {}
        """Worker rank -> its heartbeat timeout, where not HEARTBEAT."""

    def run(
        self,
        at_step: dict[int, Any] | None = None,
        inline: dict[int, Any] | None = None,
        save: tuple[int, Any] | None = None,
        resume: tuple[int, Any] | None = None,
    ) -> list[list[np.ndarray]]:
        """Every rank's pulled values after the last step; ``at_step``: step -> a callable
        that worker 0 starts on a thread of its own as it begins that step; ``inline``: one
        it calls itself (the job waits for it); ``save``: (step, path) the job saves a
        checkpoint at as it begins that step; ``resume``: (step, path) it loads and goes on
        from."""
        at_step, inline = at_step or {}, inline or {}
        self.stores: list[Any] = []

        def worker(rank: int) -> list[np.ndarray]:
            heartbeat = self.heartbeats.get(rank, HEARTBEAT)
            kv = _store("dist_sync", self.addresses, rank, self.replicas, heartbeat)
            self.stores.append(kv)
            with kv:
                kv.set_gradient_compression({"type": "2bit", "threshold": 0.05})
                kv.set_pull_compression({"type": "2bit", "threshold": 0.01})
                kv.set_optimizer("sgd", learning_rate=0.1, momentum=0.9)
                kv.init(KEYS, [np.linspace(-1, 1, n, dtype=np.float32) for n in SIZES])
                outs = [np.empty(n, np.float32) for n in SIZES]
                first = 0
                if resume is not None:
                    first = resume[0]
                    kv.load_checkpoint(resume[1])
                for step in range(first, STEPS):
                    if rank == 0 and step in at_step:
                        threading.Thread(target=at_step[step], daemon=True).start()
                    if rank == 0 and step in inline:
                        inline[step]()
                    if save is not None and step == save[0]:
                        kv.save_checkpoint(save[1])
                    kv.push(KEYS, _gradients(rank, step))
                    kv.pull(KEYS, out=outs)
                return [out.copy() for out in outs]

        return run_ranks(WORKERS, worker, timeout=180)

    def replace(self, rank: int) -> None:
        """Start a server in place of the lost server ``rank``: the same rank and port, and
        the job's addresses (by which it is caught up from the live replicas)."""
        port = self.addresses[rank].rsplit(":", 1)[1]
        env = {
            **os.environ,
            "KVSTORE_LOG_LEVEL": "ERROR",
            "KVSTORE_REPLICAS": str(self.replicas),
            "KVSTORE_HEARTBEAT_TIMEOUT": str(HEARTBEAT),
            "KVSTORE_SERVERS": ",".join(self.addresses),
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "kvstore.server", "--port", port, "--server-rank", str(rank),
             "--num-servers", str(SERVERS), "--num-workers", str(WORKERS), "--threads", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
        )  # fmt: skip
        self.servers[rank] = ServerProcess(process, self.addresses[rank], rank)
        assert read_ready(process, 60) == self.addresses[rank]

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


def test_workers_that_disagree_about_a_loss_all_go_on_with_the_replica(reference):
    """Workers that take a server for lost at different times: it is stopped for 4 s as a step
    begins. Worker 0 (heartbeat timeout 1.5 s) pushes only once it counted it lost, so its
    pushes go to the replica; worker 1 (1.5 s) pushed to the stopped server first and sends
    them again to the replica; worker 2 (60 s) keeps waiting on the stopped server, which gets
    workers 1's and 2's pushes of the round once it resumes, and the replica workers 0's and
    1's. The replica that took the shard over tells the stopped server so, which then refuses
    what worker 2 sent it: worker 2 goes on with the replica too, and no round is left split
    between the two (without the notice, both would wait for a third push)."""
    chance = random.Random(6)
    victim, step = chance.randrange(SERVERS), chance.randrange(2, STEPS - 4)
    job = Job(replicas=2)
    job.heartbeats = {0: 1.5, 1: 1.5, 2: 60.0}
    try:

        def stop_and_wait() -> None:  # worker 0 itself: it pushes once it counted it lost
            pid = job.servers[victim].process.pid
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(4.0, os.kill, (pid, signal.SIGCONT)).start()
            threading.Event().wait(2.5)

        values = job.run(inline={step: stop_and_wait})
        assert all(kv._shared.transport.is_lost(victim) for kv in job.stores)
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


def test_a_replaced_server_is_caught_up_and_the_job_survives_another_loss(reference):
    """Server 1 is killed; a replacement (same rank and port) is caught up from the live
    replicas and greeted by the workers; then server 2 is killed at a random moment: its
    shard and the one it had taken over go on with servers 0 and 1."""
    job = Job(replicas=2)
    old = job.servers[1].process
    try:

        def kill_server_1() -> None:
            job.servers[1].process.kill()
            job.servers[1].process.wait()

        def replace_server_1() -> None:
            job.replace(1)
            guard = time.monotonic() + 60
            while any(kv._shared.transport.is_lost(1) for kv in job.stores):
                assert time.monotonic() < guard, "the workers never took the replacement"
                time.sleep(0.05)

        def kill_server_2() -> None:
            threading.Event().wait(0.01)
            job.servers[2].process.kill()

        values = job.run({15: kill_server_2}, inline={5: kill_server_1, 10: replace_server_1})
        assert job.servers[2].process.poll() is not None
    finally:
        stop_processes([old])
        job.stop()
    _assert_identical(values, reference)


def test_a_server_killed_during_save_checkpoint_leaves_a_complete_checkpoint(reference, tmp_path):
    """A server is killed while the job saves a checkpoint: its replica writes its shard's
    part, the job goes on bit-identical, and a new job resumed from the checkpoint ends where
    the reference does."""
    chance = random.Random(5)
    victim, pause = chance.randrange(SERVERS), chance.random()
    path = tmp_path / "ckpt"
    job = Job(replicas=2)
    try:

        def kill_during_save() -> None:
            threading.Event().wait(0.005 * pause)
            job.servers[victim].process.kill()

        values = job.run({12: kill_during_save}, save=(12, path))
    finally:
        job.stop()
    _assert_identical(values, reference)
    resumed = Job(replicas=2)
    try:
        values = resumed.run(resume=(12, path))
    finally:
        resumed.stop()
    _assert_identical(values, reference)


def test_dist_async_loses_no_push_and_applies_none_twice():
    """dist_async with SGD (learning rate 1) and integer-valued pushes: the final value is the
    initial one minus the sum of every push of every worker, exactly, though a server was
    killed mid-job."""
    env = {"KVSTORE_REPLICAS": "2", "KVSTORE_HEARTBEAT_TIMEOUT": str(HEARTBEAT)}
    servers = start_servers(SERVERS, WORKERS, env=env)
    addresses = [server.address for server in servers]
    steps = 40
    initial = [np.zeros(n, np.float32) for n in SIZES]

    def pushes(rank: int, step: int) -> list[np.ndarray]:
        rng = np.random.default_rng(7000 * rank + step)
        return [rng.integers(-3, 4, n).astype(np.float32) for n in SIZES]

    try:

        def worker(rank: int) -> list[np.ndarray]:
            kv = _store("dist_async", addresses, rank, 2)
            with kv:
                kv.set_optimizer("sgd", learning_rate=1.0)
                kv.init(KEYS, initial)
                outs = [np.empty(n, np.float32) for n in SIZES]
                for step in range(steps):
                    if rank == 0 and step == 15:
                        servers[1].process.kill()
                    kv.push(KEYS, pushes(rank, step))
                    if step % 5 == 0:
                        kv.pull(KEYS, out=outs)
                kv.barrier()
                kv.pull(KEYS, out=outs)
                return [out.copy() for out in outs]

        values = run_ranks(WORKERS, worker, timeout=180)
    finally:
        stop_processes([server.process for server in servers], grace=5)
    expected = [
        init - sum(pushes(rank, step)[i] for rank in range(WORKERS) for step in range(steps))
        for i, init in enumerate(initial)
    ]
    for got in values:
        for key, a, b in zip(KEYS, got, expected, strict=True):
            assert np.array_equal(a, b), f"key {key!r}: {np.abs(a - b).max()} off"


def test_a_server_lost_while_inits_wait_for_rank_0_loses_nothing():
    """Workers 1 and 2 init first and wait for rank 0's value; a server is killed meanwhile,
    then rank 0 inits: every worker pulls rank 0's values, and a step of integer pushes under
    SGD (learning rate 1) lands exactly."""
    env = {"KVSTORE_REPLICAS": "2", "KVSTORE_HEARTBEAT_TIMEOUT": str(HEARTBEAT)}
    servers = start_servers(SERVERS, WORKERS, env=env)
    addresses = [server.address for server in servers]
    initial = [np.linspace(-1, 1, n, dtype=np.float32) for n in SIZES]
    others_waiting = threading.Barrier(WORKERS)

    def pushes(rank: int) -> list[np.ndarray]:
        return [np.full(n, rank + 1, np.float32) for n in SIZES]

    try:

        def worker(rank: int) -> list[list[np.ndarray]]:
            kv = _store("dist_sync", addresses, rank, 2)
            with kv:
                kv.set_optimizer("sgd", learning_rate=1.0)
                others_waiting.wait(30)
                if rank == 0:  # the others' inits are on their way: lose a server, then init
                    threading.Event().wait(0.5)
                    servers[1].process.kill()
                    servers[1].process.wait()
                    threading.Event().wait(0.2)
                kv.init(KEYS, initial if rank == 0 else [np.zeros_like(a) for a in initial])
                outs = [np.empty(n, np.float32) for n in SIZES]
                kv.pull(KEYS, out=outs)
                first = [out.copy() for out in outs]
                kv.push(KEYS, pushes(rank))
                kv.pull(KEYS, out=outs)
                return [first, [out.copy() for out in outs]]

        values = run_ranks(WORKERS, worker, timeout=120)
    finally:
        stop_processes([server.process for server in servers], grace=5)
    stepped = [a - sum(pushes(rank)[i] for rank in range(WORKERS)) for i, a in enumerate(initial)]
    for first, after in values:
        for key, got, want in zip(KEYS, first, initial, strict=True):
            assert np.array_equal(got, want), f"key {key!r} after init"
        for key, got, want in zip(KEYS, after, stepped, strict=True):
            assert np.array_equal(got, want), f"key {key!r} after a step"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def test_servers_started_as_kubernetes_pods_rejoin_after_a_restart(reference):
    """Servers started the way the StatefulSet's pods are: fixed ports, and the job's
    addresses and replicas in their environment from the first start (which then finds no job
    to catch up with and starts empty). One is killed mid-job and started again with the very
    same command, as the kubelet restarts a pod: it is caught up, and the job survives a
    second loss."""
    ports = _free_ports(SERVERS)
    addresses = [f"tcp://127.0.0.1:{port}" for port in ports]
    env = {
        **os.environ,
        "KVSTORE_LOG_LEVEL": "ERROR",
        "KVSTORE_REPLICAS": "2",
        "KVSTORE_HEARTBEAT_TIMEOUT": str(HEARTBEAT),
        "KVSTORE_SERVERS": ",".join(addresses),
    }

    def pod(rank: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "kvstore.server", "--host", "127.0.0.1",
             "--port", str(ports[rank]), "--server-rank", str(rank),
             "--num-servers", str(SERVERS), "--num-workers", str(WORKERS), "--threads", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
        )  # fmt: skip

    pods = [pod(rank) for rank in range(SERVERS)]
    job = Job.__new__(Job)  # (its servers are the pods)
    job.replicas, job.addresses, job.heartbeats = 2, addresses, {}
    job.servers = [
        ServerProcess(p, a, r) for r, (p, a) in enumerate(zip(pods, addresses, strict=True))
    ]
    every = list(pods)
    try:
        for process in pods:
            assert read_ready(process, 60) in addresses

        def restart_server_1() -> None:
            job.servers[1].process.kill()
            job.servers[1].process.wait()
            every.append(pod(1))
            job.servers[1] = ServerProcess(every[-1], addresses[1], 1)
            assert read_ready(every[-1], 60) == addresses[1]
            guard = time.monotonic() + 60
            while any(kv._shared.transport.is_lost(1) for kv in job.stores):
                assert time.monotonic() < guard, "the workers never took the restarted pod"
                time.sleep(0.05)

        def kill_server_2() -> None:
            job.servers[2].process.kill()

        values = job.run({16: kill_server_2}, inline={6: restart_server_1})
    finally:
        stop_processes(every)
    _assert_identical(values, reference)
