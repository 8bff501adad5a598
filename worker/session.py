"""A worker's session with the servers: the handshake that joins the job, and the goodbyes.

Every lane of every server gets a HELLO (rank, job shape, mode, lane, the largest chunk), and a
server refuses a worker that does not fit its job; a worker that some servers took and another
refused says goodbye to those that took it, so they do not hold its rank. At ``close`` every
lane gets a BYE, so the servers release the rank at once instead of after their heartbeat
timeout.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

from kvstore.errors import ConfigError, ConnectionLostError, KVStoreError, KVStoreTimeoutError
from kvstore.wire import LANE_CONTROL, LANE_DATA, ByeFields, HelloFields
from kvstore.worker.request import Deadline, Request, wait_all
from kvstore.worker.store_state import StoreState
from kvstore.worker.transport import Transport

logger = logging.getLogger(__name__)


def handshake(store: StoreState, servers: Sequence[str]) -> None:
    """Join the job on every server (``servers``: their addresses, in rank order), within
    ``KVSTORE_CONNECT_TIMEOUT``.

    Raises:
        ConfigError: a server's host name does not resolve here.
        ConnectionLostError: a server did not answer.
        KVStoreError: a server refused this worker (the server's error).
    """
    check_host_names(servers)
    transport = store.transport
    timeout = store.options.connect_timeout
    replicas = store.options.replicas

    def hello(server: int, lane: int) -> HelloFields:
        return HelloFields(
            rank=store.rank,
            num_workers=store.num_workers,
            num_servers=store.num_servers,
            server_rank=server,
            mode=store.mode,
            lane=lane,
            # the server refuses us here if our chunks could exceed its message limit
            partition_bytes=store.options.partition_bytes,
            pushers_per_host=store.workers_per_push if store.workers_per_push > 1 else None,
            # with replication: where each server's backups are
            replicas=replicas if replicas > 1 else None,
            servers=list(servers) if replicas > 1 else None,
        )

    transport.hello = hello  # (a lost server's replacement is greeted with it)
    requests = [
        transport.submit(
            server,
            hello(server, lane),
            what=f"handshake with server {server} ({address})",
            lane=lane,
        )
        for server, address in enumerate(servers)
        for lane in (LANE_DATA, LANE_CONTROL)
    ]
    try:
        wait_all(requests, timeout)
    except KVStoreTimeoutError:
        _leave_after_refusal(transport, requests)
        silent = [r.server for r in requests if not r.done()]
        addresses = ", ".join(servers[s] for s in silent)
        raise ConnectionLostError(
            f"server(s) {silent} ({addresses}) did not answer within {timeout} s "
            f"(KVSTORE_CONNECT_TIMEOUT): are they running? `kvstore-launch` starts them"
        ) from None
    except KVStoreError:
        _leave_after_refusal(transport, requests)
        raise


def check_host_names(servers: Sequence[str]) -> None:
    """Raise ``ConfigError`` if the host name of a ``tcp://`` address does not resolve here.

    ZeroMQ resolves a name when it connects and, when that fails, retries in silence, so
    without this a worker given a name its resolver does not know (a Slurm node name outside
    the cluster's DNS, a typo) would wait out ``KVSTORE_CONNECT_TIMEOUT`` and then blame the
    server. A temporary failure of the resolver (``EAI_AGAIN``) is left to those retries.
    """
    for rank, address in enumerate(servers):
        if not address.startswith("tcp://"):
            continue
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        host = host.strip("[]")  # (an IPv6 literal)
        try:
            socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_AGAIN:
                continue
            raise ConfigError(
                f"server {rank} ({address}, from KVSTORE_SERVERS): the host name {host!r} does "
                f"not resolve on this machine ({exc.strerror}); give the servers' addresses as "
                f"names this host can look up (its /etc/hosts or DNS) or as IP addresses"
            ) from None


def _leave_after_refusal(transport: Transport, hellos: list[Request]) -> None:
    """Say goodbye where a HELLO was accepted although another server refused us, so that
    those servers do not hold this rank for a worker that is not coming (a replacement
    that retries before every server released its predecessor's rank)."""
    # (the HELLOs are per server, data lane then control lane: see handshake)
    lanes = [(r.server, (LANE_DATA, LANE_CONTROL)[i % 2]) for i, r in enumerate(hellos)]
    byes = [
        transport.submit(server, ByeFields(), what="goodbye", lane=lane)
        for (server, lane), hello in zip(lanes, hellos, strict=True)
        if hello.done() and not hello.failed()
    ]
    try:
        wait_all(byes, timeout=1.0)
    except KVStoreError as exc:
        logger.debug("goodbye after a refused handshake not acknowledged: %s", exc)


def say_goodbye(store: StoreState, deadline: Deadline) -> None:
    """Say goodbye on every lane of every server (at the end of ``close``); a goodbye that is
    not acknowledged is only logged."""
    try:
        byes = [
            store.transport.submit(s, ByeFields(), what="goodbye", lane=lane)
            for s in range(store.num_servers)
            for lane in (LANE_DATA, LANE_CONTROL)
        ]
        # At most 5 s, and within KVSTORE_TIMEOUT give or take a moment to send them: a
        # server that misses a goodbye releases the rank after KVSTORE_HEARTBEAT_TIMEOUT.
        remaining = deadline.remaining()
        wait_all(byes, timeout=5.0 if remaining is None else min(5.0, max(remaining, 0.2)))
    except KVStoreError as exc:
        logger.debug("goodbye not acknowledged: %s", exc)
