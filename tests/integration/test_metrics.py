"""The Prometheus endpoint (``KVSTORE_METRICS_PORT``, :mod:`kvstore.metrics`) of a live job.

Real ``kvstore-server`` processes and workers as threads of this process run a few 2-bit rounds;
then every server's and worker's ``/metrics`` is scraped over HTTP and checked against what was
done and against each other: what the servers received is what the workers sent, op by op and
byte for byte, and the other way round.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable

import kvtest
import numpy as np
import pytest
from kvtest import RawClient, run_ranks, run_ranks_outcomes
from prometheus_client.parser import text_string_to_metric_families

import kvstore
from kvstore import ValueMismatchError
from kvstore.codecs.twobit import encode_reference
from kvstore.errors import ErrorCode
from kvstore.metrics import SERVER_QUEUES, WORKER_QUEUES

pytestmark = pytest.mark.integration

N, S = 2, 2
ROUNDS = 3
THRESHOLD = 0.5
KEYS = {"big": 300_000, 7: 50_000, "tiny": 40}  # "big" is split over both servers
REQUEST_OPS = (
    *("hello", "init", "push", "pull", "pushpull", "barrier", "set_optimizer", "bye"),
    *("save", "load"),
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample of ``http://127.0.0.1:PORT/metrics``, by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def series(samples: Samples, name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` by the value of one of their labels."""
    return {dict(k)[label]: v for (n, k), v in samples.items() if n == name}


def eventually(check: Callable[[], None], timeout: float = 10.0) -> None:
    """Retry ``check`` until it passes: a reply reaches a worker a moment before its server's
    event loop counts it as sent."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def free_port_range(count: int) -> int:
    """A base port P such that P .. P + count - 1 are free on 127.0.0.1 now (below the
    ephemeral range, where the other tests' port-0 servers land)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 30_000)
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def gradient(key: object, rank: int, step: int) -> np.ndarray:
    seed = (zlib.crc32(str(key).encode()), rank, step)
    return np.random.default_rng(seed).normal(size=KEYS[key]).astype(np.float32)


def expected_quality(key: object, rank: int) -> tuple[float, float]:
    """``||residual|| / ||gradient||`` and the density sent after the last measured push of
    ``key`` by ``rank`` (push ``ROUNDS - 1``), from the numpy reference encoder."""
    n = KEYS[key]
    residual = np.zeros(n, np.float32)
    words = np.empty(-(-n // 16), np.uint32)
    for step in range(ROUNDS):
        grad = gradient(key, rank, step)
        x = residual + grad
        sent = np.count_nonzero((x >= THRESHOLD) | (x <= -THRESHOLD))
        encode_reference(grad, residual, THRESHOLD, words)
    ratio = np.linalg.norm(residual.astype(np.float64)) / np.linalg.norm(grad.astype(np.float64))
    return float(ratio), sent / n


def test_a_live_job_exports_consistent_metrics(monkeypatch):
    base = free_port_range(S + N)
    env = {"KVSTORE_METRICS_PORT": str(base), "KVSTORE_METRICS_ADDR": "127.0.0.1"}
    servers = kvtest.start_servers(S, N, env=env)
    try:
        for name, setting in env.items():
            monkeypatch.setenv(name, setting)
        # Pushes 0 and 2 of each key are measured: the last one is push ROUNDS - 1.
        monkeypatch.setenv("KVSTORE_METRICS_EVERY", str(ROUNDS - 1))
        addresses = [s.address for s in servers]
        stores = [kvtest.connect(addresses, rank, N, bigarray_bound=100_000) for rank in range(N)]
        try:
            # The port rule: server I on P + I, worker R on P + S + R.
            assert [kv.metrics_port for kv in stores] == [base + S + r for r in range(N)]
            _run_job(stores, addresses)
            eventually(lambda: _check_metrics(base))
        finally:
            for kv in stores:
                kv.close()
        # A worker's endpoint closes with its store.
        for rank in range(N):
            with pytest.raises(OSError):
                scrape(base + S + rank)
    finally:
        kvtest.stop_processes([s.process for s in servers])


def _run_job(stores: list, addresses: list[str]) -> None:
    def work(rank: int) -> None:
        kv = stores[rank]
        kv.set_gradient_compression({"type": "2bit", "threshold": THRESHOLD})
        kv.init(list(KEYS), [np.zeros(n, np.float32) for n in KEYS.values()])
        outs = [np.empty(n, np.float32) for n in KEYS.values()]
        for step in range(ROUNDS):
            kv.push(list(KEYS), [gradient(k, rank, step) for k in KEYS])
            kv.pull(list(KEYS), out=outs)
        kv.barrier()

    run_ranks(N, work)

    # One refused init: rank 1 declares another shape than rank 0 (a remote error for rank 1).
    def mismatch(rank: int) -> None:
        stores[rank].init("mismatch", np.zeros(10 + rank, np.float32))

    outcomes = run_ranks_outcomes(N, mismatch)
    assert outcomes[0] is None and isinstance(outcomes[1], ValueMismatchError), outcomes

    # One message that fails validation, to server 0.
    raw = RawClient(addresses[0])
    try:
        raw.send_frames([b"not msgpack"])
        assert raw.receive().body.code == "bad_message"
    finally:
        raw.close()


def _check_metrics(base: int) -> None:
    servers = [scrape(base + i) for i in range(S)]
    workers = [scrape(base + S + r) for r in range(N)]
    # Every worker sent each chunk one init, and the refused key one more.
    chunks = series(workers[0], "kvstore_worker_sent_messages_total", "op")["init"] - 1
    rounds = 0.0
    for i, samples in enumerate(servers):
        rounds += _check_server(i, samples)
    assert rounds == ROUNDS * chunks  # every chunk's round completed once per step
    errors = [series(s, "kvstore_server_errors_total", "code") for s in servers]
    assert set(errors[0]) == {code.value for code in ErrorCode}
    assert sum(e["spec_mismatch"] for e in errors) == 1
    assert (errors[0]["bad_message"], errors[1]["bad_message"]) == (1, 0)
    assert sum(sum(e.values()) for e in errors) == 2
    invalid = [
        series(s, "kvstore_server_received_messages_total", "op").get("invalid") for s in servers
    ]
    assert invalid == [1, None]  # (exported once seen)
    for rank, samples in enumerate(workers):
        _check_worker(rank, samples)
    _check_both_ends(servers, workers)


def _check_server(i: int, samples: Samples) -> float:
    """Checks one server's metrics; returns its number of completed rounds."""
    label = str(i)
    received = series(samples, "kvstore_server_received_messages_total", "op")
    assert set(REQUEST_OPS) <= set(received)
    assert received["hello"] == 2 * N  # a data and a control connection per worker
    pushes = received["push"] + received["pushpull"]
    rounds = value(samples, "kvstore_server_round_duration_seconds_count", server=label)
    assert rounds > 0 and pushes == N * rounds  # a round takes one push of every worker
    round_time = value(samples, "kvstore_server_round_duration_seconds_sum", server=label)
    assert round_time > 0  # the rounds were timed (how long they took is the machine's)
    buckets = series(samples, "kvstore_server_round_duration_seconds_bucket", "le")
    assert buckets["+Inf"] == rounds
    received_bytes = series(samples, "kvstore_server_received_bytes_total", "op")
    assert received_bytes["push"] + received_bytes["pushpull"] > 0
    assert received_bytes["init"] > 0
    depths = series(samples, "kvstore_server_queue_depth", "queue")
    assert depths == dict.fromkeys(SERVER_QUEUES, 0.0)  # the job is at rest
    return rounds


def _check_worker(rank: int, samples: Samples) -> None:
    label = str(rank)
    sent = series(samples, "kvstore_worker_sent_messages_total", "op")
    assert set(sent) == set(REQUEST_OPS)
    assert sent["push"] + sent["pushpull"] == ROUNDS * (sent["init"] - 1)
    assert (sent["hello"], sent["barrier"]) == (2 * S, 1)
    pushed = value(samples, "kvstore_worker_push_bytes_total", rank=label)
    dense = value(samples, "kvstore_worker_push_dense_bytes_total", rank=label)
    assert dense == ROUNDS * 4 * sum(KEYS.values())
    sent_bytes = series(samples, "kvstore_worker_sent_bytes_total", "op")
    assert pushed == sent_bytes["push"] + sent_bytes["pushpull"]
    ratio = value(samples, "kvstore_worker_compression_ratio", rank=label)
    assert ratio == pytest.approx(dense / pushed)
    assert 15 < ratio < 16  # 2-bit: 16x, less the headers
    residual = series(samples, "kvstore_worker_residual_norm_ratio", "key")
    density = series(samples, "kvstore_worker_sent_density", "key")
    assert set(residual) == set(density) == {str(k) for k in KEYS}
    for key in KEYS:
        expected_ratio, expected_density = expected_quality(key, rank)
        assert residual[str(key)] == pytest.approx(expected_ratio, rel=1e-4), key
        assert density[str(key)] == pytest.approx(expected_density, rel=1e-12), key
    depths = series(samples, "kvstore_worker_queue_depth", "queue")
    assert depths == dict.fromkeys(WORKER_QUEUES, 0.0)
    errors = series(samples, "kvstore_worker_remote_errors_total", "code")
    assert errors["spec_mismatch"] == (1 if rank == 1 else 0)
    assert sum(errors.values()) == errors["spec_mismatch"]


def _check_both_ends(servers: list[Samples], workers: list[Samples]) -> None:
    """What the servers received is what the workers sent, and the other way round."""

    def total(samples: list[Samples], name: str) -> dict[str, float]:
        sums: dict[str, float] = {}
        for s in samples:
            for op, amount in series(s, name, "op").items():
                if op != "invalid":  # the raw client's message: no worker sent it
                    sums[op] = sums.get(op, 0) + amount
        return sums

    for direction, other in (("received", "sent"), ("sent", "received")):
        for unit in ("messages", "bytes"):
            at_servers = total(servers, f"kvstore_server_{direction}_{unit}_total")
            at_workers = total(workers, f"kvstore_worker_{other}_{unit}_total")
            assert at_servers == at_workers, (direction, unit)


def test_port_zero_picks_free_ports_and_logs_them(monkeypatch):
    process = subprocess.Popen(
        [sys.executable, "-m", "kvstore.server", "--port", "0", "--num-workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={
            **os.environ,
            "KVSTORE_METRICS_PORT": "0",
            "KVSTORE_METRICS_ADDR": "127.0.0.1",
            "KVSTORE_LOG_LEVEL": "INFO",
        },
        text=True,
    )
    lines: list[str] = []
    logged = threading.Event()

    def read_log() -> None:  # drains stderr for as long as the server runs
        for line in process.stderr:
            lines.append(line)
            if "Prometheus metrics on" in line:
                logged.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        address = process.stdout.readline().split()[1]  # the READY line
        assert logged.wait(30), lines
        found = (re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line) for line in lines)
        server_port = int(next(m for m in found if m is not None).group(1))
        monkeypatch.setenv("KVSTORE_METRICS_PORT", "0")
        monkeypatch.setenv("KVSTORE_METRICS_EVERY", "1")
        with kvtest.connect([address]) as kv:
            assert kv.metrics_port not in (None, 0, server_port)
            kv.init("dense", np.zeros(1000, np.float32))
            grad = np.arange(1000, dtype=np.float32)  # one zero
            kv.push("dense", grad)
            kv.pull("dense", out=np.empty(1000, np.float32))
            worker = scrape(kv.metrics_port)
            server = scrape(server_port)
        # Dense pushes: nothing kept back, every nonzero value sent, the headers on top.
        assert value(worker, "kvstore_worker_residual_norm_ratio", rank="0", key="dense") == 0
        assert value(worker, "kvstore_worker_sent_density", rank="0", key="dense") == 0.999
        assert 0.9 < value(worker, "kvstore_worker_compression_ratio", rank="0") < 1
        received = series(server, "kvstore_server_received_messages_total", "op")
        assert received["push"] + received["pushpull"] == 1
        assert value(server, "kvstore_server_round_duration_seconds_count", server="0") == 1
    finally:
        kvtest.stop_processes([process])
        reader.join(10)  # (the server's exit ends its stderr)
        process.stderr.close()


def test_without_the_variable_nothing_is_started():
    # A fresh interpreter: no endpoint, no metrics thread, and prometheus_client never imported.
    code = """
import asyncio, sys, threading
import numpy as np
import kvstore
from kvstore.config import ServerConfig
from kvstore.server import ShardServer

def no_metrics_thread():
    assert not [t.name for t in threading.enumerate() if "metrics" in t.name]

async def serve():
    server = ShardServer(ServerConfig(port=0))
    await server.start()
    try:
        assert server.metrics_port is None
        no_metrics_thread()
    finally:
        await server.stop()

asyncio.run(serve())
with kvstore.create("local") as kv:
    kv.set_gradient_compression({"type": "2bit"})
    kv.init("w", np.zeros(100, np.float32))
    kv.push("w", np.ones(100, np.float32))
    kv.pull("w", out=np.empty(100, np.float32))
    assert kv.metrics_port is None
    no_metrics_thread()
assert "prometheus_client" not in sys.modules
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_METRICS")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_taken_port_is_a_clear_error(monkeypatch):
    base = free_port_range(2)
    monkeypatch.setenv("KVSTORE_METRICS_PORT", str(base))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))  # worker 0 of a one-server (local) job: P + 1 + 0
        taken.listen()
        where = rf"worker 0 cannot serve metrics on 127.0.0.1:{base + 1} \(KVSTORE_METRICS_PORT="
        with pytest.raises(OSError, match=where):
            kvstore.create("local")
    # Nothing was left behind: the same store starts once the port is free.
    with kvstore.create("local") as kv:
        assert kv.metrics_port == base + 1
