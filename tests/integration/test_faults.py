"""Dead and stalled peers: every blocking call raises naming the lost peer, never hangs; a lost
worker's rank can be taken back by a replacement; ``KVSTORE_TIMEOUT`` bounds whole calls; a
launcher killed with SIGKILL takes its servers with it.

Workers that get killed or stopped run in processes of their own (``remote_worker.py``, driven
line by line); the others run on threads of the test. Servers and workers use a small
``KVSTORE_HEARTBEAT_TIMEOUT``. The time bounds asserted are hang guards, many times the
expected values, never measurements.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtest import RawClient, connect, run_ranks_outcomes, start_servers, stop_processes

import kvstore
from kvstore import ServerLostError, WorkerLostError
from kvstore.wire import Op

pytestmark = pytest.mark.integration

HEARTBEAT = 1.5
"""KVSTORE_HEARTBEAT_TIMEOUT of these tests' servers and workers, seconds."""
GUARD = 30.0
"""Hang guard: a lost peer must be reported well within this (expected: about HEARTBEAT)."""
SERVER_ENV = {"KVSTORE_HEARTBEAT_TIMEOUT": str(HEARTBEAT)}
REMOTE = Path(__file__).with_name("remote_worker.py")
KEYS = [f"k{i}" for i in range(16)]
LENGTH = 8


class RemoteWorker:
    """A worker process of ``remote_worker.py``: one JSON command per line, one answer each."""

    def __init__(self, servers: list[str], rank: int, num_workers: int) -> None:
        env = {
            **os.environ,
            "KVSTORE_SERVERS": ",".join(servers),
            "KVSTORE_RANK": str(rank),
            "KVSTORE_NUM_WORKERS": str(num_workers),
            "KVSTORE_HEARTBEAT_TIMEOUT": str(HEARTBEAT),
            "KVSTORE_LOG_LEVEL": "CRITICAL",
        }
        self.process = subprocess.Popen(
            [sys.executable, str(REMOTE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert self.answer() == {"ok": "started"}

    def send(self, op: str, **fields: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()

    def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.process.stdout.readline()))
        reader.start()
        reader.join(timeout)
        assert lines and lines[0], f"no answer from the worker process within {timeout} s"
        return json.loads(lines[0])

    def call(self, op: str, **fields: Any) -> Any:
        self.send(op, **fields)
        answer = self.answer()
        assert "ok" in answer, answer
        return answer["ok"]

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # (by pid; SIGKILL also ends a stopped process)
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def processes():
    """Server processes and remote workers of one test, stopped by pid at teardown."""
    servers: list[Any] = []
    workers: list[RemoteWorker] = []

    class Processes:
        def servers(self, num_servers: int, num_workers: int) -> list[str]:
            started = start_servers(num_servers, num_workers, env=SERVER_ENV)
            servers.extend(started)
            return [s.address for s in started]

        def server_process(self, rank: int) -> subprocess.Popen:
            return servers[rank].process

        def worker(self, addresses: list[str], rank: int, num_workers: int) -> RemoteWorker:
            worker = RemoteWorker(addresses, rank, num_workers)
            workers.append(worker)
            return worker

    yield Processes()
    for worker in workers:
        worker.stop()
    for server in servers:
        if server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)  # (a stopped one must see SIGTERM)
    stop_processes([s.process for s in servers])


def values(rank: int, step: int) -> list[np.ndarray]:
    """Rank ``rank``'s push of step ``step``: small integers, so every sum is exact."""
    return [np.full(LENGTH, (rank + 1) * 10 + step + i, np.float32) for i in range(len(KEYS))]


def outs() -> list[np.ndarray]:
    return [np.zeros(LENGTH, np.float32) for _ in KEYS]


def lost(call: Any) -> tuple[WorkerLostError, float]:
    """Run ``call``; it must raise WorkerLostError. Returns it and how long the call took."""
    start = time.monotonic()
    with pytest.raises(WorkerLostError) as info:
        call()
    return info.value, time.monotonic() - start


def test_a_killed_worker_fails_every_blocking_call_of_the_others(processes):
    addresses = processes.servers(2, 3)
    victim = processes.worker(addresses, 2, 3)
    victim.call("create", mode="dist_sync")
    victim.send("init", keys=KEYS, values=[v.tolist() for v in values(2, 0)])  # (waits for 0)
    in_pull = threading.Barrier(3)

    def survivor(rank: int) -> None:
        with connect(addresses, rank, 3, heartbeat_timeout=HEARTBEAT, timeout=GUARD) as kv:
            kv.init(KEYS, values(rank, 0))
            kv.push(KEYS, values(rank, 1))
            in_pull.wait()
            # Rank 2 never pushes: the round of every key waits for it until it is lost.
            error, took = lost(lambda: kv.pull(KEYS, out=outs()))
            assert error.rank == 2 and "worker rank 2" in str(error), error
            assert took < GUARD
            # Later calls that need rank 2 fail at once.
            lost(kv.barrier)  # (the failed pushes first)
            error, took = lost(kv.barrier)
            assert error.rank == 2 and "barrier" in str(error)
            kv.push(KEYS, values(rank, 2))  # (returns: errors come with the next wait)
            error, _ = lost(lambda: kv.pull(KEYS, out=outs()))
            assert error.rank == 2
            error, _ = lost(lambda: kv.push(KEYS, values(rank, 3)))  # (waits for step 2's)
            assert error.rank == 2 and "an earlier push of key 'k0'" in str(error)
            error, _ = lost(kv.close)  # (the other keys' pushes of step 2)
            assert error.rank == 2

    thread_errors = []

    def run() -> None:
        thread_errors.extend(
            e for e in run_ranks_outcomes(2, survivor, timeout=120) if e is not None
        )

    survivors = threading.Thread(target=run)
    survivors.start()
    assert victim.answer() == {"ok": None}
    in_pull.wait(timeout=60)
    time.sleep(0.2)  # (into their pulls)
    victim.signal(signal.SIGKILL)
    survivors.join(120)
    assert not survivors.is_alive()
    assert not thread_errors, thread_errors


def test_init_and_set_optimizer_waiting_for_a_lost_rank_0_raise(processes):
    addresses = processes.servers(1, 2)
    victim = processes.worker(addresses, 0, 2)
    victim.call("create", mode="dist_sync")
    with connect(addresses, 1, 2, heartbeat_timeout=HEARTBEAT, timeout=GUARD) as kv:
        killer = threading.Timer(0.5, victim.signal, (signal.SIGKILL,))
        killer.start()
        error, took = lost(lambda: kv.init("w", np.zeros(4, np.float32)))  # waits for rank 0
        killer.join()
        assert error.rank == 0 and "init of key 'w'" in str(error), error
        assert took < GUARD
        error, _ = lost(lambda: kv.set_optimizer("sgd", learning_rate=0.1))
        assert error.rank == 0
        kv.close()  # nothing of this worker's is pending: a clean goodbye


def test_a_stalled_worker_is_lost_too_and_told_so_when_it_wakes(processes):
    addresses = processes.servers(1, 2)
    sleeper = processes.worker(addresses, 1, 2)
    sleeper.call("create", mode="dist_sync")
    with connect(addresses, 0, 2, heartbeat_timeout=HEARTBEAT, timeout=GUARD) as kv:
        sleeper.signal(signal.SIGSTOP)
        error, took = lost(kv.barrier)
        assert error.rank == 1 and took < GUARD
        sleeper.signal(signal.SIGCONT)
        # Its session was released: whatever it asks now is refused, naming itself.
        sleeper.send("barrier")
        answer = sleeper.answer()
        assert answer["error"] == "WorkerLostError" and answer["rank"] == 1, answer
        assert "declared lost" in answer["message"]


def test_a_dead_or_stalled_server_raises_server_lost(processes):
    addresses = processes.servers(3, 1)
    with connect(addresses, 0, 1, heartbeat_timeout=HEARTBEAT, timeout=GUARD) as kv:
        big = np.zeros(3_000_000, np.float32)  # split over all servers
        kv.init("big", big)
        processes.server_process(1).send_signal(signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(ServerLostError) as info:
            kv.pull("big", out=big)
        assert time.monotonic() - start < GUARD
        assert info.value.server == 1 and info.value.address == addresses[1]
        assert isinstance(info.value, kvstore.ConnectionLostError)
        assert f"server 1 ({addresses[1]}) sent nothing" in str(info.value)
        with pytest.raises(ServerLostError):  # at once, from now on
            kv.pull("big", out=big)
        processes.server_process(2).kill()
        processes.server_process(2).wait()
        with pytest.raises(ServerLostError) as info:
            kv.push("big", big)
            kv.pull("big", out=big)
        assert info.value.server in (1, 2)
        start = time.monotonic()
        kv.close()  # (its goodbyes to the lost servers fail, and are not waited for)
        assert time.monotonic() - start < GUARD


def test_a_replacement_takes_the_lost_rank_back_and_training_continues(processes):
    addresses = processes.servers(2, 2)
    first = processes.worker(addresses, 0, 2)
    first.call("create", mode="dist_sync")
    init0 = [np.full(LENGTH, 100 + i, np.float32) for i in range(len(KEYS))]

    def sums(step: int, *ranks: int) -> list[list[float]]:
        return [sum(values(r, step)[i] for r in ranks).tolist() for i in range(len(KEYS))]

    with connect(addresses, 1, 2, heartbeat_timeout=HEARTBEAT, timeout=GUARD) as kv:
        inits = threading.Thread(target=lambda: kv.init(KEYS, values(1, 0)))
        inits.start()
        first.call("init", keys=KEYS, values=[v.tolist() for v in init0])
        inits.join(60)
        # Step 1, both ranks; then rank 0 dies before its push of step 2.
        first.send("push", keys=KEYS, values=[v.tolist() for v in values(0, 1)])
        kv.push(KEYS, values(1, 1))
        got = outs()
        kv.pull(KEYS, out=got)
        assert [g.tolist() for g in got] == sums(1, 0, 1)
        assert first.answer() == {"ok": None}
        assert first.call("pull", keys=KEYS, length=LENGTH) == sums(1, 0, 1)
        kv.push(KEYS, values(1, 2))
        first.signal(signal.SIGKILL)
        lost(lambda: kv.pull(KEYS, out=outs()))

        # A new process takes rank 0 back and runs its script from the top: create, init
        # (rank 0's value must not overwrite the live one), pull the current values.
        second = processes.worker(addresses, 0, 2)
        second.call("create", mode="dist_sync", retry_duplicate=GUARD)
        replacement_init = [np.full(LENGTH, -7, np.float32).tolist() for _ in KEYS]
        second.call("init", keys=KEYS, values=replacement_init)
        assert second.call("pull", keys=KEYS, length=LENGTH) == sums(1, 0, 1)
        # Its first push completes the round that waited with rank 1's push of step 2.
        second.send("push", keys=KEYS, values=[v.tolist() for v in values(0, 2)])
        deadline = time.monotonic() + GUARD
        while True:  # rank 1 retries its pull until the round can complete
            try:
                kv.pull(KEYS, out=got)
                break
            except WorkerLostError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert [g.tolist() for g in got] == sums(2, 0, 1)
        assert second.answer() == {"ok": None}
        assert second.call("pull", keys=KEYS, length=LENGTH) == sums(2, 0, 1)
        # And on: exact sums, a barrier, a clean goodbye.
        second.send("push", keys=KEYS, values=[v.tolist() for v in values(0, 3)])
        kv.push(KEYS, values(1, 3))
        kv.pull(KEYS, out=got)
        assert [g.tolist() for g in got] == sums(3, 0, 1)
        assert second.answer() == {"ok": None}
        assert second.call("pull", keys=KEYS, length=LENGTH) == sums(3, 0, 1)
        second.send("barrier")
        kv.barrier()
        assert second.answer() == {"ok": None}
        assert second.call("close") is None


def test_a_live_rank_is_still_refused_to_a_second_worker(processes):
    addresses = processes.servers(1, 2)
    with connect(addresses, 0, 2, heartbeat_timeout=HEARTBEAT):
        time.sleep(3 * HEARTBEAT)  # pings keep the rank
        with pytest.raises(kvstore.ConfigError, match="rank 0 is already connected"):
            connect(addresses, 0, 2, heartbeat_timeout=HEARTBEAT)


def test_kvstore_timeout_bounds_a_whole_call(processes):
    addresses = processes.servers(1, 2)
    idle = processes.worker(addresses, 1, 2)
    idle.call("create", mode="dist_sync")
    idle.send("init", keys=KEYS, values=[v.tolist() for v in values(1, 0)])  # (waits for 0)
    with connect(addresses, 0, 2, heartbeat_timeout=HEARTBEAT, timeout=1.0) as kv:
        kv.init(KEYS, values(0, 0))
        assert idle.answer() == {"ok": None}
        kv.push(KEYS, values(0, 1))
        idle.signal(signal.SIGSTOP)  # (a stalled peer; heartbeats would name it after 1.5 s)
        start = time.monotonic()
        with pytest.raises(kvstore.KVStoreError) as info:
            kv.pull(KEYS, out=outs())  # 16 keys, one timeout for all of them
        took = time.monotonic() - start
        assert isinstance(info.value, kvstore.KVStoreTimeoutError | WorkerLostError)
        assert took < 8, f"a pull of 16 keys with KVSTORE_TIMEOUT=1 took {took:.1f} s"
        start = time.monotonic()
        with pytest.raises(kvstore.KVStoreError):
            kv.close()
        assert time.monotonic() - start < 8
    idle.signal(signal.SIGCONT)


def test_kvstore_timeout_without_heartbeats_names_the_whole_call(processes):
    addresses = processes.servers(1, 2)
    idle = processes.worker(addresses, 1, 2)
    idle.call("create", mode="dist_sync")
    idle.send("init", keys=KEYS, values=[v.tolist() for v in values(1, 0)])  # (waits for 0)
    # (this worker's own heartbeats are off; it still pings the servers as often as their
    # KVSTORE_HEARTBEAT_TIMEOUT needs, so that they do not take it for lost)
    with connect(addresses, 0, 2, heartbeat_timeout=0, timeout=1.0) as kv:
        kv.init(KEYS, values(0, 0))
        assert idle.answer() == {"ok": None}
        kv.push(KEYS, values(0, 1))  # rank 1 never pushes, and is alive
        start = time.monotonic()
        with pytest.raises(kvstore.KVStoreTimeoutError, match="for the whole call"):
            kv.pull(KEYS, out=outs())
        assert time.monotonic() - start < 8
        start = time.monotonic()
        with pytest.raises(kvstore.KVStoreTimeoutError):
            kv.close()
        assert time.monotonic() - start < 8


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_servers_stop_when_their_launcher_is_killed():
    code = "import kvstore, time; kv = kvstore.create('dist_sync'); print('ready', flush=True); "
    code += "time.sleep(300)"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kvstore.deploy", "-n", "1", "-s", "2", "--", sys.executable,
         "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    children: list[int] = []
    try:
        assert launcher.stdout is not None
        line = ""
        deadline = time.monotonic() + 60
        while "ready" not in line and time.monotonic() < deadline:
            line = launcher.stdout.readline()
        assert "[worker 0] ready" in line
        children = _children(launcher.pid)
        servers = [
            pid
            for pid in children
            if b"kvstore.server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(servers) == 2, children
        launcher.kill()  # SIGKILL: no chance to stop anything
        launcher.wait()
        deadline = time.monotonic() + GUARD
        while any(_alive(pid) for pid in servers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in servers), "the servers outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in children:  # the orphaned worker (and any server left) by pid
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.stdout is not None:
            launcher.stdout.close()


def test_a_replacement_rejoins_a_dist_async_job_with_its_optimizer(processes):
    addresses = processes.servers(1, 2)
    sgd = {"learning_rate": 0.5}
    first = processes.worker(addresses, 1, 2)
    first.call("create", mode="dist_async")
    with connect(addresses, 0, 2, mode="dist_async", heartbeat_timeout=HEARTBEAT) as kv:
        first.send("set_optimizer", name="sgd", params=sgd)
        kv.set_optimizer("sgd", **sgd)
        assert first.answer() == {"ok": None}
        first.send("init", keys=["w"], values=[[0.0] * LENGTH])
        kv.init("w", np.full(LENGTH, 8, np.float32))
        assert first.answer() == {"ok": None}
        first.call("push", keys=["w"], values=[[2.0] * LENGTH])  # w = 8 - 0.5 * 2 = 7
        assert first.call("pull", keys=["w"], length=LENGTH) == [[7.0] * LENGTH]
        first.signal(signal.SIGKILL)
        lost(kv.barrier)
        # The replacement runs the same script: its set_optimizer, equal to the job's, waits
        # for nobody; its init is accepted; its pull and pushes work on the live weights.
        second = processes.worker(addresses, 1, 2)
        second.call("create", mode="dist_async", retry_duplicate=GUARD)
        assert second.call("set_optimizer", name="sgd", params=sgd) is None
        assert second.call("init", keys=["w"], values=[[0.0] * LENGTH]) is None
        assert second.call("pull", keys=["w"], length=LENGTH) == [[7.0] * LENGTH]
        second.call("push", keys=["w"], values=[[4.0] * LENGTH])  # 7 - 0.5 * 4 = 5
        # Its pull waits until its push was applied (a push returns once encoded).
        assert second.call("pull", keys=["w"], length=LENGTH) == [[5.0] * LENGTH]
        out = np.zeros(LENGTH, np.float32)
        kv.push("w", np.full(LENGTH, 2, np.float32))  # 5 - 0.5 * 2 = 4
        kv.pull("w", out=out)
        assert out.tolist() == [4.0] * LENGTH
        # The collectives pair with the others' again.
        second.send("set_optimizer", name="sgd", params={"learning_rate": 0.25})
        kv.set_optimizer("sgd", learning_rate=0.25)
        assert second.answer() == {"ok": None}
        second.send("barrier")
        kv.barrier()
        assert second.answer() == {"ok": None}
        assert second.call("close") is None


def test_a_refused_handshake_leaves_no_session_behind(processes):
    addresses = processes.servers(2, 2)
    holder = RawClient(addresses[1])  # holds rank 0 on server 1 only
    try:
        assert holder.hello(rank=0, num_workers=2, ns=2, si=1).op is Op.REPLY
        with pytest.raises(kvstore.ConfigError, match="rank 0 is already connected"):
            connect(addresses, 0, 2)  # server 0 took it, server 1 refused it
        assert holder.request("BYE").op is Op.REPLY
        # Server 0 got a goodbye from the refused worker: rank 0 is free everywhere at once.
        connect(addresses, 0, 2).close()
    finally:
        holder.close()
