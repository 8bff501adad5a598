"""Relayed pulls against real servers: the same bits as dense pulls, a fraction of the bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from kvtest import run_ranks

import kvstore

pytestmark = pytest.mark.integration

WORKERS = 4
BIG = 1_500_017  # split over both servers, several partitions each, not a multiple of 16
SMALL = 1_001  # lives whole on one server
STEPS = 3


def _job(addresses, relay_by_rank, optimizer=False):
    """Run one 2-bit job; per rank: (pulled values of every step, bytes pulled)."""

    def worker(rank):
        kv = kvstore.create(
            "dist_sync",
            servers=addresses,
            rank=rank,
            num_workers=WORKERS,
            timeout=60,
            pull_relay=relay_by_rank[rank],
        )
        with kv:
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.02})
            if optimizer:
                kv.set_optimizer("sgd", learning_rate=0.5, momentum=0.9)
            init = [np.linspace(-1, 1, BIG, dtype=np.float32), np.ones(SMALL, np.float32)]
            kv.init(["big", 7], init)
            outs = [np.empty(BIG, np.float32), np.empty(SMALL, np.float32)]
            kv.pull(["big", 7], out=outs)  # before any push: rank 0's init value, dense
            seen = [[o.copy() for o in outs]]
            rng = np.random.default_rng(rank)
            for step in range(STEPS):
                grads = [rng.normal(0, 0.03, n).astype(np.float32) for n in (BIG, SMALL)]
                if step == STEPS - 1:
                    kv.pushpull(["big", 7], grads, out=outs)
                else:
                    kv.push(["big", 7], grads)
                    kv.pull(["big", 7], out=outs)
                seen.append([o.copy() for o in outs])
            return seen, kv.stats().pulled_bytes

    return run_ranks(WORKERS, worker, timeout=120)


def _assert_same_bits(a, b):
    for step_a, step_b in zip(a, b, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            assert x.tobytes() == y.tobytes()


def test_relayed_and_dense_pulls_give_identical_bits_for_fewer_bytes(servers_factory):
    addresses = servers_factory(2, WORKERS)
    relayed = _job(addresses, [True, True, True, False])  # rank 3 asks for dense values
    dense = _job(addresses, [False] * WORKERS)
    init = [np.linspace(-1, 1, BIG, dtype=np.float32), np.ones(SMALL, np.float32)]
    for seen, _ in relayed + dense:
        _assert_same_bits(seen[:1], [init])
        _assert_same_bits(seen, dense[0][0])
    dense_bytes = 4 * (BIG + SMALL) * (STEPS + 1)
    assert [nbytes for _, nbytes in dense] == [dense_bytes] * WORKERS
    assert relayed[3][1] == dense_bytes
    # the first pull is the dense init; then each step brings 4 pushes of 2 bits per element
    relayed_bytes = 4 * (BIG + SMALL) + STEPS * WORKERS * 4 * (-(-BIG // 16) + -(-SMALL // 16))
    assert relayed[0][1] == relayed[1][1] == relayed[2][1] == relayed_bytes
    assert relayed_bytes < dense_bytes / 2


def test_a_server_optimizer_means_dense_pulls(servers_factory):
    addresses = servers_factory(2, WORKERS)
    relayed = _job(addresses, [True] * WORKERS, optimizer=True)
    dense = _job(addresses, [False] * WORKERS, optimizer=True)
    for seen, nbytes in relayed:
        _assert_same_bits(seen, dense[0][0])
        assert nbytes == 4 * (BIG + SMALL) * (STEPS + 1)


def test_torch_workers_aggregate_2bit_gradients_for_their_own_optimizer(servers_factory):
    """The README's recipe: no server optimizer, pull the summed gradient into torch tensors."""
    torch = pytest.importorskip("torch")
    addresses = servers_factory(1, 2)
    shapes = [(64, 33), (33,)]

    def worker(rank):
        with kvstore.create(
            "dist_sync", servers=addresses, rank=rank, num_workers=2, timeout=60
        ) as kv:
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.01})
            names = ["w", "b"]
            kv.init(names, [torch.zeros(s) for s in shapes])
            grads = [torch.zeros(s) for s in shapes]
            torch.manual_seed(rank)
            pushed = [torch.randn(s) * 0.02 for s in shapes]
            kv.push(names[::-1], pushed[::-1])
            kv.pull(names, out=grads)
            return [g.clone() for g in grads], pushed, kv.stats().pulled_bytes

    results = run_ranks(2, worker)
    grads, _, pulled = results[0]
    assert all(torch.equal(a, b) for a, b in zip(grads, results[1][0], strict=True))
    # one step from zero residuals: each worker sent +t, -t or 0 per element; the pull is the sum
    t = torch.tensor(0.01)
    for i, g in enumerate(grads):
        quantized = [
            torch.where(p[i] >= t, t, torch.where(p[i] <= -t, -t, torch.zeros(())))
            for _, p, _ in results
        ]
        assert torch.equal(g, quantized[0] + quantized[1])
    dense = 4 * sum(math.prod(s) for s in shapes)
    assert pulled < dense / 2  # relayed: two pushes of 2 bits per element
