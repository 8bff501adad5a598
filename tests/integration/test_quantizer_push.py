"""The quantizing codecs against real servers: a pull returns exactly the sum of what the workers
sent (each chunk decoded with its own scales), with and without a server optimizer, for a key
split over two servers in several chunks and a small key whole on one."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import connect, run_ranks

from kvstore.codecs import codec_from_spec, registered_codecs
from kvstore.codecs.base import frame_array

pytestmark = pytest.mark.integration

BIG = 3001  # split over both servers (bigarray_bound below), several chunks each
SMALL = 40  # whole on one server
SPLIT = {"bigarray_bound": 1000, "partition_bytes": 4096}
STEPS = 3

SPECS = [
    {"type": "1bit"},
    {"type": "efsign"},
    {"type": "terngrad", "seed": 5},
    {"type": "qsgd", "levels": 15, "bucket": 64, "seed": 5},
    {"type": "fp16", "error_feedback": True},
    {"type": "bf16"},
]


def _available(spec):
    return pytest.param(
        spec,
        id=spec["type"],
        marks=pytest.mark.skipif(
            spec["type"] not in registered_codecs(), reason=f"{spec['type']} not built"
        ),
    )


def _gradients(rank, step):
    rng = np.random.default_rng(100 * rank + step)
    return [rng.normal(0, 1, n).astype(np.float32) for n in (BIG, SMALL)]


def _what_rank_sent(spec, rank, bounds):
    """Each step's decoded push of ``rank`` per key, from replicas of its encoders with the
    same chunks (the scales are per chunk) and the same rank (it keys the generator)."""
    codec = codec_from_spec(spec)
    replicas = [
        codec.make_key_encoder(key, n, "float32", bounds[key], worker=rank)
        for key, n in (("big", BIG), (7, SMALL))
    ]
    steps = []
    for step in range(STEPS):
        dense = []
        for key, replica, grad in zip(("big", 7), replicas, _gradients(rank, step), strict=True):
            replica.begin(grad)
            out = np.zeros(grad.size, np.float32)
            for chunk, (start, stop) in zip(replica.chunks, bounds[key], strict=True):
                frames = [frame_array(f, np.uint8) for f in chunk.encode(grad[start:stop])]
                codec.decode_into(frames, stop - start, out[start:stop], False, "numpy")
            dense.append(out)
        steps.append(dense)
    return steps


@pytest.mark.parametrize("spec", [_available(s) for s in SPECS])
@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_pulls_are_the_sum_of_what_the_workers_sent(spec, optimizer, two_servers_two_workers):
    def worker(rank):
        with connect(two_servers_two_workers, rank, 2, **SPLIT) as kv:
            kv.set_gradient_compression(spec)
            if optimizer is not None:
                kv.set_optimizer("sgd", learning_rate=0.5)
            kv.init(["big", 7], [np.zeros(BIG, np.float32), np.zeros(SMALL, np.float32)])
            assert len(kv._keys["big"].chunks) > 2  # the key is cut into chunks
            bounds = {key: [(c.start, c.stop) for c in kv._keys[key].chunks] for key in ("big", 7)}
            pulled = []
            for step in range(STEPS):
                outs = [np.empty(BIG, np.float32), np.empty(SMALL, np.float32)]
                kv.push(["big", 7], _gradients(rank, step))
                kv.pull(["big", 7], out=outs)
                pulled.append(outs)
            return pulled, bounds

    results = run_ranks(2, worker)
    bounds = results[0][1]
    sent = [_what_rank_sent(spec, rank, bounds) for rank in range(2)]
    weights = [np.zeros(BIG, np.float32), np.zeros(SMALL, np.float32)]
    for step in range(STEPS):
        for key in range(2):
            # two addends: the server's float32 sum is the same in either order
            total = sent[0][step][key] + sent[1][step][key]
            if optimizer is None:
                expected = total
            else:
                weights[key] -= np.float32(0.5) * total
                expected = weights[key]
            for rank in range(2):
                np.testing.assert_allclose(
                    results[rank][0][step][key], expected, rtol=1e-6, atol=1e-6
                )
            if optimizer is None:
                assert np.array_equal(results[0][0][step][key], expected)
