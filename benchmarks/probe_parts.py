"""The hostile-input probe's parts (:mod:`benchmarks.probe_hostile`): its server processes and
their logs, the legitimate jobs whose sums it checks, and the messages it sends."""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from benchmarks.common import REPO, module_command
from kvstore import wire
from kvstore.auth import JobKeys, role_env
from kvstore.topology import max_payload_bytes
from kvstore.wire import Op

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
