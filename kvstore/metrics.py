"""Prometheus metrics of servers and workers over HTTP, when ``KVSTORE_METRICS_PORT`` is set.

This module defines the metric families and starts the endpoint; the server and the client
count into the objects it returns (:class:`ServerMetrics`, :class:`WorkerMetrics`).

**Port rule.** With ``KVSTORE_METRICS_PORT=P`` (P > 0), server I listens on port ``P + I`` and
worker R on ``P + S + R``, where S is the number of servers (the server's ``--num-servers``; a
worker counts ``KVSTORE_SERVERS``). So one value serves a whole job, ``kvstore-launch`` on one
host included, and every process of a job has a port of its own wherever it runs (a ``local``
store counts its in-process server, which has no endpoint: the worker is on ``P + 1``). With
``P = 0`` every process picks a free port; each process logs its URL at INFO on the
``kvstore.metrics`` logger, and a program reads it from ``ShardServer.metrics_port`` or
``KVStore.metrics_port``. The endpoint binds ``KVSTORE_METRICS_ADDR``, by default ``127.0.0.1``
(it has no authentication: see :data:`kvstore.config.DEFAULT_METRICS_ADDR`). A worker's
endpoint closes with its store.

**Cost.** Without the variable nothing here runs: ``prometheus_client`` (the ``metrics`` extra)
is not imported, no thread starts, and the server and the worker compare an attribute with None
once or twice per message. With it, a message costs two additions to plain ints (per-op
traffic, written by one thread only: the server's event loop, the worker's I/O thread), which
are turned into counters when scraped; queue depths and the compression ratio are read only
when scraped; and a worker measures each key's quality signals on one push in
``KVSTORE_METRICS_EVERY``. Each endpoint has a private
:class:`~prometheus_client.CollectorRegistry`, so stores and servers in one process never share
(or collide on) metrics.

Metrics. ``op`` is the request's operation in lower case (``hello``, ``init``, ``push``,
``pull``, ``pushpull``, ``barrier``, ``set_optimizer``, ``bye``; ``invalid`` for a message that
failed validation, and on a worker for a reply to no request it waits for); a reply counts under
the op of the request it answers. Bytes are those of
all of a message's frames (header and payloads; not the server's routing id).

Servers, label ``server`` (I):

- ``kvstore_server_received_messages_total``, ``kvstore_server_received_bytes_total``
  (counters; ``op``): requests received.
- ``kvstore_server_sent_messages_total``, ``kvstore_server_sent_bytes_total`` (counters;
  ``op``): replies sent (values, acks and errors).
- ``kvstore_server_round_duration_seconds`` (histogram): a chunk's ``dist_sync`` round, from
  its first push to its completion (``dist_async`` has no rounds).
- ``kvstore_server_errors_total`` (counter; ``code``, the :class:`~kvstore.errors.ErrorCode`
  values): ERROR replies sent.
- ``kvstore_server_queue_depth`` (gauge; ``queue``, see :data:`SERVER_QUEUES`): requests
  waiting.

Workers, label ``rank`` (R):

- ``kvstore_worker_sent_messages_total``, ``kvstore_worker_sent_bytes_total`` (counters;
  ``op``): requests handed to ZeroMQ.
- ``kvstore_worker_received_messages_total``, ``kvstore_worker_received_bytes_total``
  (counters; ``op``): replies received.
- ``kvstore_worker_push_bytes_total``, ``kvstore_worker_push_dense_bytes_total`` (counters):
  bytes of push and pushpull messages, and of the uncompressed values they carry, as
  :meth:`KVStore.stats` reports them (counted when a push is queued).
- ``kvstore_worker_compression_ratio`` (gauge): the second over the first, over the job (1
  before any push; about 16 for 2-bit).
- ``kvstore_worker_residual_norm_ratio`` (gauge; ``key``): ``||residual|| / ||gradient||``
  after the key's last measured push: what error feedback carries over, relative to what was
  pushed (0 for codecs without a residual).
- ``kvstore_worker_sent_density`` (gauge; ``key``): the fraction of the key's elements that its
  last measured push sent nonzero.
- ``kvstore_worker_queue_depth`` (gauge; ``queue``, see :data:`WORKER_QUEUES`): requests
  waiting.
- ``kvstore_worker_remote_errors_total`` (counter; ``code``, ``other`` for a code this version
  does not know): ERROR replies received.

This module depends on nothing in the package but :mod:`kvstore.errors`, :mod:`kvstore.config`
and :mod:`kvstore.wire`.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kvstore.config import MetricsConfig
from kvstore.errors import ConfigError, ErrorCode
from kvstore.wire import Op, buffer_nbytes

logger = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "pskv[metrics]"'

ROUND_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
)  # fmt: skip
"""Bucket bounds of the round histogram, seconds: a small chunk's round on loopback takes about
0.1 ms, a round that waits for a straggling worker seconds."""

SERVER_QUEUES: dict[str, str] = {
    "round_pushes": "pushes in rounds that wait for other workers' pushes",
    "deferred_pushes": "a worker's next pushes of a chunk, waiting for the current round to end",
    "pull_waiters": "pulls waiting for their worker's pushes to be applied",
    "init_waiters": "inits waiting for rank 0's value",
    "collective_waiters": "barrier and set_optimizer calls waiting for the other workers",
    "tasks": "chunk work waiting for the thread pool or its chunk's turn",
}
"""The server's ``queue`` label values and what each counts."""

WORKER_QUEUES: dict[str, str] = {
    "outstanding": "requests queued or sent and not yet answered",
    "unsent": "messages in the transport's queues, not yet handed to ZeroMQ",
}
"""The worker's ``queue`` label values and what each counts."""

QueueDepths = Callable[[], Mapping[str, int]]
"""Returns the current depth of each queue; called on the endpoint's thread when scraped."""

_REQUEST_OPS = (
    Op.HELLO,
    Op.INIT,
    Op.PUSH,
    Op.PULL,
    Op.PUSHPULL,
    Op.BARRIER,
    Op.SET_OPTIMIZER,
    Op.BYE,
    Op.SAVE,
    Op.LOAD,
)
_INVALID = 0  # the traffic slot of messages without a known op (no Op has the value 0)
_OP_LABELS = {int(op): op.name.lower() for op in Op} | {_INVALID: "invalid"}
_ERROR_CODES = tuple(code.value for code in ErrorCode)


def _prometheus() -> Any:
    """``prometheus_client``, imported on first use (an optional dependency)."""
    try:
        import prometheus_client  # noqa: PLC0415
        import prometheus_client.core  # noqa: F401, PLC0415  (the custom-collector families)
    except ImportError:
        raise ConfigError(
            f"KVSTORE_METRICS_PORT is set but prometheus_client is not installed: "
            f"{INSTALL_HINT}, or unset KVSTORE_METRICS_PORT"
        ) from None
    return prometheus_client


def endpoint_port(config: MetricsConfig, offset: int, who: str) -> int:
    """The port rule: ``P + offset`` (``I`` for server I, ``S + R`` for worker R); 0 for P = 0.

    Raises:
        ConfigError: the port would be beyond 65535.
    """
    if config.port == 0:
        return 0
    port = config.port + offset
    if port > 65535:
        raise ConfigError(
            f"KVSTORE_METRICS_PORT={config.port}: {who} would listen on port {port}, beyond "
            f"65535 (server I listens on P + I, worker R on P + S + R); choose a lower P"
        )
    return port


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Bytes of a message's frames."""
    return sum(buffer_nbytes(frame) for frame in frames)


class _Traffic:
    """Messages and bytes per op, counted by one thread and read when scraped.

    One writer thread means plain ints lose no update and need no lock (a prometheus_client
    counter takes one per increment); the scrape reads them as they are.
    """

    __slots__ = ("messages", "bytes")

    def __init__(self) -> None:
        size = max(_OP_LABELS) + 1
        self.messages = [0] * size
        self.bytes = [0] * size

    def add(self, op: Op | None, nbytes: int) -> None:
        slot = _INVALID if op is None else op
        self.messages[slot] += 1
        self.bytes[slot] += nbytes

    def families(self, prom: Any, prefix: str, labels: tuple[str, str]) -> Iterator[Any]:
        """The message and byte counters, one sample per request op (and ``invalid`` once seen)."""
        name, value = labels
        direction = prefix.rsplit("_", 1)[1]  # "sent" or "received"
        messages = prom.core.CounterMetricFamily(
            f"{prefix}_messages", f"Messages {direction}, by op.", labels=[name, "op"]
        )
        nbytes = prom.core.CounterMetricFamily(
            f"{prefix}_bytes",
            f"Bytes of the messages {direction} (all frames), by op.",
            labels=[name, "op"],
        )
        counts, sizes = list(self.messages), list(self.bytes)
        slots = [int(op) for op in _REQUEST_OPS] + ([_INVALID] if counts[_INVALID] else [])
        for slot in slots:
            messages.add_metric([value, _OP_LABELS[slot]], counts[slot])
            nbytes.add_metric([value, _OP_LABELS[slot]], sizes[slot])
        yield messages
        yield nbytes


class _Collector:
    """A custom collector: ``build()`` yields metric families when scraped.

    A failing ``build`` (state torn down under the scrape) leaves its families out of that
    scrape instead of failing it.
    """

    def __init__(self, build: Callable[[], Iterator[Any]]) -> None:
        self._build = build

    def collect(self) -> Iterator[Any]:
        try:
            families = list(self._build())
        except Exception:
            logger.warning("collecting metrics failed; this scrape leaves them out", exc_info=True)
            return iter(())
        return iter(families)

    def describe(self) -> list[Any]:
        return []  # registering must not call collect(): the state may not be complete yet


def _queue_family(
    prom: Any, name: str, queues: Mapping[str, str], labels: tuple[str, str], depths: QueueDepths
) -> Any:
    label, value = labels
    family = prom.core.GaugeMetricFamily(
        name,
        "Requests waiting, by queue: " + "; ".join(f"{q}: {m}" for q, m in queues.items()) + ".",
        labels=[label, "queue"],
    )
    current = depths()
    for queue in queues:
        family.add_metric([value, queue], current.get(queue, 0))
    return family


class _Endpoint:
    """A registry served over HTTP by a daemon thread of its own."""

    def __init__(
        self, prom: Any, registry: Any, config: MetricsConfig, offset: int, who: str
    ) -> None:
        port = endpoint_port(config, offset, who)
        try:
            self._server, self._thread = prom.start_http_server(
                port, addr=config.addr, registry=registry
            )
        except OSError as exc:
            rule = "server I listens on P + I, worker R on P + S + R"
            raise OSError(
                f"{who} cannot serve metrics on {config.addr}:{port} (KVSTORE_METRICS_PORT="
                f"{config.port}: {rule}; 0 picks free ports): {exc}"
            ) from exc
        self._thread.name = f"kvstore-metrics ({who})"
        self.port: int = self._server.server_port
        host = config.addr
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        elif ":" in host:
            host = f"[{host}]"
        self.url = f"http://{host}:{self.port}/metrics"
        logger.info("%s serves Prometheus metrics on %s", who, self.url)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()  # releases the port at once
        self._thread.join()


class ServerMetrics:
    """A shard server's metrics and their endpoint, started by the constructor.

    Every method but :meth:`watch_queues` and :meth:`close` runs on the server's event loop.

    Args:
        config: the endpoint's settings.
        server_rank: I, the ``server`` label; the endpoint listens on ``P + I``.

    Raises:
        ConfigError: prometheus_client is missing, or the port would be out of range.
        OSError: the port cannot be bound.
    """

    def __init__(self, config: MetricsConfig, server_rank: int) -> None:
        prom = _prometheus()
        self._prom = prom
        self._label = ("server", str(server_rank))
        self._received = _Traffic()
        self._sent = _Traffic()
        self._queue_depths: QueueDepths | None = None
        registry = prom.CollectorRegistry()
        errors = prom.Counter(
            "kvstore_server_errors",
            "ERROR replies sent, by error code.",
            ["server", "code"],
            registry=registry,
        )
        self._errors = {code: errors.labels(self._label[1], code) for code in _ERROR_CODES}
        self._round = prom.Histogram(
            "kvstore_server_round_duration_seconds",
            "Duration of a chunk's dist_sync round, from its first push to its completion.",
            ["server"],
            buckets=ROUND_BUCKETS,
            registry=registry,
        ).labels(self._label[1])
        registry.register(_Collector(self._collect))
        self._endpoint = _Endpoint(prom, registry, config, server_rank, f"server {server_rank}")

    @property
    def port(self) -> int:
        """The port the endpoint listens on."""
        return self._endpoint.port

    def received(self, op: Op | None, nbytes: int) -> None:
        """Count a request (``op`` None: it failed validation)."""
        self._received.add(op, nbytes)

    def sent(self, op: Op | None, nbytes: int) -> None:
        """Count a reply to a request of ``op``."""
        self._sent.add(op, nbytes)

    def error(self, code: str) -> None:
        """Count an ERROR reply (``code``: an :class:`~kvstore.errors.ErrorCode`)."""
        child = self._errors.get(code)
        if child is not None:
            child.inc()

    def round_done(self, seconds: float) -> None:
        """Record a completed round's duration."""
        self._round.observe(seconds)

    def watch_queues(self, depths: QueueDepths) -> None:
        """Report ``depths()`` (keys of :data:`SERVER_QUEUES`) as the queue gauges."""
        self._queue_depths = depths

    def _collect(self) -> Iterator[Any]:
        yield from self._received.families(self._prom, "kvstore_server_received", self._label)
        yield from self._sent.families(self._prom, "kvstore_server_sent", self._label)
        if self._queue_depths is not None:
            yield _queue_family(
                self._prom,
                "kvstore_server_queue_depth",
                SERVER_QUEUES,
                self._label,
                self._queue_depths,
            )

    def close(self) -> None:
        """Stop the endpoint and release its port."""
        self._endpoint.close()


class WorkerMetrics:
    """A worker's metrics and their endpoint, started by the constructor.

    :meth:`sent`, :meth:`received` and :meth:`remote_error` run on the transport's I/O
    thread, :meth:`key_quality` on the thread that pushes.

    Args:
        config: the endpoint's settings.
        rank: R, the ``rank`` label.
        num_servers: S; the endpoint listens on ``P + S + R``.

    Raises:
        ConfigError: prometheus_client is missing, or the port would be out of range.
        OSError: the port cannot be bound.
    """

    def __init__(self, config: MetricsConfig, rank: int, num_servers: int) -> None:
        prom = _prometheus()
        self._prom = prom
        self.every = config.every
        self._label = ("rank", str(rank))
        self._sent = _Traffic()
        self._received = _Traffic()
        self._pushes: Callable[[], tuple[int, int]] | None = None
        self._queue_depths: QueueDepths | None = None
        registry = prom.CollectorRegistry()
        errors = prom.Counter(
            "kvstore_worker_remote_errors",
            "ERROR replies received from servers, by error code ('other': a code this version "
            "does not know).",
            ["rank", "code"],
            registry=registry,
        )
        self._errors = {code: errors.labels(self._label[1], code) for code in _ERROR_CODES}
        self._other_error = errors.labels(self._label[1], "other")
        self._residual = prom.Gauge(
            "kvstore_worker_residual_norm_ratio",
            "||residual|| / ||gradient|| of a key after its last measured push (what error "
            "feedback carries over, relative to what was pushed; 0 for codecs without a "
            "residual).",
            ["rank", "key"],
            registry=registry,
        )
        self._density = prom.Gauge(
            "kvstore_worker_sent_density",
            "Fraction of a key's elements that its last measured push sent nonzero.",
            ["rank", "key"],
            registry=registry,
        )
        registry.register(_Collector(self._collect))
        self._endpoint = _Endpoint(prom, registry, config, num_servers + rank, f"worker {rank}")

    @property
    def port(self) -> int:
        """The port the endpoint listens on."""
        return self._endpoint.port

    def sent(self, op: Op, nbytes: int) -> None:
        """Count a request handed to ZeroMQ."""
        self._sent.add(op, nbytes)

    def received(self, op: Op | None, nbytes: int) -> None:
        """Count a reply to a request of ``op`` (None: unknown request, or invalid)."""
        self._received.add(op, nbytes)

    def remote_error(self, code: str) -> None:
        """Count an ERROR reply."""
        child = self._errors.get(code)
        (child if child is not None else self._other_error).inc()

    def measure(self, pushes: int) -> bool:
        """Whether the push of a key that already pushed ``pushes`` times is measured."""
        return pushes % self.every == 0

    def key_quality(
        self, key: Any, gradient_sq: float, residual_sq: float, sent_nonzero: int, numel: int
    ) -> None:
        """Record a measured push of ``key``: the squared norms of its gradient and of the
        residual left after it, and how many of its ``numel`` elements it sent nonzero.

        A zero gradient gives a ratio of 0 when the residual is zero too, else +Inf.
        """
        label = str(key)
        if gradient_sq > 0:
            ratio = math.sqrt(residual_sq / gradient_sq)
        else:
            ratio = 0.0 if residual_sq == 0 else math.inf
        self._residual.labels(self._label[1], label).set(ratio)
        if numel:
            self._density.labels(self._label[1], label).set(sent_nonzero / numel)

    def watch(self, pushes: Callable[[], tuple[int, int]], depths: QueueDepths) -> None:
        """Report ``pushes()`` (bytes pushed, their uncompressed bytes) as the push counters and
        the compression ratio, and ``depths()`` (keys of :data:`WORKER_QUEUES`) as the queue
        gauges."""
        self._pushes = pushes
        self._queue_depths = depths

    def _collect(self) -> Iterator[Any]:
        prom, (label, value) = self._prom, self._label
        yield from self._sent.families(prom, "kvstore_worker_sent", self._label)
        yield from self._received.families(prom, "kvstore_worker_received", self._label)
        if self._pushes is not None:
            pushed, dense = self._pushes()
            for name, doc, amount in (
                ("push_bytes", "Bytes of push and pushpull messages (all frames).", pushed),
                ("push_dense_bytes", "Uncompressed bytes of the values pushed.", dense),
            ):
                family = prom.core.CounterMetricFamily(
                    f"kvstore_worker_{name}", doc, labels=[label]
                )
                family.add_metric([value], amount)
                yield family
            ratio = prom.core.GaugeMetricFamily(
                "kvstore_worker_compression_ratio",
                "Uncompressed bytes of the values pushed over the bytes pushed, over the job "
                "(1 before any push).",
                labels=[label],
            )
            ratio.add_metric([value], dense / pushed if pushed else 1.0)
            yield ratio
        if self._queue_depths is not None:
            yield _queue_family(
                prom, "kvstore_worker_queue_depth", WORKER_QUEUES, self._label, self._queue_depths
            )

    def close(self) -> None:
        """Stop the endpoint and release its port."""
        self._endpoint.close()


__all__ = [
    "INSTALL_HINT",
    "ROUND_BUCKETS",
    "SERVER_QUEUES",
    "WORKER_QUEUES",
    "ServerMetrics",
    "WorkerMetrics",
    "endpoint_port",
    "frames_nbytes",
]
