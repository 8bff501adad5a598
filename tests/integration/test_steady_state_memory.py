"""A warm training loop holds on to nothing per step: no requests, no pull targets.

Each step of a long job makes new requests (one per chunk) and often a new ``out`` array; if
anything kept them, a job's memory would grow with its steps (gigabytes for a model pulled into
fresh tensors). These tests run steps against real servers (processes, or ``local`` mode's
in-process one) and count what is still alive and what a step allocates.
"""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import numpy as np
import pytest
from kvtest import connect

import kvstore
from kvstore.worker.request import Request
from kvstore.worker.transport import EXPRESS_BYTES

pytestmark = pytest.mark.integration

N = 1_000_000  # 4 MB: 16 chunks per server with 512 KiB partitions (128 KiB each on 2 servers)
PARTITION_BYTES = 512 * 1024  # chunks above the transport's EXPRESS_BYTES: windowed, bulk
STEPS = 12


def _live_requests() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is Request)


@pytest.mark.parametrize("lead", ["0", "3"], ids=["no-lead-limit", "lead-limit"])
@pytest.mark.parametrize("call", ["push+pull", "pushpull"])
def test_steps_keep_no_requests_or_pull_targets_alive(servers_factory, monkeypatch, lead, call):
    # Jobs of 1-2 workers run without a lead limit, larger ones with one (KVSTORE_PUSH_LEAD).
    monkeypatch.setenv("KVSTORE_PUSH_LEAD", lead)
    addresses = servers_factory(2, 1)
    with connect(addresses, 0, 1, partition_bytes=PARTITION_BYTES) as kv:
        kv.set_optimizer("sgd", learning_rate=0.1)
        kv.init("k", np.zeros(N, np.float32))
        chunks = len(kv._shared.keys["k"].chunks)
        assert chunks >= 16 and N * 4 // chunks > EXPRESS_BYTES
        grad = np.ones(N, np.float32)
        targets: list[weakref.ref] = []

        def step() -> None:
            out = np.empty(N, np.float32)  # a new target every step, as with fresh tensors
            if call == "pushpull":
                kv.pushpull("k", grad, out=out)
            else:
                kv.push("k", grad)
                kv.pull("k", out=out)
            targets.append(weakref.ref(out))

        for _ in range(3):
            step()
        before = _live_requests()
        for _ in range(STEPS):
            step()
        after = _live_requests()  # (collects first: the targets below are then settled too)
        alive = [i for i, ref in enumerate(targets) if ref() is not None]
        final = np.empty(N, np.float32)
        kv.pull("k", out=final)

    # the values are right: 15 SGD steps of lr 0.1 on a gradient of 1
    np.testing.assert_allclose(final, np.full(N, -1.5, np.float32), rtol=1e-5)
    # Not even the last step's: the client keeps each chunk's last push until the next step,
    # but not what its completion wrote into.
    assert not alive, f"the pull targets of steps {alive} are still alive"
    # Anything that grows with the steps is a leak (STEPS x chunks requests were made).
    assert after - before < chunks, (
        f"{after - before} more live requests after {STEPS} steps of {chunks} chunks"
    )


@pytest.mark.parametrize("compression", ["none", "2bit"])
@pytest.mark.parametrize("call", ["push+pull", "pushpull"])
def test_a_warm_step_allocates_no_buffers(compression, call):
    """Once warm, a step allocates no array on the worker or the server: ``local`` runs the
    real server in this process, and tracemalloc sees numpy's allocations (ZeroMQ's receive
    buffers are libzmq's own, reused through the malloc tuning, and not counted here)."""
    with kvstore.create("local", partition_bytes=PARTITION_BYTES) as kv:
        if compression == "2bit":
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.set_optimizer("sgd", learning_rate=0.1, momentum=0.9)
        kv.init("k", np.zeros(N, np.float32))
        smallest_chunk = min(chunk.numel for chunk in kv._shared.keys["k"].chunks) * 4
        grad = np.random.default_rng(0).standard_normal(N).astype(np.float32)
        out = np.empty(N, np.float32)

        def step() -> None:
            if call == "pushpull":
                kv.pushpull("k", grad, out=out)
            else:
                kv.push("k", grad)
                kv.pull("k", out=out)

        tracemalloc.start()
        try:
            for _ in range(3):
                step()
            tracemalloc.reset_peak()
            start, _ = tracemalloc.get_traced_memory()
            for _ in range(STEPS):
                step()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # What a step holds at its peak is its requests and headers (tens of KB for these 16
    # chunks); one buffer of a chunk's size, let alone of the key's, would exceed this.
    assert peak - start < smallest_chunk // 2, (
        f"a warm step allocated up to {peak - start} bytes (smallest chunk {smallest_chunk})"
    )
