"""CuPy kernels of ``powersgd``: both rounds' payloads, the error and the warm-start factor
bit-identical to the numpy reference, step after step (shapes past one CUDA tile, rows and
ranks off the kernels' block sizes, subnormals, a warm-up push); a GPU key through a store."""

from __future__ import annotations

import math

import numpy as np
import pytest
from codec_parity import host_bytes
from kvtest import connect, require_cupy, run_ranks

from kvstore.codecs import codec_from_spec

cupy = require_cupy()

pytestmark = pytest.mark.gpu

CASES = [
    ((48, 64), [(0, 1536), (1536, 3072)], 2),
    ((70, 45), [(0, 1350), (1350, 3150)], 5),  # 30 and 40 rows: partial tiles of 32
    ((300, 100), [(0, 30_000)], 9),  # rank above one block's 8 factor columns
    ((33, 1000), [(0, 33_000)], 4),  # rows past a tile, long rows
]


def _run(spec, shape, bounds, grads, on_gpu, monkeypatch):
    """Every step's (payload bytes, state bytes) of two workers, through one-chunk servers."""
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numpy")
    codec = codec_from_spec(spec)
    numel = math.prod(shape)
    device = cupy.cuda.Device(0) if on_gpu else None
    keys = [
        codec.make_key_encoder("w", numel, "float32", bounds, device, worker=w, shape=shape)
        for w in range(2)
    ]
    servers = [
        codec.make_chunk_aggregator(b - a, "float32", shape=shape, start=a) for a, b in bounds
    ]
    trace = []
    for step_grads in grads:
        values = [cupy.asarray(g) if on_gpu else g for g in step_grads]
        for key, value in zip(keys, values, strict=True):
            key.begin(value)
        for index, (start, stop) in enumerate(bounds):
            chunks = [key.chunks[index] for key in keys]
            agg = servers[index]
            sent = [
                [host_bytes(f) for f in c.encode(v[start:stop])]
                for c, v in zip(chunks, values, strict=True)
            ]
            for w, frames in enumerate(sent):
                agg.add(frames, w == 0)
            reply = agg.finish()
            if reply is not None:
                reply = [host_bytes(f) for f in reply]
                second = [[host_bytes(f) for f in c.next_round(reply)] for c in chunks]
                for w, frames in enumerate(second):
                    agg.add(frames, w == 0)
                assert agg.finish() is None
                ack = [host_bytes(f) for f in agg.reply_frames()]
                for c in chunks:
                    c.end_step(ack)
                sent += second
            states = [c.state() for c in chunks]
            trace.append(
                (sent, [np.ascontiguousarray(s[k]).tobytes() for s in states for k in sorted(s)])
            )
    return trace


@pytest.mark.parametrize("shape, bounds, rank", CASES, ids=lambda x: str(x)[:14])
def test_cupy_encodes_like_the_numpy_reference(shape, bounds, rank, monkeypatch):
    spec = {"type": "powersgd", "rank": rank, "warmup_steps": 1, "seed": 11}
    numel = math.prod(shape)
    rng = np.random.default_rng(rank)
    grads = [[rng.standard_normal(numel).astype(np.float32) for _ in range(2)] for _ in range(4)]
    grads[2][0][::5] = np.float32(3e-42)  # subnormal terms: no flush to zero
    grads[3][1][: numel // 2] = 0
    reference = _run(spec, shape, bounds, grads, False, monkeypatch)
    device = _run(spec, shape, bounds, grads, True, monkeypatch)
    for step, (want, got) in enumerate(zip(reference, device, strict=True)):
        assert got == want, f"push {step} differs"


def test_a_gpu_key_through_a_store(two_servers_two_workers):
    shape = (64, 48)
    u = np.random.default_rng(0).standard_normal((64, 2)).astype(np.float32)

    def worker(rank):
        grad = u @ np.random.default_rng(rank + 1).standard_normal((2, 48)).astype(np.float32)
        with connect(
            two_servers_two_workers, rank, 2, bigarray_bound=1000, partition_bytes=4096
        ) as kv:
            kv.set_gradient_compression({"type": "powersgd", "rank": 2})
            kv.init("w", np.zeros(shape, np.float32))
            out = cupy.zeros(shape, dtype=cupy.float32)
            kv.push("w", cupy.asarray(grad))
            kv.pull("w", out)
            return grad, out.get()

    (g0, out0), (g1, out1) = run_ranks(2, worker)
    assert np.allclose(out0, g0 + g1, atol=1e-5 * np.abs(g0 + g1).max())
    assert np.array_equal(out0, out1)
