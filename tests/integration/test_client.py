"""The worker client against real server processes (workers as threads of this process)."""

from __future__ import annotations

import math
import threading
import time

import kvtest
import numpy as np
import pytest
from kvtest import connect, run_ranks

import kvstore
from kvstore.config import DEFAULT_BIGARRAY_BOUND
from kvstore.server.work import INLINE_ELEMS
from kvstore.topology import partition_elems_for, plan_chunks
from kvstore.wire import Op
from kvstore.worker.keys import servers_on_this_host

pytestmark = pytest.mark.integration


def test_single_worker_int_and_str_keys_lists_and_pushpull(one_server):
    with connect([one_server]) as kv:
        assert (kv.type, kv.rank, kv.num_workers, kv.num_servers) == ("dist_sync", 0, 1, 1)
        kv.init([1, "b"], [np.zeros((2, 3), np.float32), np.arange(5, dtype=np.float64)])
        out1, outb = np.empty((2, 3), np.float32), np.empty(5, np.float64)
        kv.pull([1, "b"], out=[out1, outb])
        assert outb.tolist() == [0, 1, 2, 3, 4]
        kv.push([1, "b"], [np.ones((2, 3), np.float32), np.full(5, 0.5)], priority=3)
        kv.pull([1, "b"], out=[out1, outb], priority=-1)
        assert out1.tolist() == [[1, 1, 1]] * 2 and outb.tolist() == [0.5] * 5
        value = np.full((2, 3), 7, np.float32)
        kv.pushpull(1, value)  # out defaults to value: filled in place
        assert value.tolist() == [[7, 7, 7]] * 2
        other = np.zeros((2, 3), np.float32)
        kv.pushpull(1, np.full((2, 3), 9, np.float32), out=other)
        assert other.tolist() == [[9, 9, 9]] * 2


def test_pushpull_keeps_no_reply_buffers_once_landed(one_server):
    # The client holds each chunk's last push until the next one; a pushpull's reply frames
    # (megabytes of ZeroMQ buffers) must not live that long.
    with connect([one_server], partition_bytes=4096) as kv:
        kv.init("k", np.zeros(5000, np.float32))
        out = np.empty(5000, np.float32)
        kv.pushpull("k", np.full(5000, 2, np.float32), out=out)
        assert out.tolist() == [2] * 5000
        held = [r for r in kv._shared.keys["k"].last_push if r is not None]
        assert len(held) > 1
        for request in held:
            reply = request.wait(5)
            assert reply.payloads == [] and reply.op is kvstore.wire.Op.REPLY


def test_slices_on_loopback_are_never_long(one_server):
    # 20,000 elements of 1,024-element partitions would be a long slice for dense pushes to
    # another host (32 chunks and a short one at each end); on loopback no push crosses a link,
    # so dense and 2-bit keys alike get chunks of at most a partition (and short ends): 23.
    value = np.arange(20_000, dtype=np.float32)
    for compression in ({"type": "none"}, {"type": "2bit", "threshold": 0.5}):
        with connect([one_server], partition_bytes=4096) as kv:
            kv.set_gradient_compression(compression)
            kv.init("k", np.zeros(20_000, np.float32))
            assert len(kv._shared.keys["k"].chunks) == 23
            out = np.empty_like(value)
            kv.push("k", value)
            kv.pull("k", out=out)
            if compression["type"] == "none":
                assert np.array_equal(out, value)
            else:  # each element is +-0.5 or 0 after one 2-bit push
                assert set(np.unique(out)) <= {-0.5, 0.0, 0.5}


def test_servers_on_this_host_is_judged_from_the_addresses():
    assert servers_on_this_host(["tcp://127.0.0.1:9100", "tcp://localhost:9101"])
    assert servers_on_this_host(["tcp://[::1]:9100", "inproc://kvstore-local", "ipc:///tmp/s"])
    assert not servers_on_this_host(["tcp://127.0.0.1:9100", "tcp://10.0.0.2:9100"])
    assert not servers_on_this_host(["tcp://node7:9100"])
    p = 1024  # so a remote job's dense key of 20,000 elements has long slices, a 2-bit one not
    dense = plan_chunks("k", 20_000, 1, bigarray_bound=10**6, partition_elems=p)
    compressed = plan_chunks(
        "k", 20_000, 1, bigarray_bound=10**6, partition_elems=p, wire_fraction=1 / 16
    )
    assert (len(dense), len(compressed)) == (34, 23)


@pytest.mark.parametrize("compression", [None, "2bit"])
def test_chunks_longer_than_the_inline_limit_are_summed_on_the_thread_pool(
    servers_factory, compression
):
    """With a large partition a chunk exceeds INLINE_ELEMS and its decode, sum and optimizer
    step run on the server's pool threads instead of its event loop: same results."""
    n = INLINE_ELEMS + 4096
    grad = np.where(np.arange(n) % 3 == 0, 0.5, -0.5).astype(np.float32)  # exact in 2-bit
    partition_bytes = 16 * n  # a quarter partition (the shortest chunk) is n elements
    # (the servers derive their message size limit from the workers' partition size)
    addresses = servers_factory(1, 2, env={"KVSTORE_PARTITION_BYTES": str(partition_bytes)})
    partition = partition_elems_for(partition_bytes, 4)
    chunks = plan_chunks(
        "sum", n, 1, bigarray_bound=DEFAULT_BIGARRAY_BOUND, partition_elems=partition
    )
    assert [c.numel for c in chunks] == [n]  # one chunk, longer than the limit

    def worker(rank):
        with connect(addresses, rank, 2, partition_bytes=partition_bytes) as kv:
            if compression:
                kv.set_gradient_compression({"type": compression, "threshold": 0.5})
            kv.init(["sum", "sgd"], [np.zeros(n, np.float32), np.ones(n, np.float32)])
            kv.push("sum", grad * (rank + 1))
            total = np.empty(n, np.float32)
            kv.pull("sum", out=total)
            kv.set_optimizer("sgd", learning_rate=0.5)
            kv.push("sgd", grad)
            weights = np.empty(n, np.float32)
            kv.pull("sgd", out=weights)
            return total, weights

    for total, weights in run_ranks(2, worker):
        # 2-bit sends each worker's push as +-threshold: 0.5 and 1.0 both become 0.5
        expected = grad * (2 if compression else 3)
        np.testing.assert_array_equal(total, expected)
        np.testing.assert_array_equal(weights, 1 - 0.5 * 2 * grad)


def test_a_send_queue_in_time_keeps_results_exact(servers_factory, monkeypatch):
    """KVSTORE_SEND_QUEUE_MS: the window follows the measured send rate; sums stay exact."""
    monkeypatch.setenv("KVSTORE_SEND_QUEUE_MS", "1")
    addresses = servers_factory(2, 2)
    n = 3_000_000

    def worker(rank):
        with connect(addresses, rank, 2, partition_bytes=1 << 20) as kv:
            kv.init("k", np.zeros(n, np.float32))
            out = np.empty(n, np.float32)
            for step in range(5):
                kv.push("k", np.full(n, rank + 1 + step, np.float32))
                kv.pull("k", out=out)
                assert (out == 3 + 2 * step).all()
            return kv._shared.transport._window.rate is not None  # the window was measured

    assert any(run_ranks(2, worker))


def _push_ops(kv, key):
    return {request.op for request in kv._shared.keys[key].last_push if request is not None}


def test_two_workers_sum_a_key_split_into_many_partitions(servers_factory):
    # Also: once a key's push was followed by a pull, its next pushes ask for the round's value
    # (PUSHPULL) and the pull takes the replies the client kept: same results, the reply
    # buffers dropped once landed, and a second pull of the same round asks the servers again.
    addresses = servers_factory(2, 2)
    n = 10_007

    def worker(rank):
        with connect(addresses, rank, 2, bigarray_bound=1000, partition_bytes=4096) as kv:
            kv.init("k", np.zeros(n, np.float32))
            results, ops = [], []
            for step in range(4):
                kv.push("k", np.arange(n, dtype=np.float32) * (rank + 1) + step)
                ops.append(_push_ops(kv, "k"))
                out = np.empty(n, np.float32)
                kv.pull("k", out=out)
                results.append(out)
            state = kv._shared.keys["k"]
            assert state.prefetched is None
            for request in state.last_push:
                assert request.wait(5).payloads == []  # landed, then released
            again = np.empty(n, np.float32)
            kv.pull("k", out=again)  # a fresh pull of the same round
            kv.barrier()
            return results, ops, again

    for results, ops, again in run_ranks(2, worker):
        assert ops == [{Op.PUSH}] + [{Op.PUSHPULL}] * 3
        for step, out in enumerate(results):
            np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) * 3 + 2 * step)
        np.testing.assert_array_equal(again, results[-1])


def test_replies_landed_by_the_caller_match_their_chunks(servers_factory, monkeypatch):
    # GPU targets are filled by the caller, chunk by chunk, from the requests in chunk order,
    # while pushes go out in send order (the slices interleaved): pushpull and a prefetched
    # pull must hand the caller each chunk's own reply. Host memory takes that path here.
    from kvstore.worker import landing as landing_module

    original_init = landing_module.Landing.__init__

    def caller_lands(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.on_io_thread = False

    monkeypatch.setattr(landing_module.Landing, "__init__", caller_lands)
    addresses = servers_factory(2, 1)
    n = 6_000
    with connect(addresses, bigarray_bound=1000, partition_bytes=4096) as kv:
        kv.init("k", np.zeros(n, np.float32))
        state = kv._shared.keys["k"]
        assert [c.index for c in state.send_order] != [c.index for c in state.chunks]
        out = np.empty(n, np.float32)
        kv.pushpull("k", np.arange(n, dtype=np.float32), out=out)
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32))
        for step in range(1, 3):  # the second push asks for the values, and its pull lands them
            kv.push("k", np.arange(n, dtype=np.float32) + step)
            kv.pull("k", out=out)
            np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) + step)
        assert _push_ops(kv, "k") == {Op.PUSHPULL}


def test_pushes_that_nobody_pulls_stop_asking_for_values(one_server):
    with connect([one_server], partition_bytes=4096) as kv:
        kv.init("k", np.zeros(3000, np.float32))
        out = np.empty(3000, np.float32)
        kv.push("k", np.ones(3000, np.float32))
        kv.pull("k", out=out)
        kv.push("k", np.full(3000, 2, np.float32))
        assert _push_ops(kv, "k") == {Op.PUSHPULL}
        kv.push("k", np.full(3000, 3, np.float32))  # the values of the push before: unread
        assert _push_ops(kv, "k") == {Op.PUSH} and kv._shared.keys["k"].prefetched is None
        kv.pull("k", out=out)
        assert out.tolist() == [3] * 3000
        kv.push("k", np.full(3000, 4, np.float32))  # a pull followed the push: ask again
        assert _push_ops(kv, "k") == {Op.PUSHPULL}
        kv.pushpull("k", np.full(3000, 5, np.float32), out=out)
        assert out.tolist() == [5] * 3000 and kv._shared.keys["k"].prefetched is None
        kv.pull("k", out=out)
        assert out.tolist() == [5] * 3000


def test_async_pushes_never_ask_for_values(one_server):
    # dist_async applies pushes on arrival: a pull must read the value as of the pull, not as
    # of this worker's last push.
    with connect([one_server], mode="dist_async") as kv:
        kv.set_optimizer("sgd", learning_rate=1.0)
        kv.init("k", np.zeros(8, np.float32))
        out = np.empty(8, np.float32)
        for _ in range(3):
            kv.push("k", np.ones(8, np.float32))
            assert _push_ops(kv, "k") == {Op.PUSH}
            kv.pull("k", out=out)
        assert out.tolist() == [-3] * 8


def test_pull_waits_for_the_round_and_reads_own_pushes(servers_factory):
    addresses = servers_factory(1, 2)
    # Rank 1 pushes only once rank 0 has pushed: rank 0's second push (a new round) and its
    # pull must then wait for rank 1 (the order of events is the test, not how long it took).
    rank0_pushed = threading.Event()

    def worker(rank):
        with connect(addresses, rank, 2) as kv:
            kv.init(0, np.zeros(4, np.float32))
            if rank == 1:
                assert rank0_pushed.wait(timeout=60)  # a hang guard
                time.sleep(0.2)  # (only makes it likelier that rank 0 is waiting by now)
            kv.push(0, np.full(4, rank + 1, np.float32))
            if rank == 0:
                rank0_pushed.set()
                kv.push(0, np.full(4, 10, np.float32))  # waits for round 1: a new round
            out = np.empty(4, np.float32)
            if rank == 1:
                kv.pull(0, out=out)
                first = out.copy()  # round 1 only
                kv.push(0, np.full(4, 20, np.float32))
            kv.pull(0, out=out)
            return (first if rank == 1 else None), out

    (_, out0), (first1, out1) = run_ranks(2, worker)
    assert first1.tolist() == [3] * 4
    # rank 0's pull returned round 2, with both of rank 1's pushes, all issued after its own
    assert out0.tolist() == out1.tolist() == [30] * 4


def test_barrier_means_every_push_is_applied(servers_factory):
    addresses = servers_factory(2, 3)

    def worker(rank):
        with connect(addresses, rank, 3, mode="dist_async") as kv:
            kv.set_optimizer("sgd", learning_rate=1.0)
            kv.init("x", np.zeros(8, np.float32))
            for _ in range(rank + 1):
                kv.push("x", np.full(8, -1, np.float32))
            kv.barrier()
            out = np.empty(8, np.float32)
            kv.pull("x", out=out)
            return out

    for out in run_ranks(3, worker):
        assert out.tolist() == [6] * 8  # 1 + 2 + 3 pushes of -1, lr 1


def test_set_optimizer_again_keeps_momentum_and_changes_lr(one_server):
    with connect([one_server]) as kv:
        kv.set_optimizer("sgd", learning_rate=0.5, momentum=0.5)
        kv.init("w", np.zeros(3, np.float32))
        g = np.ones(3, np.float32)
        out = np.empty(3, np.float32)
        kv.push("w", g)
        kv.pull("w", out=out)  # mom = -0.5, w = -0.5
        kv.set_optimizer("sgd", learning_rate=0.25, momentum=0.5)
        kv.push("w", g)
        kv.pull("w", out=out)  # mom = -0.25 - 0.25 = -0.5, w = -1.0
        assert out.tolist() == [-1.0] * 3
        assert kv.optimizer.params["learning_rate"] == 0.25


def test_adam_on_the_server(one_server):
    with connect([one_server]) as kv:
        kv.set_optimizer("adam", learning_rate=0.1)
        kv.init("w", np.ones(5, np.float32))
        out = np.empty(5, np.float32)
        grads = [np.linspace(-1, 1, 5).astype(np.float32) * s for s in (1, 2, -3)]
        w, m, v = np.ones(5, np.float32), np.zeros(5, np.float32), np.zeros(5, np.float32)
        for t, g in enumerate(grads, start=1):
            kv.push("w", g)
            kv.pull("w", out=out)
            m = np.float32(0.9) * m + np.float32(0.1) * g
            v = np.float32(0.999) * v + np.float32(1 - 0.999) * g * g
            lr_t = np.float32(0.1 * math.sqrt(1 - 0.999**t) / (1 - 0.9**t))
            w = w - lr_t * m / (np.sqrt(v) + np.float32(1e-8))
            np.testing.assert_allclose(out, w, rtol=1e-5, atol=1e-6)


def test_float16_and_integer_keys(servers_factory):
    addresses = servers_factory(1, 2)

    def worker(rank):
        with connect(addresses, rank, 2) as kv:
            kv.init(["h", "i"], [np.zeros(6, np.float16), np.zeros(6, np.int64)])
            kv.push(["h", "i"], [np.full(6, 0.1, np.float16), np.full(6, 2**40, np.int64)])
            h, i = np.empty(6, np.float16), np.empty(6, np.int64)
            kv.pull(["h", "i"], out=[h, i])
            return h, i

    for h, i in run_ranks(2, worker):
        # summed in float32 on the server, returned as float16
        assert h.tolist() == [float(np.float16(np.float32(np.float16(0.1)) * 2))] * 6
        assert i.tolist() == [2**41] * 6


@pytest.mark.parametrize("pull_relay", [False, True])
def test_traffic_stats_show_the_compression(one_server, pull_relay):
    with connect([one_server], pull_relay=pull_relay) as kv:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        assert kv.compression == {"type": "2bit", "threshold": 0.5}
        kv.init("w", np.zeros(1_000_000, np.float32))
        kv.push("w", np.ones(1_000_000, np.float32))
        out = np.empty(1_000_000, np.float32)
        kv.pull("w", out=out)
        assert out.tolist() == [0.5] * 1_000_000
        stats = kv.stats()
        assert stats.pushed_raw_bytes == 4_000_000
        assert 250_000 <= stats.pushed_bytes < 251_000  # 2 bits per element + a header
        assert 15.9 < stats.compression_ratio <= 16
        # a relayed pull brings the round's one push back instead of the dense sum
        assert stats.pulled_bytes == (250_000 if pull_relay else 4_000_000)
        chunks = plan_chunks("w", 1_000_000, 1, bigarray_bound=10**6, partition_elems=1 << 20)
        assert stats.as_dict()["push_messages"] == len(chunks)  # one message per chunk


def test_torch_tensors_keep_their_type(one_server):
    torch = pytest.importorskip("torch")
    with connect([one_server]) as kv:
        weight = torch.zeros(4, 3)
        kv.init("t", weight)
        kv.push("t", torch.arange(12, dtype=torch.float32).reshape(4, 3))
        kv.pull("t", out=weight)
        assert isinstance(weight, torch.Tensor)
        assert weight.flatten().tolist() == list(range(12))
        transposed = torch.zeros(3, 4).t()  # a non-contiguous (4, 3) view
        kv.pull("t", out=transposed)
        assert transposed.flatten().tolist() == list(range(12))
        param = torch.nn.Parameter(torch.zeros(4, 3))  # requires_grad: filled in place
        kv.push("t", torch.ones(4, 3).t().contiguous().t())  # non-contiguous value
        kv.pull("t", out=param)
        assert param.detach().flatten().tolist() == [1.0] * 12
        with pytest.raises(kvstore.ValueMismatchError, match="float64"):
            kv.push("t", torch.zeros(4, 3, dtype=torch.float64))


def test_local_mode_matches_a_one_worker_job():
    grads = [np.random.default_rng(s).standard_normal(40).astype(np.float32) for s in range(4)]

    def run(kv):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.25})
        kv.set_optimizer("sgd", learning_rate=0.1, momentum=0.9)
        kv.init("w", np.ones(40, np.float32))
        out = np.empty(40, np.float32)
        history = []
        for g in grads:
            kv.push("w", g)
            kv.pull("w", out=out)
            history.append(out.copy())
        return history

    with kvstore.create("local") as kv:
        assert (kv.type, kv.rank, kv.num_workers) == ("local", 0, 1)
        local = run(kv)
    servers = kvtest.start_servers(1, 1)
    try:
        with connect([servers[0].address]) as kv:
            dist = run(kv)
    finally:
        kvtest.stop_processes([s.process for s in servers])
    for a, b in zip(local, dist, strict=True):
        np.testing.assert_array_equal(a, b)


def test_close_is_idempotent_and_final(one_server):
    kv = connect([one_server])
    kv.init(1, np.zeros(2, np.float32))
    kv.close()
    kv.close()
    with pytest.raises(kvstore.UsageError, match="closed"):
        kv.push(1, np.zeros(2, np.float32))
    with kvstore.create("local") as local:
        pass
    with pytest.raises(kvstore.UsageError):
        local.barrier()


def test_a_server_host_name_that_does_not_resolve_is_named_at_once(one_server):
    """ZeroMQ retries a failed name lookup in silence; the worker says what is wrong instead
    of waiting out its connect timeout (".invalid" never resolves: RFC 2606)."""
    servers = f"{one_server},tcp://no-such-node.invalid:9100"
    with pytest.raises(kvstore.ConfigError) as caught:  # (not ConnectionLostError, 300 s later)
        kvstore.create("dist_sync", servers=servers, rank=0, num_workers=1, connect_timeout=300)
    message = str(caught.value)
    assert "server 1 (tcp://no-such-node.invalid:9100" in message
    assert "'no-such-node.invalid' does not resolve" in message
