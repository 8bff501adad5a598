"""Pull prefetch: a push that is followed by a pull brings the value back with its reply.

Against real server processes. What must hold: a pull returns exactly what it would have
returned without prefetch (the value after this worker's latest push), and a reply is only
used by the pull that follows the push that asked for it.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import run_ranks

import kvstore
from kvstore.topology import plan_chunks

pytestmark = pytest.mark.integration

BIG = 2_000_003  # split over both servers, several chunks each
SMALL = 37


def connect(addresses, rank=0, num_workers=1, mode="dist_sync", **kwargs):
    kwargs.setdefault("timeout", 30)
    return kvstore.create(mode, servers=addresses, rank=rank, num_workers=num_workers, **kwargs)


def _chunks(numel, num_servers):
    return len(plan_chunks("w", numel, num_servers, bigarray_bound=10**6, partition_elems=1 << 20))


def test_a_pull_after_a_push_takes_the_prefetched_value(one_server):
    with connect([one_server]) as kv:
        kv.init("w", np.zeros(BIG, np.float32))
        out = np.empty(BIG, np.float32)
        for step in range(4):
            kv.push("w", np.full(BIG, step + 1, np.float32))
            kv.pull("w", out=out)
            assert (out == step + 1).all()  # no optimizer: the value is the round's sum
        # the first push only learns that pulls follow; the three after it prefetch
        assert kv.stats().prefetched_pulls == 3 * _chunks(BIG, 1)
        kv.pull("w", out=out)  # a second pull asks the server again
        assert (out == 4).all()
        assert kv.stats().prefetched_pulls == 3 * _chunks(BIG, 1)


def test_a_push_not_followed_by_a_pull_is_not_answered_by_an_older_reply(one_server):
    with connect([one_server]) as kv:
        kv.init("w", np.zeros(SMALL, np.float32))
        out = np.empty(SMALL, np.float32)
        kv.push("w", np.full(SMALL, 1, np.float32))
        kv.pull("w", out=out)
        kv.push("w", np.full(SMALL, 2, np.float32))  # prefetches (a pull followed the last push)
        kv.push("w", np.full(SMALL, 3, np.float32))  # a plain push: the reply of 2 is stale
        kv.pull("w", out=out)
        assert out.tolist() == [3] * SMALL
        assert kv.stats().prefetched_pulls == 0
        kv.push("w", np.full(SMALL, 4, np.float32))  # the last push was pulled: prefetch again
        kv.pull("w", out=out)
        assert out.tolist() == [4] * SMALL
        assert kv.stats().prefetched_pulls == 1


@pytest.mark.parametrize("compression", [None, "2bit"])
def test_two_workers_two_servers_get_the_round_values(servers_factory, compression):
    addresses = servers_factory(2, 2)
    steps = 4

    def worker(rank):
        with connect(addresses, rank=rank, num_workers=2) as kv:
            if compression:
                kv.set_gradient_compression({"type": compression, "threshold": 0.5})
            kv.set_optimizer("sgd", learning_rate=0.25)
            kv.init(["big", 3], [np.zeros(BIG, np.float32), np.zeros(SMALL, np.float32)])
            outs = [np.empty(BIG, np.float32), np.empty(SMALL, np.float32)]
            seen = []
            for _ in range(steps):
                # every element pushes +1 (2-bit: exactly the threshold, 0.5, per worker)
                grads = [np.ones(BIG, np.float32), np.ones(SMALL, np.float32)]
                grads = [g * (0.5 if compression else 1.0) for g in grads]
                kv.push(["big", 3], grads)
                kv.pull(["big", 3], out=outs)
                seen.append((float(outs[0][0]), float(outs[0][-1]), float(outs[1][5])))
            return seen, kv.stats().prefetched_pulls

    per_step = 0.25 * (2 * 0.5 if compression else 2.0)  # lr x the round's sum
    for seen, prefetched in run_ranks(2, worker):
        expected = [-per_step * (s + 1) for s in range(steps)]
        assert [v[0] for v in seen] == expected
        assert [v[1] for v in seen] == expected
        assert [v[2] for v in seen] == expected
        assert prefetched == (steps - 1) * (_chunks(BIG, 2) + 1)


def test_dist_async_does_not_prefetch(servers_factory):
    addresses = servers_factory(1, 1)
    with connect(addresses, mode="dist_async") as kv:
        kv.set_optimizer("sgd", learning_rate=1.0)
        kv.init("w", np.zeros(SMALL, np.float32))
        out = np.empty(SMALL, np.float32)
        for step in range(3):
            kv.push("w", np.ones(SMALL, np.float32))
            kv.pull("w", out=out)
            assert out.tolist() == [-(step + 1.0)] * SMALL
        assert kv.stats().prefetched_pulls == 0
