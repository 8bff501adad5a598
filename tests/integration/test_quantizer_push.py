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


def _built(specs):
    return [spec for spec in specs if spec["type"] in registered_codecs()]


def _keys(spec):
    return [f"{spec['type']}/big", f"{spec['type']}/small"]


def _gradients(rank, step):
    rng = np.random.default_rng(100 * rank + step)
    return [rng.normal(0, 1, n).astype(np.float32) for n in (BIG, SMALL)]


def _what_rank_sent(spec, rank, bounds):
    """Each step's decoded push of ``rank`` per key, from replicas of its encoders with the
    same chunks (the scales are per chunk) and the same rank (it keys the generator)."""
    codec = codec_from_spec(spec)
    keys = _keys(spec)
    replicas = [
        codec.make_key_encoder(key, n, "float32", bounds[key], worker=rank)
        for key, n in zip(keys, (BIG, SMALL), strict=True)
    ]
    steps = []
    for step in range(STEPS):
        dense = []
        for key, replica, grad in zip(keys, replicas, _gradients(rank, step), strict=True):
            replica.begin(grad)
            out = np.zeros(grad.size, np.float32)
            for chunk, (start, stop) in zip(replica.chunks, bounds[key], strict=True):
                frames = [frame_array(f, np.uint8) for f in chunk.encode(grad[start:stop])]
                codec.decode_into(frames, stop - start, out[start:stop], False, "numpy")
            dense.append(out)
        steps.append(dense)
    return steps


@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_pulls_are_the_sum_of_what_the_workers_sent(optimizer, two_servers_two_workers):
    specs = _built(SPECS)  # every codec on keys of its own, in one job

    def worker(rank):
        with connect(two_servers_two_workers, rank, 2, **SPLIT) as kv:
            if optimizer is not None:
                kv.set_optimizer("sgd", learning_rate=0.5)
            for spec in specs:
                zeros = [np.zeros(BIG, np.float32), np.zeros(SMALL, np.float32)]
                kv.init(_keys(spec), zeros, compression=spec)
            assert len(kv._shared.keys[_keys(specs[0])[0]].chunks) > 2  # the key is cut into chunks
            bounds = {
                key: [(c.start, c.stop) for c in kv._shared.keys[key].chunks]
                for spec in specs
                for key in _keys(spec)
            }
            pulled = []
            for step in range(STEPS):
                outs = {}
                for spec in specs:
                    outs[spec["type"]] = [np.empty(BIG, np.float32), np.empty(SMALL, np.float32)]
                    kv.push(_keys(spec), _gradients(rank, step))
                for spec in specs:
                    kv.pull(_keys(spec), out=outs[spec["type"]])
                pulled.append(outs)
            return pulled, bounds

    results = run_ranks(2, worker)
    bounds = results[0][1]
    for spec in specs:
        name = spec["type"]
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
                    got = results[rank][0][step][name][key]
                    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6, err_msg=name)
                if optimizer is None:
                    assert np.array_equal(results[0][0][step][name][key], expected), name
