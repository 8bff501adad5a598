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
import random
import resource
import select
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from benchmarks.common import emit, machine
from benchmarks.probe_parts import (
    FORGED_IDENTITY,
    FORGED_LINE,
    FRAME,
    FRAME_SENDERS,
    GARBAGE,
    JOB_ELEMENTS,
    PARTIAL_GREETING,
    Job,
    control_characters,
    dealer,
    header,
    hello_fields,
    host_port,
    job_worker,
    malformed_message,
    push_fields,
    run_job,
    send_batches,
    start_servers,
)
from kvstore import wire
from kvstore.auth import JobKeys
from kvstore.envvars import DEFAULT_MAX_CONNECTIONS, DEFAULT_RECEIVE_BUFFER_BYTES
from kvstore.server.gate_limits import GateLimits, memory_bound
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
