"""Helpers shared by the tests: the install guard, a slow 2-bit oracle, server processes, and a
worker's store connected to them.

Imports nothing from kvstore at module level, so :func:`require_installed` can report a missing
install itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
INSTALL_HINT = "run `pip install -e .` (or `pip install -e '.[dev]'`) in the repository root first"


def require_installed() -> None:
    """Raise with an install hint unless the kvstore package and its subpackages import."""
    try:
        import kvstore  # noqa: F401
        import kvstore.codecs  # noqa: F401
        import kvstore.deploy  # noqa: F401
        import kvstore.server  # noqa: F401
        import kvstore.worker  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"kvstore is not installed ({exc}): {INSTALL_HINT}") from exc


# 2-bit oracle: one element at a time, float32 scalars, straight from the spec ----------------


def oracle_encode(grad: Sequence[float], residual: Any, threshold: float) -> tuple[bytes, list]:
    """Per-element 2-bit encode. Updates ``residual`` (a float32 numpy array) in place.

    Returns the packed bytes (``ceil(n/16)*4`` of them) and the list of codes.
    """
    import numpy as np

    t = np.float32(threshold)
    codes = []
    for i in range(len(grad)):
        x = np.float32(residual[i] + np.float32(grad[i]))
        if x >= t:
            code = 3
            x = np.float32(x - t)
        elif x <= -t:
            code = 2
            x = np.float32(x + t)
        else:
            code = 0
        residual[i] = x
        codes.append(code)
    words = -(-len(codes) // 16)
    padded = codes + [0] * (words * 16 - len(codes))
    out = bytearray()
    for j in range(0, len(padded), 4):
        c0, c1, c2, c3 = padded[j : j + 4]
        out.append(c0 << 6 | c1 << 4 | c2 << 2 | c3)
    return bytes(out), codes


def oracle_decode(codes: Sequence[int], threshold: float) -> Any:
    """Dequantized float32 values of a list of codes: 11 -> +t, 10 -> -t, else 0."""
    import numpy as np

    t = np.float32(threshold)
    values = np.zeros(len(codes), dtype=np.float32)
    for i, code in enumerate(codes):
        if code == 3:
            values[i] = t
        elif code == 2:
            values[i] = -t
    return values


# processes -----------------------------------------------------------------------------------


@dataclass
class ServerProcess:
    process: subprocess.Popen
    address: str
    rank: int


def start_servers(
    num_servers: int,
    num_workers: int,
    *,
    threads: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    stderr: Any = subprocess.DEVNULL,
) -> list[ServerProcess]:
    """Start ``num_servers`` ``kvstore-server`` processes on 127.0.0.1, port 0; wait for READY.

    ``stderr``: where their logs go (a file to read them; by default nowhere)."""
    servers = []
    try:
        for rank in range(num_servers):
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvstore.server",
                    "--port",
                    "0",
                    "--server-rank",
                    str(rank),
                    "--num-servers",
                    str(num_servers),
                    "--num-workers",
                    str(num_workers),
                    "--threads",
                    str(threads),
                ],
                stdout=subprocess.PIPE,
                stderr=stderr,
                env={**os.environ, "KVSTORE_LOG_LEVEL": "ERROR", **(env or {})},
                text=True,
            )
            servers.append(ServerProcess(process, "", rank))
        for server in servers:
            server.address = read_ready(server.process, timeout)
    except BaseException:
        stop_processes([s.process for s in servers])
        raise
    return servers


def read_ready(process: subprocess.Popen, timeout: float) -> str:
    """The address of a server process's READY line (within ``timeout`` seconds)."""
    result: list[str] = []

    def read() -> None:
        line = process.stdout.readline()
        result.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not result or not result[0].startswith("KVSTORE_READY "):
        raise RuntimeError(f"server did not print its READY line: {result!r}")
    return result[0].split()[1]


def stop_processes(processes: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
    """Stop processes by pid: SIGTERM, wait, then SIGKILL."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def reports_of_workers(
    argvs: Sequence[Sequence[str]], timeout: float = 300.0, **popen: Any
) -> list:
    """Run one process per argv (``popen``: more of ``subprocess.Popen``'s arguments); once
    every one exited 0 (any left after ``timeout`` seconds are killed, and the test fails),
    the JSON lines the first printed, checking that the others printed nothing on stdout
    (worker 0 reports)."""
    import json  # noqa: PLC0415

    workers = [
        subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
        )  # fmt: skip
        for argv in argvs
    ]
    try:
        outputs = [worker.communicate(timeout=timeout) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-3000:]
    assert not any(out.strip() for out, _ in outputs[1:])  # only worker 0 reports
    return [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]


def run_ranks(num_workers: int, fn: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank)`` for every rank on its own thread; return results, re-raise errors."""
    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        futures = [pool.submit(fn, rank) for rank in range(num_workers)]
        return [f.result(timeout=timeout) for f in futures]


def run_ranks_outcomes(
    num_workers: int, fn: Callable[[int], Any], timeout: float = 60.0
) -> list[Any]:
    """Like :func:`run_ranks`, but returns each rank's exception instead of raising it."""

    def guarded(rank: int) -> Any:
        try:
            return fn(rank)
        except Exception as exc:  # the test inspects it
            return exc

    return run_ranks(num_workers, guarded, timeout)


class RawClient:
    """A bare DEALER socket that speaks the wire protocol, for poking a server directly."""

    def __init__(self, address: str, identity: bytes | None = None) -> None:
        import zmq

        self._zmq = zmq
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        if identity is not None:
            self.socket.setsockopt(zmq.ROUTING_ID, identity)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self._rid = 1000

    def hello(self, rank: int = 0, num_workers: int = 1, mode: str = "dist_sync", **extra: Any):
        """Say HELLO as one lane (data by default) of a worker; both lanes' requests work."""
        fields = {"r": rank, "nw": num_workers, "ns": 1, "si": 0, "m": mode, "ln": 0, **extra}
        return self.request("HELLO", fields)

    def send(self, op: str, fields: dict | None = None, payloads: Sequence[Any] = ()) -> int:
        from kvstore import wire

        self._rid += 1
        self.socket.send_multipart(wire.encode(wire.Op[op], self._rid, fields, payloads))
        return self._rid

    def send_frames(self, frames: Sequence[bytes]) -> None:
        self.socket.send_multipart(list(frames))

    def receive(self, timeout: float = 10.0):
        from kvstore import wire

        if not self.socket.poll(int(timeout * 1000)):
            raise TimeoutError("no reply from the server")
        return wire.decode(self.socket.recv_multipart())

    def request(self, op: str, fields: dict | None = None, payloads: Sequence[Any] = ()):
        rid = self.send(op, fields, payloads)
        reply = self.receive()
        assert reply.rid == rid, (reply.rid, rid)
        return reply

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def connect(
    addresses: Sequence[str],
    rank: int = 0,
    num_workers: int = 1,
    mode: str = "dist_sync",
    **kwargs: Any,
) -> Any:
    """A store of ``mode`` connected to the servers at ``addresses`` (blocking calls time out
    after 30 s unless ``timeout`` says otherwise)."""
    import kvstore  # noqa: PLC0415  (this module imports nothing from kvstore at load)

    kwargs.setdefault("timeout", 30)
    return kvstore.create(mode, servers=addresses, rank=rank, num_workers=num_workers, **kwargs)


def require_cupy() -> Any:
    """CuPy, for the GPU tests; skips the calling module without CuPy or a CUDA device."""
    import pytest

    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install 'pskv[gpu]')")
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver
        devices = 0
    if devices < 1:
        pytest.skip("no CUDA device", allow_module_level=True)
    return cupy


def launch(*args: str, env: dict[str, str], cwd: Any = None) -> subprocess.CompletedProcess:
    """Run ``kvstore-launch ARGS`` to its end (2-minute hang guard), capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "kvstore.deploy", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


# a launcher's servers, seen from outside ------------------------------------------------------


@dataclass
class ProcessView:
    """A process as ``/proc`` shows it: its pid, argv and environment."""

    pid: int
    argv: list[str]
    env: dict[str, str]


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (its children, theirs, ...), from the parent pids in
    ``/proc/*/stat``; zombies left out."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state != "Z":
            parents[int(entry.name)] = int(ppid)
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [c for c, p in parents.items() if p == parent]
        found += children
        frontier += children
    return found


def launched_server(launcher_pid: int, rank: int) -> ProcessView | None:
    """The ``python -m kvstore.server --server-rank RANK`` process below ``launcher_pid``
    (itself, or under the ``ssh`` or ``srun`` that started it); None if there is none."""
    for pid in descendants(launcher_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
            if argv[1:3] != ["-m", "kvstore.server"] or "--server-rank" not in argv:
                continue
            if argv[argv.index("--server-rank") + 1] != str(rank):
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")[:-1]
        except (OSError, IndexError):
            continue
        return ProcessView(pid, argv, dict(v.split("=", 1) for v in environ if "=" in v))
    return None


@dataclass
class ServerRestart:
    """What :func:`kill_a_launched_server` saw: the launcher's exit code and output, the
    workers' ``KVSTORE_SERVERS``, and the server before it was killed and after it rejoined."""

    returncode: int
    stdout: str
    stderr: str
    servers: list[str]
    before: ProcessView
    after: ProcessView


RESTART_WORKER = (
    "import os, pathlib, sys, time\n"
    "print('replicas', os.environ['KVSTORE_REPLICAS'], 'servers', os.environ['KVSTORE_SERVERS'],"
    " flush=True)\n"
    "release, deadline = pathlib.Path(sys.argv[1]), time.monotonic() + 300\n"
    "while not release.exists():\n"
    "    if time.monotonic() > deadline:\n"
    "        sys.exit('never released')\n"
    "    time.sleep(0.05)\n"
)
"""A worker that prints its ``KVSTORE_REPLICAS`` and ``KVSTORE_SERVERS``, then waits until
the file ``argv[1]`` exists and exits 0."""


def kill_a_launched_server(
    args: Sequence[str], folder: Path, *, rank: int = 1, env: dict[str, str] | None = None
) -> ServerRestart:
    """Run ``kvstore-launch ARGS -- PYTHON -c RESTART_WORKER RELEASE`` (cwd ``folder``), and
    once worker 0 printed, SIGKILL server ``rank`` (its python process, by pid); wait until the
    launcher says it rejoined and its address accepts TCP connections, then let the workers
    finish. Every wait has a hang guard (``AssertionError`` with the launcher's output); the
    launcher is stopped by its pid (SIGTERM, which stops its children, then SIGKILL) if it is
    still running at the end."""
    import socket

    release, out, err = folder / "release", folder / "launch.out", folder / "launch.err"
    command = [sys.executable, "-c", RESTART_WORKER, str(release)]
    env = {**(env if env is not None else os.environ), "KVSTORE_LOG_LEVEL": "INFO"}
    with out.open("wb") as stdout, err.open("wb") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "kvstore.deploy", *args, "--", *command],
            stdout=stdout,
            stderr=stderr,
            env=env,
            cwd=folder,
        )

    def wait_for(what: str, seen: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None:
            found = seen()
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{what}: not seen\n{out.read_text()}\n{err.read_text()}")

    def worker_line() -> str | None:
        lines = out.read_text().splitlines()
        return next((x for x in lines if x.startswith("[worker 0] replicas ")), None)

    try:
        servers = wait_for("worker 0's line", worker_line).split()[-1].split(",")
        before = wait_for(f"server {rank}", lambda: launched_server(launcher.pid, rank))
        os.kill(before.pid, signal.SIGKILL)
        wait_for("the rejoin", lambda: f"server {rank} rejoined at" in err.read_text())

        def replacement() -> ProcessView | None:
            server = launched_server(launcher.pid, rank)
            return server if server is not None and server.pid != before.pid else None

        after = wait_for("the new server", replacement)
        host, _, port = servers[rank].removeprefix("tcp://").rpartition(":")
        socket.create_connection((host.strip("[]"), int(port)), timeout=30).close()
        release.touch()
        launcher.wait(120)
    finally:
        release.touch()
        if launcher.poll() is None:
            stop_processes([launcher], grace=30.0)
    return ServerRestart(
        launcher.returncode, out.read_text(), err.read_text(), servers, before, after
    )
