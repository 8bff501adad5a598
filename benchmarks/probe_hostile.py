"""Hostile input against real servers on the loopback: what strangers, malformed messages, stalled
handshakes, many-frame messages and log forgers can do to a server, and whether a job still gets
exact sums meanwhile.

Every scenario starts its own ``kvstore-server`` processes on 127.0.0.1 (port 0), logging at
WARNING into a file, and stops them by pid; a legitimate job's workers are processes of this
module (``--role worker``) that push known values and check every pulled element against the
exact sum. Each scenario prints one JSON line with its figures; none is judged here:

* ``strangers``: a server with the job's CURVE keys; for a while, three kinds of strangers
  (no keys, another job's keys, a random client key with the right server key) each send
  HELLO and PUSH messages over fresh connections. Messages sent per kind, replies received
  (0 expected), the server's refusal warnings, then a 2-worker job with the keys.
* ``malformed``: malformed messages (random bytes, truncated msgpack, fields of wrong types,
  a few frames too many or too few) from raw DEALER sockets to a server without keys. Error
  replies, other replies, replies that :func:`kvstore.wire.decode` refuses, messages without a
  reply, the server's peak memory (``VmHWM``) over its memory before, connections it closed.
* ``half_handshakes``: raw TCP connections that send the start of a ZMTP greeting and stall,
  while a 2-worker job runs. When the server closed them (seconds after connect; those closed
  within a second count as refused at once), how many were still open when the probe stopped
  waiting, whether a fresh connection got an answer during the flood, and the job's sums.
* ``many_workers``: W workers and S servers, each worker pushing and pulling until a shared
  deadline and checking every pulled value; values checked, mismatches, server memory at start
  and end.
* ``many_frames``: senders of messages of many frames of the default frame limit (one shared
  buffer sent without copies) against a server without keys and default settings, while a
  2-worker job runs. Bytes offered, the server's memory before, its peak and after, the bound
  :func:`kvstore.server.gate_limits.memory_bound` gives for its settings, connections it closed.
* ``log_flood``: many bad messages, and one from a routing id holding a line break, a fake log
  line and terminal escapes. The log's bytes and lines, lines with control characters (none
  expected), whether a forged line appears.

Every record also says whether each server was alive at the end and how many lines of its log
are errors or tracebacks. Run it from the repository's root:

    python -m benchmarks.probe_hostile --preset smoke     # under a minute
    python -m benchmarks.probe_hostile --preset full      # the issue's sizes: several minutes
    python -m benchmarks.probe_hostile --preset full --scenario many_frames
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from benchmarks.common import REPO, emit, machine, module_command
from kvstore import wire
from kvstore.auth import JobKeys, role_env
from kvstore.envvars import DEFAULT_MAX_CONNECTIONS, DEFAULT_RECEIVE_BUFFER_BYTES
from kvstore.server.gate_limits import GateLimits, memory_bound
from kvstore.topology import max_payload_bytes
from kvstore.wire import Op

PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {
        "stranger_seconds": 2.0,
        "malformed": 1_000,
        "half_handshakes": 100,
        "handshake_wait": 3.0,
        "workers": 2,
        "servers": 1,
        "many_seconds": 4.0,
        "frame_runs": (48,),
        "frame_seconds": 3.0,
        "log_flood": 1_500,
    },
    "full": {
        "stranger_seconds": 30.0,
        "malformed": 20_000,
        "half_handshakes": 2_000,
        "handshake_wait": 45.0,
        "workers": 12,
        "servers": 2,
        "many_seconds": 120.0,
        "frame_runs": (48, 250),
        "frame_seconds": 30.0,
        "log_flood": 21_000,
    },
}
SCENARIOS = (
    "strangers",
    "malformed",
    "half_handshakes",
    "many_workers",
    "many_frames",
    "log_flood",
)

FRAME = max_payload_bytes(4 << 20)
"""The default frame limit (a 4 MiB partition): the size of each many-frame sender's frames."""
JOB_ELEMENTS = 1 << 18
"""Elements of the legitimate job's key (1 MiB of float32)."""
FRAME_SENDERS = 5
FORGED_LINE = b"2026-11-28 04:40:00,000 CRITICAL [server 0] kvstore.server.server: FORGED LINE"
FORGED_IDENTITY = b"x\n" + FORGED_LINE + b"\x1b[2J\x1b]0;owned\x07\x1b[31m"
GARBAGE = b"\xc1\xc1 not msgpack"
PARTIAL_GREETING = b"\xff" + bytes(8) + b"\x7f"
"""The signature of a ZMTP 3 greeting (10 of its 64 bytes): a handshake begun, then stalled."""
REPLY_WAIT_S = 5.0
"""How long a batch of malformed messages waits for a reply that has not come."""


# servers ---------------------------------------------------------------------------------------


class Server:
    """A ``kvstore-server`` process on 127.0.0.1 whose log (WARNING and above) goes to a file."""

    def __init__(
        self,
        log_path: Path,
        workers: int,
        *,
        keys: JobKeys | None = None,
        rank: int = 0,
        servers: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log_path = log_path
        command = [sys.executable, "-m", "kvstore.server", "--port", "0", "--threads", "2"]
        command += ["--server-rank", str(rank), "--num-servers", str(servers)]
        command += ["--num-workers", str(workers)]
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=log,
                env={
                    **os.environ,
                    **role_env("server", keys),
                    "KVSTORE_LOG_LEVEL": "WARNING",
                    **(env or {}),
                },
                cwd=REPO,
            )
        self.address = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float = 120.0) -> str:
        """Read the server's ``KVSTORE_READY`` line; its address."""
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline().decode() if ready else ""
        if not line.startswith("KVSTORE_READY "):
            tail = self.log_path.read_bytes()[-2000:].decode(errors="replace")
            raise RuntimeError(f"a server did not start ({line!r}); its log: {tail}")
        self.address = line.split()[1]
        return self.address

    def memory_kib(self, field: str) -> int:
        """``VmRSS`` or ``VmHWM`` of the server, in KiB (-1 once it has exited)."""
        try:
            text = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return -1
        for line in text.splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return -1

    def log_lines(self) -> list[str]:
        return self.log_path.read_bytes().decode("utf-8", errors="replace").split("\n")[:-1]

    def health(self) -> dict[str, Any]:
        """Whether it still runs, and what its log says of errors and closed connections."""
        lines = self.log_lines()
        return {
            "alive": self.process.poll() is None,
            "log_errors": sum(1 for line in lines if log_level(line) in ("ERROR", "CRITICAL")),
            "log_tracebacks": sum(1 for line in lines if line.startswith("Traceback")),
            "closed_connection_log_lines": sum(
                1 for line in lines if "closed the connection from" in line
            ),
            "suppressed_notes": sum(1 for line in lines if "suppressed" in line),
        }

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; by pid."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def log_level(line: str) -> str:
    """The level of a server log line (``date time LEVEL [role] ...``); "" for another line."""
    parts = line.split(" ", 3)
    return parts[2] if len(parts) > 3 else ""


def start_servers(
    log_dir: Path,
    name: str,
    count: int,
    workers: int,
    keys: JobKeys | None = None,
    env: dict[str, str] | None = None,
) -> list[Server]:
    servers: list[Server] = []
    try:
        for rank in range(count):
            log = log_dir / f"{name}-{rank}.log"
            servers.append(Server(log, workers, keys=keys, rank=rank, servers=count, env=env))
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


# the legitimate job ----------------------------------------------------------------------------


def job_worker(
    servers: list[str], rank: int, workers: int, rounds: int, seconds: float, elements: int
) -> dict[str, Any]:
    """One worker of a ``dist_sync`` job: each round pushes ``(rank+1)*f + pattern`` and pulls
    the round's sum, checking every element. Runs ``rounds`` rounds, or (``rounds`` 0) until
    every worker's clock passed ``seconds``: the workers agree through a pushed flag, so that
    all stop after the same round."""
    import kvstore

    kv = kvstore.create("dist_sync", servers=servers, rank=rank, num_workers=workers, timeout=120)
    pattern = (np.arange(elements) % 251).astype(np.float32)
    ranks_sum = workers * (workers + 1) // 2
    kv.init("w", np.zeros(elements, np.float32))
    kv.init("go", np.zeros(1, np.float32))
    out = np.empty(elements, np.float32)
    flag = np.empty(1, np.float32)
    print(json.dumps({"ready": True}), flush=True)  # connected: Job.wait_ready reads it
    deadline = time.monotonic() + seconds
    checked = mismatches = done = 0
    while True:
        factor = done % 1000 + 1
        kv.push("w", (rank + 1) * factor + pattern)
        kv.pull("w", out=out)
        expected = ranks_sum * factor + workers * pattern
        mismatches += int(np.count_nonzero(out != expected))
        checked += elements
        done += 1
        if rounds:
            if done >= rounds:
                break
            continue
        kv.push("go", np.full(1, float(time.monotonic() < deadline), np.float32))
        kv.pull("go", out=flag)
        checked += 1
        if not 0 <= flag[0] <= workers or flag[0] != int(flag[0]):
            mismatches += 1
        if flag[0] != workers:
            break
    kv.close()
    return {"rounds": done, "values_checked": checked, "mismatches": mismatches}


class Job:
    """A job of worker processes (this module's ``--role worker``)."""

    def __init__(
        self,
        servers: Sequence[str],
        workers: int,
        *,
        keys: JobKeys | None = None,
        rounds: int = 0,
        seconds: float = 0.0,
        elements: int = JOB_ELEMENTS,
    ) -> None:
        env = {**os.environ, **role_env("worker", keys)}
        self.children = []
        for rank in range(workers):
            command = module_command("probe_hostile", "--role", "worker")
            command += ["--servers", ",".join(servers), "--rank", str(rank)]
            command += ["--workers", str(workers), "--rounds", str(rounds)]
            command += ["--seconds", str(seconds), "--elements", str(elements)]
            self.children.append(
                subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    cwd=REPO,
                )
            )

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until every worker connected and made its keys."""
        deadline = time.monotonic() + timeout
        for child in self.children:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], deadline - time.monotonic())
            if not ready or not child.stdout.readline().strip():
                raise RuntimeError("a worker of the job did not connect")

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        """Wait for the workers; their rounds, values checked, mismatches and failures."""
        deadline = time.monotonic() + timeout
        outcomes: list[dict[str, Any]] = []
        for child in self.children:
            try:
                out, err = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                out, err = child.communicate()
                outcomes.append({"error": "did not finish in time"})
                continue
            lines = out.strip().splitlines()
            if child.returncode != 0 or not lines:
                outcomes.append({"error": err.strip().splitlines()[-1:] or ["no output"]})
            else:
                outcomes.append(json.loads(lines[-1]))
        failed = [o["error"] for o in outcomes if "error" in o]
        good = [o for o in outcomes if "error" not in o]
        mismatches = sum(o["mismatches"] for o in good)
        return {
            "workers": len(self.children),
            "rounds": min((o["rounds"] for o in good), default=0),
            "values_checked": sum(o["values_checked"] for o in good),
            "mismatches": mismatches,
            "worker_failures": failed,
            "exact": not failed and mismatches == 0,
        }


def run_job(servers: Sequence[str], workers: int, **kwargs: Any) -> dict[str, Any]:
    return Job(servers, workers, **kwargs).result()


# raw messages ----------------------------------------------------------------------------------


def header(op: Op, rid: int, **fields: Any) -> dict[str, Any]:
    return {"v": wire.PROTOCOL_VERSION, "op": int(op), "id": rid, **fields}


def hello_fields(rank: int = 0) -> dict[str, Any]:
    return {"r": rank, "nw": 2, "ns": 1, "si": 0, "m": "dist_sync", "ln": 0}


def push_fields(nbytes: int) -> dict[str, Any]:
    return {"k": "w", "c": 0, "n": nbytes // 4, "nb": [nbytes]}


_WRONG_VALUES: list[Any] = [
    5.0,
    -1,
    2**64 - 1,
    -(2**63),
    "x",
    b"\x00",
    None,
    True,
    [1],
    {"a": 1},
    "\n\x1b[2J",
]


def malformed_message(rng: random.Random, rid: int) -> list[bytes]:
    """One malformed message of a random kind."""
    kind = rng.randrange(5)
    if kind == 0:  # random bytes
        return [rng.randbytes(rng.randint(1, 200))]
    valid = rng.choice(
        [
            header(Op.HELLO, rid, **hello_fields()),
            header(Op.PUSH, rid, **push_fields(16)),
            header(Op.PULL, rid, k="w", c=0, af=0),
            header(Op.PING, rid, nb=[]),
        ]
    )
    if kind == 1:  # truncated msgpack
        packed = msgpack.packb(valid)
        return [packed[: rng.randrange(1, len(packed))]]
    if kind == 2:  # a field of a wrong type
        name = rng.choice(sorted(valid))
        valid[name] = rng.choice(_WRONG_VALUES)
        if name == "op" and valid[name] == int(Op.PING):
            valid[name] = "PING"
        return [msgpack.packb(valid)]
    if kind == 3:  # a field missing, or one unknown
        if rng.random() < 0.5:
            del valid[rng.choice(sorted(valid))]
        else:
            valid["zz"] = 1
        return [msgpack.packb(valid)]
    # wrong frame counts: a push that declares one frame, with none or two or three
    pushed = header(Op.PUSH, rid, **push_fields(16))
    return [msgpack.packb(pushed), *[bytes(16)] * rng.choice([0, 2, 3])]


def dealer(context: zmq.Context, address: str, identity: bytes | None = None) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(address)
    return sock


class ReplyCount:
    """Replies counted by kind."""

    def __init__(self) -> None:
        self.errors = 0
        self.others = 0
        self.invalid = 0
        self.missing = 0

    def add(self, frames: list[bytes]) -> None:
        try:
            message = wire.decode(frames)
        except Exception:  # any failure to decode is what is counted
            self.invalid += 1
            return
        if message.op is Op.ERROR:
            self.errors += 1
        else:
            self.others += 1

    @property
    def replies(self) -> int:
        return self.errors + self.others + self.invalid


def send_batches(
    sockets: list[zmq.Socket], messages: Callable[[int], list[bytes]], count: int
) -> ReplyCount:
    """Send ``count`` messages, round robin over ``sockets`` in batches, and count their
    replies (a batch waits :data:`REPLY_WAIT_S` for replies that have not come)."""
    counts = ReplyCount()
    batch = 100
    sent = 0
    while sent < count:
        expected = {}
        for sock in sockets:
            n = min(batch, count - sent)
            for _ in range(n):
                sock.send_multipart(messages(sent), copy=True)
                sent += 1
            expected[sock] = n
        for sock, n in expected.items():
            got = 0
            while got < n and sock.poll(int(REPLY_WAIT_S * 1000)):
                counts.add(sock.recv_multipart())
                got += 1
            counts.missing += n - got
    return counts


def control_characters(line: str) -> int:
    return sum(1 for c in line if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp"))


# scenarios -------------------------------------------------------------------------------------


def stranger_socket(context: zmq.Context, kind: str, keys: JobKeys, address: str) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == "another_job":
        other = JobKeys.generate().for_role("worker")
        sock.setsockopt(zmq.CURVE_SERVERKEY, other.peer_key.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, (other.public_key or "").encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, other.secret_key.encode())
    elif kind == "random_client_key":
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(address)
    return sock


def strangers(preset: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    keys = JobKeys.generate()
    (server,) = start_servers(log_dir, "strangers", 1, 2, keys=keys)
    context = zmq.Context()
    kinds = ("plain", "another_job", "random_client_key")
    sent = dict.fromkeys(kinds, 0)
    replies = dict.fromkeys(kinds, 0)
    stop = threading.Event()

    def stranger(kind: str) -> None:
        rid = 1
        while not stop.is_set():
            sock = stranger_socket(context, kind, keys, server.address)
            try:
                for message in (
                    [msgpack.packb(header(Op.HELLO, rid, **hello_fields()))],
                    [msgpack.packb(header(Op.PUSH, rid + 1, **push_fields(16))), bytes(16)],
                ):
                    sock.send_multipart(message)
                    sent[kind] += 1
                rid += 2
                while sock.poll(250):
                    sock.recv_multipart()
                    replies[kind] += 1
            finally:
                sock.close(0)

    try:
        threads = [threading.Thread(target=stranger, args=(k,), daemon=True) for k in kinds]
        for thread in threads:
            thread.start()
        time.sleep(preset["stranger_seconds"])
        stop.set()
        for thread in threads:
            thread.join(30)
        time.sleep(1.0)  # the last refusals logged
        lines = server.log_lines()
        job = run_job([server.address], 2, keys=keys, rounds=5)
        return {
            "seconds": preset["stranger_seconds"],
            "messages_sent": sent,
            "replies": replies,
            "log_lines": len(lines),
            "refusal_lines": sum(1 for line in lines if "refus" in line),
            "log_sample": lines[:6],
            "job_after": job,
            **server.health(),
        }
    finally:
        stop.set()
        context.destroy(linger=0)
        server.stop()


def malformed(preset: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    (server,) = start_servers(log_dir, "malformed", 1, 2)
    context = zmq.Context()
    rng = random.Random(54)
    try:
        before = server.memory_kib("VmRSS")
        sockets = [dealer(context, server.address) for _ in range(4)]
        counts = send_batches(sockets, lambda i: malformed_message(rng, 1 + i), preset["malformed"])
        for sock in sockets:
            sock.close(0)
        peak = server.memory_kib("VmHWM")
        job = run_job([server.address], 2, rounds=3)
        return {
            "messages": preset["malformed"],
            "error_replies": counts.errors,
            "other_replies": counts.others,
            "invalid_replies": counts.invalid,
            "without_reply": counts.missing,
            "rss_before_kib": before,
            "peak_over_before_kib": peak - before,
            "job_after": job,
            **server.health(),
        }
    finally:
        context.destroy(linger=0)
        server.stop()


def _raise_file_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _fresh_ping(address: str, timeout: float) -> bool:
    """Whether a new connection's PING is answered within ``timeout`` seconds."""
    context = zmq.Context()
    try:
        sock = dealer(context, address)
        sock.send_multipart([msgpack.packb(header(Op.PING, 1, nb=[]))])
        answered = bool(sock.poll(int(timeout * 1000)))
        sock.close(0)
        return answered
    finally:
        context.destroy(linger=0)


def half_handshakes(preset: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    count = preset["half_handshakes"]
    wait = preset["handshake_wait"]
    _raise_file_limit(count + 1024)
    (server,) = start_servers(log_dir, "half_handshakes", 1, 2)
    host, port = host_port(server.address)
    # the job connects first and runs through the flood and the wait for its end
    job = Job([server.address], 2, seconds=wait + 5.0)
    opened: dict[socket.socket, float] = {}
    by_fd: dict[int, socket.socket] = {}
    closed_after: list[float] = []
    failed_to_connect = 0
    poller = select.epoll()

    def watch(timeout: float) -> None:
        """Note the connections the server closed (seconds after each connected)."""
        for fd, _ in poller.poll(timeout):
            conn = by_fd[fd]
            try:
                data = conn.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if data:
                continue  # the server's greeting: still open
            closed_after.append(time.monotonic() - opened[conn])
            poller.unregister(fd)
            del by_fd[fd]

    flood_ping: list[bool] = []
    pinger = threading.Thread(
        target=lambda: flood_ping.append(_fresh_ping(server.address, 10.0)), daemon=True
    )
    try:
        job.wait_ready()
        for _ in range(count):
            try:
                conn = socket.create_connection((host, port), timeout=10)
                conn.sendall(PARTIAL_GREETING)
            except OSError:
                failed_to_connect += 1
                continue
            conn.setblocking(False)
            opened[conn] = time.monotonic()
            by_fd[conn.fileno()] = conn
            poller.register(conn.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
            watch(0)
        pinger.start()  # a new peer while the flood holds its connections
        deadline = time.monotonic() + wait
        while by_fd and time.monotonic() < deadline:
            watch(0.2)
        still_open = len(by_fd)
        pinger.join(30)
        after_ping = _fresh_ping(server.address, 10.0)
        outcome = job.result()
        at_once = [t for t in closed_after if t < 1.0]
        later = sorted(t for t in closed_after if t >= 1.0)
        return {
            "connections": count,
            "failed_to_connect": failed_to_connect,
            "closed_at_once": len(at_once),
            "closed_later": len(later),
            "closed_later_seconds": {
                "min": round(later[0], 2),
                "median": round(statistics.median(later), 2),
                "max": round(later[-1], 2),
            }
            if later
            else None,
            "still_open_after_s": {"seconds": wait, "open": still_open},
            "fresh_connection_answered_during_flood": bool(flood_ping and flood_ping[0]),
            "fresh_connection_answered_after_wait": after_ping,
            "job_during": outcome,
            **server.health(),
        }
    finally:
        poller.close()
        for conn in opened:
            conn.close()
        for child in job.children:
            if child.poll() is None:
                child.kill()
                child.wait()
        server.stop()


def many_workers(preset: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    workers, count = preset["workers"], preset["servers"]
    servers = start_servers(log_dir, "many_workers", count, workers)
    try:
        start = [s.memory_kib("VmRSS") for s in servers]
        job = run_job([s.address for s in servers], workers, seconds=preset["many_seconds"])
        end = [s.memory_kib("VmRSS") for s in servers]
        health = [s.health() for s in servers]
        return {
            "workers": workers,
            "servers": count,
            "seconds": preset["many_seconds"],
            "job": job,
            "rss_start_kib": start,
            "rss_end_kib": end,
            "alive": all(h["alive"] for h in health),
            "log_errors": sum(h["log_errors"] for h in health),
            "log_tracebacks": sum(h["log_tracebacks"] for h in health),
        }
    finally:
        for server in servers:
            server.stop()


class FrameSender(threading.Thread):
    """Sends messages of ``frames`` frames of :data:`FRAME` bytes (one shared buffer, never
    copied) over a DEALER that reconnects whenever the server closes it: alternately a PUSH
    header declaring the most payload a request may and a header that is not msgpack."""

    def __init__(self, context: zmq.Context, address: str, frames: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 4)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 20)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.connect(address)
        self.frames = frames
        self.stop = stop
        self.offered = 0
        """Bytes of messages handed to libzmq (send returned); those queued in the socket
        when the server closed its connection are dropped unsent."""
        self.disconnects = 0
        """Times the server closed this sender's connection."""

    def run(self) -> None:
        payload = zmq.Frame(bytes(FRAME))
        body = [payload] * self.frames
        declared = {"k": "w", "c": 0, "n": FRAME // 4, "nb": [FRAME] * wire.MAX_PAYLOAD_FRAMES}
        heads = [msgpack.packb(header(Op.PUSH, 1, **declared)), GARBAGE]
        sent = 0
        while not self.stop.is_set():
            try:
                self.socket.send_multipart([heads[sent % 2], *body], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                time.sleep(0.005)
                continue
            sent += 1
            self.offered += FRAME * self.frames
            try:
                while True:
                    self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                pass
            self.count_disconnects()
        self.count_disconnects()
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)

    def count_disconnects(self) -> None:
        while self.monitor.poll(0):
            self.monitor.recv_multipart()
            self.disconnects += 1


def many_frames_run(preset: dict[str, Any], log_dir: Path, frames: int) -> dict[str, Any]:
    (server,) = start_servers(log_dir, f"many_frames_{frames}", 1, 2)
    limits = GateLimits.for_server(FRAME, DEFAULT_MAX_CONNECTIONS, DEFAULT_RECEIVE_BUFFER_BYTES)
    bound_kib = memory_bound(limits, encrypted=False) // 1024  # the server has no keys
    context = zmq.Context()
    stop = threading.Event()
    senders: list[FrameSender] = []
    try:
        warm = run_job([server.address], 2, rounds=2)
        before = server.memory_kib("VmRSS")
        seconds = preset["frame_seconds"]
        job = Job([server.address], 2, seconds=seconds)
        senders = [FrameSender(context, server.address, frames, stop) for _ in range(FRAME_SENDERS)]
        for sender in senders:
            sender.start()
        time.sleep(seconds)
        stop.set()
        for sender in senders:
            sender.join(30)
        during = job.result()
        after_job = run_job([server.address], 2, rounds=3)
        peak = server.memory_kib("VmHWM")
        time.sleep(2.0)
        return {
            "senders": FRAME_SENDERS,
            "frames_per_message": frames,
            "frame_bytes": FRAME,
            "seconds": seconds,
            "bytes_offered": sum(s.offered for s in senders),
            "connections_closed_seen_by_senders": sum(s.disconnects for s in senders),
            "rss_before_kib": before,
            "peak_kib": peak,
            "peak_over_before_kib": peak - before,
            "rss_after_kib": server.memory_kib("VmRSS"),
            "bound_kib": bound_kib,
            "within_bound": peak - before <= bound_kib,
            "settings": {
                "max_connections": DEFAULT_MAX_CONNECTIONS,
                "receive_buffer_bytes": DEFAULT_RECEIVE_BUFFER_BYTES,
            },
            "job_warm": warm["exact"],
            "job_during": during,
            "job_after": after_job,
            **server.health(),
        }
    finally:
        stop.set()
        for sender in senders:
            sender.join(30)
        context.destroy(linger=0)
        server.stop()


def log_flood(preset: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    (server,) = start_servers(log_dir, "log_flood", 1, 2)
    context = zmq.Context()
    try:
        forger = dealer(context, server.address, FORGED_IDENTITY)
        forger.send(GARBAGE)
        forged_answered = bool(forger.poll(10_000))
        forger.close(0)
        sockets = [dealer(context, server.address, f"flood-{i}".encode()) for i in range(4)]
        counts = send_batches(sockets, lambda i: [GARBAGE], preset["log_flood"])
        for sock in sockets:
            sock.close(0)
        job = run_job([server.address], 2, rounds=3)
        time.sleep(1.0)
        raw = server.log_path.read_bytes()
        lines = raw.decode("utf-8", errors="replace").split("\n")[:-1]
        forged_prefix = FORGED_LINE[:40].decode()
        return {
            "bad_messages": preset["log_flood"] + 1,
            "error_replies": counts.errors + int(forged_answered),
            "without_reply": counts.missing + int(not forged_answered),
            "log_bytes": len(raw),
            "log_lines": len(lines),
            "lines_with_control_characters": sum(1 for line in lines if control_characters(line)),
            "forged_line_appears": any(line.startswith(forged_prefix) for line in lines),
            "forged_text_logged_escaped": any("FORGED" in line for line in lines),
            "job_after": job,
            **server.health(),
        }
    finally:
        context.destroy(linger=0)
        server.stop()


def run_scenario(name: str, preset_name: str, log_dir: Path) -> list[dict[str, Any]]:
    preset = PRESETS[preset_name]
    if name == "many_frames":
        results = [many_frames_run(preset, log_dir, frames) for frames in preset["frame_runs"]]
    else:
        results = [SCENARIO_FUNCTIONS[name](preset, log_dir)]
    return [{"scenario": name, "preset": preset_name, **result} for result in results]


SCENARIO_FUNCTIONS: dict[str, Callable[[dict[str, Any], Path], dict[str, Any]]] = {
    "strangers": strangers,
    "malformed": malformed,
    "half_handshakes": half_handshakes,
    "many_workers": many_workers,
    "log_flood": log_flood,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--scenario", choices=SCENARIOS, action="append")
    parser.add_argument(
        "--keep-logs", help="a folder to keep the servers' logs in (default: deleted)"
    )
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--servers", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--elements", type=int, default=JOB_ELEMENTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "worker":
        result = job_worker(
            args.servers.split(","),
            args.rank,
            args.workers,
            args.rounds,
            args.seconds,
            args.elements,
        )
        print(json.dumps(result), flush=True)
        return 0
    stamp = machine()
    with tempfile.TemporaryDirectory(prefix="probe_hostile-") as scratch:
        log_dir = Path(args.keep_logs or scratch)
        log_dir.mkdir(parents=True, exist_ok=True)
        for name in args.scenario or SCENARIOS:
            for record in run_scenario(name, args.preset, log_dir):
                emit({**record, "machine": stamp})
    return 0


if __name__ == "__main__":
    sys.exit(main())
