"""Bare pyzmq on the shaped cluster: the transport ceiling of a configuration, in the same run.

The emulated hosts share this machine's cores, the kernel's networking included, so a cell can
be slower than its wire floor because the machine cannot move its bytes any faster, whatever
runs on top. This baseline measures that: processes placed like kvstore's on the same hosts
move the same bytes as kvstore's dense push+pull, cut into the same chunks
(:func:`kvstore.topology.plan_chunks` with the defaults the workers use) and sent to the same
servers in the same interleaved order, with nothing else. A worker sends every chunk of every
key (backward order) as one message, a 4-byte chunk number and the chunk's fp32 bytes, without
copying; a server answers a chunk to every worker as soon as all N sent it, with the last copy
it received (no decode, no sum, no optimizer); a worker copies each answer into its output
array (as a pull does). There is no send window: ZeroMQ queues everything at once (unbounded
queues on both sides).

So ``kvstore over_floor / zmq over_floor`` in one run is what kvstore's own work costs on top of
moving the bytes (its encode copy, the servers' sums and optimizer, its Python, its flow
control), and a bare cell far above its floor says the machine, not kvstore, set the pace there.

Roles of ``bench_cluster.py`` (``--role bare-server`` / ``bare-worker``); the orchestration is
``bench_cluster.run_bare``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

BARRIER = b"barrier"
"""A worker's message that ends when every worker sent one (the header of a barrier)."""


def _socket(ctx: Any, kind: int) -> Any:
    """A socket with unbounded queues (as the loopback bare baseline of ``bench_pushpull.py``)."""
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def bare_server(host: str, workers: int) -> None:
    """Answer each chunk (and each barrier) to every worker once all ``workers`` sent it; runs
    until the orchestrator stops it."""
    import zmq

    from kvstore._malloc import tune_malloc

    tune_malloc()  # kvstore's malloc tuning, as in kvstore's processes
    ctx = zmq.Context()
    sock = _socket(ctx, zmq.ROUTER)
    port = sock.bind_to_random_port(f"tcp://{host}")
    print(f"KVSTORE_READY tcp://{host}:{port}", flush=True)
    arrived: dict[bytes, list[bytes]] = {}
    while True:
        identity, header, *payload = sock.recv_multipart(copy=False)
        name = header.bytes
        senders = arrived.setdefault(name, [])
        senders.append(identity.bytes)
        if len(senders) == workers:  # the chunk's "round" is complete
            del arrived[name]
            for sender in senders:
                sock.send_multipart([sender, header, *payload], copy=False)


def bare_worker(
    addresses: list[str], workload: list[tuple[str, tuple[int, ...]]]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Connect to every server (one context, as a kvstore worker has); returns
    ``(barrier, step)`` for ``bench_cluster.timed_steps``."""
    import numpy as np
    import zmq

    from kvstore._malloc import tune_malloc
    from kvstore.config import DEFAULT_BIGARRAY_BOUND, DEFAULT_PARTITION_BYTES
    from kvstore.topology import interleaved_order, partition_elems_for, plan_chunks

    tune_malloc()
    ctx = zmq.Context()
    socks = []
    for address in addresses:
        sock = _socket(ctx, zmq.DEALER)
        sock.connect(address)
        socks.append(sock)
    grads = {key: np.ones(math.prod(shape), np.float32) for key, shape in workload}
    outs = {key: np.empty_like(grad) for key, grad in grads.items()}
    messages = []  # (socket, header, payload), in send order
    landing: dict[bytes, Any] = {}  # header -> where its answer goes
    for key, grad in reversed(grads.items()):  # backward order, as the kvstore workers push
        chunks = plan_chunks(
            key,
            grad.size,
            len(socks),
            bigarray_bound=DEFAULT_BIGARRAY_BOUND,
            partition_elems=partition_elems_for(DEFAULT_PARTITION_BYTES, 4),
        )
        for chunk in interleaved_order(chunks):  # as the kvstore client sends them
            header = len(landing).to_bytes(4, "little")
            messages.append((socks[chunk.server], header, grad[chunk.start : chunk.stop]))
            landing[header] = outs[key][chunk.start : chunk.stop]
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)

    def barrier() -> None:
        socks[0].send(BARRIER)
        socks[0].recv()

    def step() -> None:
        for sock, header, payload in messages:
            sock.send_multipart([header, payload], copy=False)
        pending = len(messages)
        while pending:
            for sock, _ in poller.poll():
                while pending:
                    try:
                        header, payload = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    landing[header.bytes][:] = np.frombuffer(payload.buffer, np.float32)
                    pending -= 1

    return barrier, step
