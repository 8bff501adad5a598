"""Averaged keys (``kv.init(..., averaged=True)``) against real server processes.

An averaged key holds the mean of what the workers push and the server optimizer never touches
it: in dist_sync (and local) each round's value is the sum of the decoded pushes divided by N;
in dist_async each decoded push moves the value 1/N of the way to it. The oracles below compute
the same float32 operations in the same order, so the comparisons are exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kvtest
import numpy as np
import pytest
from kvtest import connect, run_ranks, run_ranks_outcomes

import kvstore
from kvstore.errors import UsageError, ValueMismatchError

pytestmark = pytest.mark.integration

LR, MOMENTUM = 0.1, 0.9


@contextmanager
def _stores(addresses: list[str], num_workers: int, mode: str, **kwargs: Any) -> Iterator[list]:
    """One store per rank (connected concurrently), closed at exit."""
    stores = run_ranks(
        num_workers,
        lambda rank: connect(addresses, rank=rank, num_workers=num_workers, mode=mode, **kwargs),
    )
    try:
        yield stores
    finally:
        for kv in stores:
            kv.close()


def _integers(rng: np.random.Generator, size: int) -> np.ndarray:
    return rng.integers(-20, 21, size).astype(np.float32)


def test_dist_sync_averaged_key_is_the_exact_mean_beside_an_optimized_key(servers_factory):
    """Two servers, three workers, server SGD with momentum: the averaged key (split over both
    servers) is the mean of every round's pushes, the normal key gets the optimizer's update."""
    workers, size = 3, 3000
    addresses = servers_factory(2, workers)
    rng = np.random.default_rng(0)
    steps = 4
    pushes_bn = [[_integers(rng, size) for _ in range(workers)] for _ in range(steps)]
    pushes_w = [[_integers(rng, 7) for _ in range(workers)] for _ in range(steps)]
    w0 = _integers(rng, 7)

    with _stores(addresses, workers, "dist_sync", bigarray_bound=1000) as stores:

        def job(rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
            kv = stores[rank]
            kv.set_optimizer("sgd", learning_rate=LR, momentum=MOMENTUM)
            kv.init("bn", np.zeros(size, np.float32), averaged=True)
            kv.init("w", w0)
            seen = []
            for step in range(steps):
                kv.push(["bn", "w"], [pushes_bn[step][rank], pushes_w[step][rank]])
                bn, w = np.empty(size, np.float32), np.empty(7, np.float32)
                kv.pull(["bn", "w"], out=[bn, w])
                seen.append((bn, w))
            return seen

        results = run_ranks(workers, job)

    assert len(stores[0]._shared.keys["bn"].chunks) > 1  # both servers hold a part
    w, mom = w0.copy(), np.zeros(7, np.float32)
    for step in range(steps):
        mean = np.divide(np.sum(pushes_bn[step], axis=0, dtype=np.float32), workers)
        grad = np.sum(pushes_w[step], axis=0, dtype=np.float32)
        mom = np.float32(MOMENTUM) * mom - np.float32(LR) * grad
        w = w + mom
        for rank in range(workers):
            bn_seen, w_seen = results[rank][step]
            np.testing.assert_array_equal(bn_seen, mean)
            np.testing.assert_allclose(w_seen, w, rtol=1e-6, atol=1e-6)


def _running_mean(value: np.ndarray, push: np.ndarray, workers: int) -> np.ndarray:
    """``w + (push - w) / N`` in float32, in the server's order of operations."""
    return np.add(value, np.divide(np.subtract(push, value), workers))


def test_dist_async_running_mean_with_and_without_an_optimizer(servers_factory):
    """Pushes one at a time (each followed by its worker's pull, which waits until it is
    applied), so the order of the running mean is known. Before any optimizer is set the
    averaged key can be pushed while the normal key's push is refused as always; after
    set_optimizer the averaged key stays a running mean."""
    workers = 2
    addresses = servers_factory(1, workers)
    rng = np.random.default_rng(1)
    with _stores(addresses, workers, "dist_async") as stores:
        start = _integers(rng, 9)
        run_ranks(workers, lambda r: stores[r].init("bn", start, averaged=True))
        run_ranks(workers, lambda r: stores[r].init("w", np.zeros(4, np.float32)))
        with pytest.raises(UsageError, match="dist_async.*needs an optimizer"):
            stores[0].push("w", np.ones(4, np.float32))
        with pytest.raises(UsageError, match="dist_async.*needs an optimizer"):
            stores[1].push(["bn", "w"], [np.ones(9, np.float32), np.ones(4, np.float32)])

        expected = start.copy()
        order = [0, 1, 1, 0, 1, 0, 0]
        for rank in order:
            push = _integers(rng, 9)
            stores[rank].push("bn", push)
            got = np.empty(9, np.float32)
            stores[rank].pull("bn", out=got)
            expected = _running_mean(expected, push, workers)
            np.testing.assert_array_equal(got, expected)

        run_ranks(workers, lambda r: stores[r].set_optimizer("sgd", learning_rate=1.0))
        w_expected = np.zeros(4, np.float32)
        for rank in order:
            push, grad = _integers(rng, 9), _integers(rng, 4)
            stores[rank].push(["bn", "w"], [push, grad])
            got, w = np.empty(9, np.float32), np.empty(4, np.float32)
            stores[rank].pull(["bn", "w"], out=[got, w])
            expected = _running_mean(expected, push, workers)
            w_expected = w_expected - grad
            np.testing.assert_array_equal(got, expected)
            np.testing.assert_array_equal(w, w_expected)


def test_float16_averaged_keys_average_in_their_float32_master_copy(servers_factory):
    """A float16 key is updated in a float32 master copy on the server and published cast to
    float16: the running mean keeps its float32 precision between pushes."""
    workers = 2
    addresses = servers_factory(1, workers)
    rng = np.random.default_rng(7)
    with _stores(addresses, workers, "dist_async") as stores:
        run_ranks(workers, lambda r: stores[r].init("h", np.zeros(5, np.float16), averaged=True))
        master = np.zeros(5, np.float32)
        for rank in [0, 1, 0, 0, 1]:
            push = rng.integers(-9, 10, 5).astype(np.float16)
            stores[rank].push("h", push)
            got = np.empty(5, np.float16)
            stores[rank].pull("h", out=got)
            master = _running_mean(master, push.astype(np.float32), workers)
            np.testing.assert_array_equal(got, master.astype(np.float16))


def test_workers_that_disagree_on_averaged_are_refused(servers_factory):
    workers = 2
    addresses = servers_factory(1, workers)
    with _stores(addresses, workers, "dist_sync") as stores:
        outcomes = run_ranks_outcomes(
            workers,
            lambda r: stores[r].init("bn", np.zeros(4, np.float32), averaged=(r == 0)),
        )
        assert outcomes[0] is None
        assert isinstance(outcomes[1], ValueMismatchError)
        message = str(outcomes[1])
        assert "key 'bn'" in message and "averaged" in message


def test_non_float_averaged_keys_are_refused_by_the_worker_and_the_server(one_server):
    with connect([one_server]) as kv:
        with pytest.raises(ValueMismatchError, match="key 'i' is int32: averaged keys .* float"):
            kv.init("i", np.zeros(3, np.int32), averaged=True)
        with pytest.raises(TypeError, match="averaged"):
            kv.init("x", np.zeros(3, np.float32), averaged=1)
        kv.init("i", np.zeros(3, np.int32))  # nothing was declared by the refused init
    raw = kvtest.RawClient(one_server)
    try:
        raw.hello()
        fields = {"k": "j", "c": 0, "o": 0, "n": 3, "dt": "int64", "sh": [3], "cd": "none"}
        reply = raw.request("INIT", {**fields, "cp": {}, "av": True}, [np.zeros(3, np.int64)])
        assert reply.body.code == "bad_value" and "averaged keys" in reply.body.message
        raw.request("BYE")
    finally:
        raw.close()


@pytest.mark.parametrize(
    "codec",
    [{"type": "2bit", "threshold": 0.5}, {"type": "topk", "ratio": 0.25}],
    ids=["2bit", "topk"],
)
def test_a_push_codec_is_decoded_then_averaged(servers_factory, codec):
    """Each worker's push is compressed with its own error feedback; the server decodes the
    pushes, sums them and divides by N. The oracle: the same values pushed through a dense key
    of the same codec with no averaging (its value is the sum), divided by N."""
    workers, size, steps = 2, 16, 3
    addresses = servers_factory(1, workers)
    rng = np.random.default_rng(2)
    grads = [[rng.normal(0, 1, size).astype(np.float32) for _ in range(workers)]]
    grads += [[rng.normal(0, 1, size).astype(np.float32) for _ in range(workers)]]
    grads += [[rng.normal(0, 1, size).astype(np.float32) for _ in range(workers)]]
    with _stores(addresses, workers, "dist_sync") as stores:

        def job(rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
            kv = stores[rank]
            kv.init("avg", np.zeros(size, np.float32), compression=codec, averaged=True)
            kv.init("sum", np.zeros(size, np.float32), compression=codec)
            seen = []
            for step in range(steps):
                kv.push(["avg", "sum"], [grads[step][rank], grads[step][rank]])
                avg, total = np.empty(size, np.float32), np.empty(size, np.float32)
                kv.pull(["avg", "sum"], out=[avg, total])
                seen.append((avg, total))
            return seen

        results = run_ranks(workers, job)
    for rank in range(workers):
        for step, (avg, total) in enumerate(results[rank]):
            assert np.any(total != 0) and np.any(total != np.sum(grads[step], axis=0)), step
            np.testing.assert_array_equal(avg, np.divide(total, workers))


def test_two_bit_averaged_key_against_the_codec_oracle(servers_factory):
    """The 2-bit codec's own oracle (per-element encode with error feedback): the value is the
    mean of the workers' decoded pushes."""
    workers, size, threshold = 2, 20, 0.5
    addresses = servers_factory(1, workers)
    rng = np.random.default_rng(4)
    grads = [[rng.normal(0, 0.6, size).astype(np.float32) for _ in range(workers)] for _ in "abc"]
    with _stores(addresses, workers, "dist_sync") as stores:
        spec = {"type": "2bit", "threshold": threshold}

        def job(rank: int) -> list[np.ndarray]:
            kv = stores[rank]
            kv.init("bn", np.zeros(size, np.float32), compression=spec, averaged=True)
            seen = []
            for step_grads in grads:
                kv.push("bn", step_grads[rank])
                out = np.empty(size, np.float32)
                kv.pull("bn", out=out)
                seen.append(out)
            return seen

        results = run_ranks(workers, job)
    residuals = [np.zeros(size, np.float32) for _ in range(workers)]
    for step, step_grads in enumerate(grads):
        decoded = []
        for rank in range(workers):
            _, codes = kvtest.oracle_encode(step_grads[rank], residuals[rank], threshold)
            decoded.append(kvtest.oracle_decode(codes, threshold))
        mean = np.divide(np.sum(decoded, axis=0, dtype=np.float32), workers)
        for rank in range(workers):
            np.testing.assert_array_equal(results[rank][step], mean)


def _local_run(
    steps: range, pushes: list, *, load: Any = None, save: Any = None, averaged: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    with kvstore.create("local", timeout=30) as kv:
        kv.set_optimizer("sgd", learning_rate=LR, momentum=MOMENTUM)
        kv.init("bn", np.zeros(6, np.float32), averaged=averaged)
        kv.init("w", np.ones(6, np.float32))
        if load is not None:
            kv.load_checkpoint(load)
        bn, w = np.empty(6, np.float32), np.empty(6, np.float32)
        for step in steps:
            kv.push(["bn", "w"], list(pushes[step]))
            kv.pull(["bn", "w"], out=[bn, w])
            # local is dist_sync with one worker: the mean of one push is the push itself
            np.testing.assert_array_equal(bn, pushes[step][0])
        if save is not None:
            kv.save_checkpoint(save)
        return bn, w


def test_checkpoint_keeps_an_averaged_key_averaged(tmp_path):
    rng = np.random.default_rng(5)
    pushes = [(rng.normal(0, 3, 6).astype(np.float32),) * 2 for _ in range(6)]
    expected = _local_run(range(6), pushes)
    assert not np.array_equal(expected[0], expected[1])  # the optimizer moved only "w"
    _local_run(range(3), pushes, save=tmp_path / "ckpt")
    resumed = _local_run(range(3, 6), pushes, load=tmp_path / "ckpt")
    for got, want in zip(resumed, expected, strict=True):
        assert got.tobytes() == want.tobytes()


def test_a_checkpoint_load_into_a_job_that_disagrees_on_averaged_is_refused(tmp_path):
    rng = np.random.default_rng(6)
    pushes = [(rng.normal(0, 3, 6).astype(np.float32),) * 2 for _ in range(2)]
    _local_run(range(2), pushes, save=tmp_path / "ckpt")
    with kvstore.create("local", timeout=30) as kv:
        kv.init("bn", np.zeros(6, np.float32))
        kv.init("w", np.ones(6, np.float32))
        with pytest.raises(kvstore.CheckpointError, match="key 'bn'.*averaged=True.*averaged"):
            kv.load_checkpoint(tmp_path / "ckpt")
        out = np.empty(6, np.float32)
        kv.pull("bn", out=out)
        assert not out.any()  # nothing was loaded
