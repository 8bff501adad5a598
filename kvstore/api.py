"""``kvstore.create``: the factory over the store modes."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvstore import _logging
from kvstore.config import ClusterConfig, WorkerOptions
from kvstore.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from kvstore.worker.client import KVStore

MODES: tuple[str, ...] = ("dist_sync", "dist_async", "local")
"""The store types :func:`create` accepts."""


def _cluster(
    env: Mapping[str, str],
    servers: Sequence[str] | str | None,
    rank: int | None,
    num_workers: int | None,
    local_rank: int | None = None,
    local_size: int | None = None,
) -> ClusterConfig:
    given = (servers, rank, num_workers, local_rank, local_size)
    if all(value is None for value in given):
        return ClusterConfig.from_env(env)
    merged = dict(env)
    if local_rank is not None:
        merged["KVSTORE_LOCAL_RANK"] = str(local_rank)
    if local_size is not None:
        merged["KVSTORE_LOCAL_SIZE"] = str(local_size)
    if servers is not None:
        merged["KVSTORE_SERVERS"] = servers if isinstance(servers, str) else ",".join(servers)
    if rank is not None:
        merged["KVSTORE_RANK"] = str(rank)
    if num_workers is not None:
        merged["KVSTORE_NUM_WORKERS"] = str(num_workers)
    return ClusterConfig.from_env(merged)


def create(
    name: str = "local",
    *,
    servers: Sequence[str] | str | None = None,
    rank: int | None = None,
    num_workers: int | None = None,
    timeout: float | None = None,
    connect_timeout: float | None = None,
    bigarray_bound: int | None = None,
    partition_bytes: int | None = None,
    pull_relay: bool | None = None,
    heartbeat_timeout: float | None = None,
    local_rank: int | None = None,
    local_size: int | None = None,
    hierarchy: bool | None = None,
    replicas: int | None = None,
) -> KVStore:
    """Create a store and connect it to its servers.

    ``dist_sync`` and ``dist_async`` read the worker's place in the job from ``KVSTORE_SERVERS``,
    ``KVSTORE_RANK`` and ``KVSTORE_NUM_WORKERS`` (set by ``kvstore-launch``); the keyword
    arguments override them. Under ``torchrun``, its ``RANK`` and ``WORLD_SIZE`` stand in for
    ``KVSTORE_RANK`` and ``KVSTORE_NUM_WORKERS`` where those are not set (the ``KVSTORE_`` ones
    win), so only ``KVSTORE_SERVERS`` is needed. ``local`` needs no environment: it starts an
    in-process server.

    It also routes the ``kvstore`` loggers (role ``worker R``), keeping an application's own
    logging setup: see :func:`kvstore._logging.configure_worker` for the rule and
    ``KVSTORE_LOG_LEVEL``.

    Args:
        name: ``"dist_sync"``, ``"dist_async"`` or ``"local"``.
        servers: server addresses in rank order (overrides ``KVSTORE_SERVERS``).
        rank: this worker's rank (overrides ``KVSTORE_RANK`` and ``RANK``).
        num_workers: N (overrides ``KVSTORE_NUM_WORKERS`` and ``WORLD_SIZE``).
        timeout: longest wait of a blocking call, seconds (overrides ``KVSTORE_TIMEOUT``).
        connect_timeout: longest wait for the servers' handshake (``KVSTORE_CONNECT_TIMEOUT``).
        bigarray_bound: split keys of at least this many elements (``KVSTORE_BIGARRAY_BOUND``).
        partition_bytes: largest message payload (``KVSTORE_PARTITION_BYTES``).
        pull_relay: take relayed pulls of compressed rounds (``KVSTORE_PULL_RELAY``).
        heartbeat_timeout: a server silent this long is lost, 0: never
            (``KVSTORE_HEARTBEAT_TIMEOUT``; the servers read their own).
        local_rank: this worker's rank among its host's workers (overrides
            ``KVSTORE_LOCAL_RANK`` and ``LOCAL_RANK``).
        local_size: k, the workers on each host (overrides ``KVSTORE_LOCAL_SIZE`` and
            ``LOCAL_WORLD_SIZE``).
        hierarchy: with k > 1, aggregate on the host first (``KVSTORE_HIERARCHY``).
        replicas: R, the servers holding each shard (``KVSTORE_REPLICAS``; the servers must
            have the same).

    Raises:
        ValueError: unknown ``name`` (the message lists the valid ones).
        ConfigError: a missing or malformed setting, naming the variable.
        ConnectionLostError: a server did not answer the handshake in time.

    Example::

        kv = kvstore.create("dist_sync")
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init("w", weights)
        kv.push("w", grad)
        kv.pull("w", out=weights)
    """
    from kvstore.worker.client import KVStore  # noqa: PLC0415  (workers only)

    if not isinstance(name, str):
        raise TypeError(f"expected str for `name`, got {type(name).__name__}")
    mode = name.lower()
    if mode not in MODES:
        raise ValueError(
            f"unknown kvstore type {name!r}{did_you_mean([name], MODES)}; "
            f"valid types: {', '.join(MODES)}"
        )
    options = WorkerOptions.from_env(
        os.environ,
        timeout=timeout,
        connect_timeout=connect_timeout,
        bigarray_bound=bigarray_bound,
        partition_bytes=partition_bytes,
        pull_relay=pull_relay,
        heartbeat_timeout=heartbeat_timeout,
        hierarchy=hierarchy,
        replicas=replicas,
    )
    if mode == "local":
        if servers is not None or (num_workers not in (None, 1)) or rank not in (None, 0):
            raise ConfigError("the local mode runs one worker (rank 0) with its own server")
        _logging.configure_worker("worker 0")
        return _create_local(options)
    cluster = _cluster(os.environ, servers, rank, num_workers, local_rank, local_size)
    # Before the store connects, so that its first records already go where they should.
    _logging.configure_worker(f"worker {cluster.rank}")
    return KVStore(mode, cluster, options)


def _create_local(options: WorkerOptions) -> KVStore:
    import zmq  # noqa: PLC0415

    from kvstore.local import LocalServerThread  # noqa: PLC0415
    from kvstore.worker.client import KVStore  # noqa: PLC0415

    context: zmq.Context[Any] = zmq.Context()
    server = LocalServerThread(context)

    def stop() -> None:
        server.stop()
        context.term()

    cluster = ClusterConfig(servers=(server.address,), rank=0, num_workers=1)
    # No heartbeats: the server lives in this process, so it cannot be lost on its own.
    options = replace(options, heartbeat_timeout=0.0)
    try:
        return KVStore("local", cluster, options, context=context, on_close=stop)
    except BaseException:
        stop()
        raise
