"""Compressed pulls against real servers (docs/design.md, "Return path"): every worker holds
the same bits, which follow an independent oracle of ``w_pub += Q(w - w_pub)`` over the
servers' true weights, for fewer bytes than dense pulls."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from kvtest import run_ranks

import kvstore
from kvstore.errors import CodecError, UsageError

pytestmark = pytest.mark.integration

WORKERS = 2
BIG = 100_003  # split over both servers, several chunks
SMALL = 1_001
STEPS = 6
LR = 0.1


def _grads(rank, step):
    rng = np.random.default_rng(1000 * rank + step)
    return [rng.normal(0, 0.05, n).astype(np.float32) for n in (BIG, SMALL)]


def _job(addresses, pull, mode="dist_sync", skipping_rank=None, push="none"):
    """Per rank: the values pulled after each step (None where the rank skipped the pull),
    and the bytes it pulled."""

    def worker(rank):
        kv = kvstore.create(
            mode,
            servers=addresses,
            rank=rank,
            num_workers=WORKERS,
            timeout=60,
            partition_bytes=64 * 1024,
        )
        with kv:
            kv.set_gradient_compression({"type": push})
            if pull is not None:
                kv.set_pull_compression(pull)
            kv.set_optimizer("sgd", learning_rate=LR, momentum=0.5)
            init = [np.linspace(-1, 1, BIG, dtype=np.float32), np.ones(SMALL, np.float32)]
            kv.init(["w", 3], init)
            outs = [np.empty(BIG, np.float32), np.empty(SMALL, np.float32)]
            seen = []
            for step in range(STEPS):
                kv.push(["w", 3], _grads(rank, step))
                if rank == skipping_rank and step % 2 == 0:
                    seen.append(None)
                    continue
                if step == STEPS - 1:
                    outs = [np.empty(BIG, np.float32), np.empty(SMALL, np.float32)]  # new arrays
                kv.pull(["w", 3], out=outs)
                seen.append([o.copy() for o in outs])
            kv.barrier()
            return seen, kv.stats().pulled_bytes

    return run_ranks(WORKERS, worker, timeout=120)


def _bf16(d):
    bits = d.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return (rounded & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def _two_bit(threshold):
    t = np.float32(threshold)

    def quantize(d):
        return np.where(d >= t, t, np.where(d <= -t, -t, np.float32(0))).astype(np.float32)

    return quantize


@pytest.mark.parametrize(
    "pull, quantize",
    [({"type": "bf16"}, _bf16), ({"type": "2bit", "threshold": 0.004}, _two_bit(0.004))],
    ids=["bf16", "2bit"],
)
def test_compressed_pulls_follow_the_oracle_bit_for_bit(servers_factory, pull, quantize):
    addresses = servers_factory(2, WORKERS)
    truth, dense_bytes = _job(addresses, None)[0]  # the servers' weights after each step
    runs = _job(addresses, pull, skipping_rank=1)
    held = [np.linspace(-1, 1, BIG, dtype=np.float32), np.ones(SMALL, np.float32)]
    for step in range(STEPS):
        for k in range(2):
            held[k] = held[k] + quantize((truth[step][k] - held[k]).astype(np.float32))
        for rank, (seen, _) in enumerate(runs):
            if seen[step] is None:
                continue
            for k in range(2):
                assert seen[step][k].tobytes() == held[k].tobytes(), (rank, step, k)
    for rank, (_, nbytes) in enumerate(runs):
        assert nbytes < dense_bytes, rank  # rank 1's skipped pulls cost it w_pub whole


@pytest.mark.parametrize(
    "pull", [{"type": "topk", "ratio": 0.05}, {"type": "threshold", "threshold": 0.002}]
)
def test_sparse_pulls_give_every_worker_the_same_bits(servers_factory, pull):
    addresses = servers_factory(2, WORKERS)
    runs = _job(addresses, pull, push="2bit")
    (a, a_bytes), (b, b_bytes) = runs
    for step in range(STEPS):
        for x, y in zip(a[step], b[step], strict=True):
            assert x.tobytes() == y.tobytes()
    assert a_bytes == b_bytes


def test_dist_async_keeps_one_w_pub_per_worker(servers_factory):
    addresses = servers_factory(2, WORKERS)
    runs = _job(addresses, {"type": "bf16"}, mode="dist_async")
    dense = _job(addresses, None, mode="dist_async")
    for (seen, nbytes), (_, dense_bytes) in zip(runs, dense, strict=True):
        assert nbytes < dense_bytes
        last = seen[-1]
        assert all(np.isfinite(x).all() for x in last)


def test_pull_compression_is_set_before_init_and_checked(servers_factory):
    addresses = servers_factory(1, 1)
    with kvstore.create("dist_sync", servers=addresses, rank=0, num_workers=1) as kv:
        with pytest.raises(CodecError, match="'1bit' is not supported.*'bf16'"):
            kv.set_pull_compression({"type": "1bit"})
        kv.set_pull_compression({"type": "fp16"})
        kv.init("a", np.zeros(10, np.float32))
        kv.init("ints", np.zeros(10, np.int32))  # pulls of integer keys stay dense
        with pytest.raises(UsageError, match="before init"):
            kv.set_pull_compression({"type": "none"})
        out = np.empty(10, np.int32)
        kv.push("ints", np.arange(10, dtype=np.int32))
        kv.pull("ints", out=out)
        assert out.tolist() == list(range(10))


def test_workers_that_disagree_are_refused_at_init(servers_factory):
    addresses = servers_factory(1, WORKERS)
    # Every worker is in the job before any inits, and none leaves before all were answered:
    # a server whose last worker left forgets the job, so a rank that came late (a loaded
    # machine) would join a new one and wait for a rank 0 that never inits.
    connected = threading.Barrier(WORKERS, timeout=60)  # the timeouts are hang guards
    answered = threading.Barrier(WORKERS, timeout=60)

    def worker(rank):
        with kvstore.create(
            "dist_sync", servers=addresses, rank=rank, num_workers=WORKERS, timeout=30
        ) as kv:
            kv.set_pull_compression({"type": "bf16" if rank == 0 else "fp16"})
            connected.wait()
            try:
                kv.init("w", np.zeros(10, np.float32))
            except kvstore.KVStoreError as exc:
                return str(exc)
            finally:
                answered.wait()
            return None

    errors = run_ranks(WORKERS, worker, timeout=60)
    assert errors[0] is None
    assert "pull compression" in errors[1]


def _local_job(pull):
    kv = kvstore.create("local", timeout=30)
    kv.set_pull_compression(pull)
    kv.set_optimizer("sgd", learning_rate=0.1, momentum=0.5)
    kv.init(["w", 3], [np.linspace(-1, 1, 5000, dtype=np.float32), np.ones(33, np.float32)])
    return kv


def _local_step(kv, seed):
    rng = np.random.default_rng(seed)
    kv.push(["w", 3], [rng.normal(0, 0.4, n).astype(np.float32) for n in (5000, 33)])
    outs = [np.empty(n, np.float32) for n in (5000, 33)]
    kv.pull(["w", 3], out=outs)
    return outs


@pytest.mark.parametrize(
    "pull", [{"type": "2bit", "threshold": 0.01}, {"type": "topk", "ratio": 0.1}]
)
def test_a_checkpoint_keeps_what_the_workers_hold(tmp_path, pull):
    with _local_job(pull) as kv:
        expected = [_local_step(kv, seed) for seed in range(6)]
    with _local_job(pull) as kv:
        for seed in range(3):
            _local_step(kv, seed)
        kv.save_checkpoint(tmp_path / "ckpt")
        _local_step(kv, 99)  # moves on; the load rolls it back
        kv.load_checkpoint(tmp_path / "ckpt")
        got = [_local_step(kv, seed) for seed in range(3, 6)]
    for step_got, step_expected in zip(got, expected[3:], strict=True):
        for a, b in zip(step_got, step_expected, strict=True):
            assert a.tobytes() == b.tobytes()
