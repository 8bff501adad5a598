"""``push(..., borrow=True)``: dense host values are sent from the caller's memory, not copied."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import connect, run_ranks

pytestmark = pytest.mark.integration


def _poison_encoders(kv, key):
    """Fill the key's encoder buffers with NaN: a push that copies overwrites them."""
    for encoder in kv._shared.keys[key].encoders:
        encoder._buffer[:] = np.nan


def _encoders_untouched(kv, key):
    return all(np.isnan(encoder._buffer).all() for encoder in kv._shared.keys[key].encoders)


def test_borrowed_pushes_are_not_copied_and_sum_like_copied_ones(servers_factory):
    addresses = servers_factory(2, 2)
    n = 10_007  # split over both servers, many chunks each

    def worker(rank):
        with connect(addresses, rank, 2, bigarray_bound=1000, partition_bytes=4096) as kv:
            kv.init("k", np.zeros(n, np.float32))
            grad = np.arange(n, dtype=np.float32) * (rank + 1)
            out = np.empty(n, np.float32)
            results, untouched = [], []
            kv.push("k", grad)  # copied (this also makes the encoders)
            kv.pull("k", out=out)
            results.append(out.copy())
            for step in (1, 2):
                _poison_encoders(kv, "k")
                grad += 1  # the next backward writes the gradient again, after the pull
                if step == 1:
                    kv.push("k", grad, borrow=True)
                    kv.pull("k", out=out)
                else:
                    kv.pushpull("k", grad, out=out, borrow=True)
                results.append(out.copy())
                untouched.append(_encoders_untouched(kv, "k"))
            grad += 1
            kv.push("k", grad)  # copied again: the check above can fail
            kv.pull("k", out=out)
            results.append(out.copy())
            untouched.append(_encoders_untouched(kv, "k"))
            kv.barrier()
            return results, untouched

    for results, untouched in run_ranks(2, worker):
        assert untouched == [True, True, False]
        for step, out in enumerate(results):
            np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) * 3 + 2 * step)


def test_borrow_sends_tensors_and_strided_values_and_still_encodes_compressed_ones(one_server):
    torch = pytest.importorskip("torch")
    with connect([one_server]) as kv:
        kv.init(["t", "s"], [torch.zeros(4, 3), np.zeros((4, 3), np.float32)])
        kv.push("t", torch.arange(12, dtype=torch.float32).reshape(4, 3), borrow=True)
        weight = torch.zeros(4, 3)
        kv.pull("t", out=weight)
        assert weight.flatten().tolist() == list(range(12))
        strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]  # not contiguous
        kv.push("s", strided, borrow=True)
        out = np.empty((4, 3), np.float32)
        kv.pull("s", out=out)
        np.testing.assert_array_equal(out, strided)
    with connect([one_server]) as kv:  # a 2-bit key: borrow changes nothing
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init("c", np.zeros(64, np.float32))
        grad = np.where(np.arange(64) % 2 == 0, 0.7, -0.7).astype(np.float32)
        kv.push("c", grad, borrow=True)
        out = np.empty(64, np.float32)
        kv.pull("c", out=out)
        np.testing.assert_array_equal(out, np.where(np.arange(64) % 2 == 0, 0.5, -0.5))
