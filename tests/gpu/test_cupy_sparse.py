"""CuPy code of the sparse codecs: payload bytes and state bit-identical to the numpy reference
and the CPU kernels, over many lengths and steps; relays into GPU memory; GPU values in a
store."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import require_cupy

import kvstore
from kvstore.codecs import get_codec

cupy = require_cupy()

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 15, 16, 17, 31, 33, 2047, 2048, 2049, 4097, 65_537, 1_000_003]
SPECS = [
    {"type": "threshold", "threshold": 1.2},
    {"type": "topk", "ratio": 0.05, "sample": 0},
    {"type": "topk", "ratio": 0.01},
    {"type": "topk", "ratio": 0.001, "sample": 0.2},
    {"type": "randomk", "ratio": 0.05, "seed": 7},
    {"type": "dgc", "ratio": 0.01},
    {"type": "dgc", "ratio": 0.001, "nesterov": True, "clip_norm": 3.0, "warmup_steps": 3},
    {"type": "dgc", "ratio": 0.02, "momentum": 0.5, "sample": 0},
]
IDS = [
    "threshold",
    "topk-exact",
    "topk",
    "topk-wide-sample",
    "randomk",
    "dgc",
    "dgc-nesterov-clip-warmup",
    "dgc-exact",
]


def _codec(spec):
    return get_codec(spec["type"], **{k: v for k, v in spec.items() if k != "type"})


def _bounds(n, chunks=3):
    cut = [0, *(n * i // chunks for i in range(1, chunks)), n]
    return list(zip(cut[:-1], cut[1:], strict=True))


def _inputs(rng, n):
    """Normal values, heavy tails down to subnormals, ties, zeros: one per step."""
    return [
        rng.standard_normal(n).astype(np.float32),
        (np.sign(rng.standard_normal(n)) * 10.0 ** rng.uniform(-42, 3, n)).astype(np.float32),
        rng.choice(np.array([0.5, -0.5, 0.0, -0.0, 1.0], np.float32), n),
        np.zeros(n, np.float32),
        rng.standard_normal(n).astype(np.float32) * np.float32(0.01),
    ]


def _frames(key_encoder):
    return [[bytes(memoryview(f)) for f in c.encode(None)] for c in key_encoder.chunks]


def _state(key_encoder):
    return [{k: v.tobytes() for k, v in c.state().items()} for c in key_encoder.chunks]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_payloads_and_state_match_the_cpu_bit_for_bit(spec, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numba")
    rng = np.random.default_rng(len(str(spec)))
    for n in LENGTHS:
        bounds = _bounds(n) if n else [(0, 0)]
        cpu = _codec(spec).make_key_encoder("w", n, "float32", bounds)
        gpu = _codec(spec).make_key_encoder("w", n, "float32", bounds, cupy.cuda.Device(0))
        for step, g in enumerate(_inputs(rng, n)):
            cpu.begin(g)
            gpu.begin(cupy.asarray(g))
            assert _frames(gpu) == _frames(cpu), (n, step)
            assert _state(gpu) == _state(cpu), (n, step)


@pytest.mark.parametrize("spec", [SPECS[2], SPECS[6]], ids=[IDS[2], IDS[6]])
def test_the_numpy_reference_agrees_too(spec, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numpy")
    rng = np.random.default_rng(1)
    n = 300_007
    cpu = _codec(spec).make_key_encoder(5, n, "float32", _bounds(n))
    gpu = _codec(spec).make_key_encoder(5, n, "float32", _bounds(n), cupy.cuda.Device(0))
    for g in _inputs(rng, n):
        cpu.begin(g)
        gpu.begin(cupy.asarray(g))
        assert _frames(gpu) == _frames(cpu)
    assert _state(gpu) == _state(cpu)


def test_state_moves_between_host_and_gpu_encoders():
    spec = SPECS[5]
    n = 10_001
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    gpu = _codec(spec).make_key_encoder("w", n, "float32", _bounds(n), cupy.cuda.Device(0))
    for g in grads[:2]:
        gpu.begin(cupy.asarray(g))
    cpu = _codec(spec).make_key_encoder("w", n, "float32", _bounds(n))
    for chunk, saved in zip(cpu.chunks, [c.state() for c in gpu.chunks], strict=True):
        chunk.load_state(saved)
    for g in grads[2:]:
        gpu.begin(cupy.asarray(g))
        cpu.begin(g)
        assert _frames(gpu) == _frames(cpu)


def test_nan_is_refused_on_the_gpu_before_the_state_changes():
    gpu = _codec(SPECS[2]).make_key_encoder("w", 100, "float32", [(0, 100)], cupy.cuda.Device(0))
    gpu.begin(cupy.ones(100, cupy.float32))
    saved = _state(gpu)
    bad = cupy.ones(100, cupy.float32)
    bad[7] = cupy.nan
    with pytest.raises(kvstore.CodecError, match="NaN"):
        gpu.begin(bad)
    assert _state(gpu) == saved


def test_relays_sum_into_gpu_memory_like_the_server():
    codec = _codec(SPECS[2])
    rng = np.random.default_rng(3)
    n = 50_000
    pushes = []
    for scale in (1.0, 1e-39, -1e-39, 1.0):  # subnormal sums too
        idx = np.sort(rng.choice(n, 3000, replace=False)).astype(np.uint32)
        values = (rng.standard_normal(3000) * scale).astype(np.float32)
        pushes.append([idx.tobytes(), values.tobytes()])
    host = np.full(n, np.nan, np.float32)
    codec.sum_relay(pushes, n, "float32", host)
    device = cupy.full(n, cupy.nan, cupy.float32)
    codec.sum_relay(pushes, n, "float32", device)
    assert device.get().tobytes() == host.tobytes()


def test_cupy_values_through_the_store():
    with kvstore.create("local", timeout=30, partition_bytes=4096) as kv:
        kv.set_gradient_compression({"type": "topk", "ratio": 0.1})
        kv.init("w", cupy.zeros(3001, cupy.float32))
        g = np.random.default_rng(4).standard_normal(3001).astype(np.float32)
        kv.push("w", cupy.asarray(g))
        out = cupy.empty(3001, cupy.float32)
        kv.pull("w", out=out)
        assert isinstance(out, cupy.ndarray)
    replica = _codec({"type": "topk", "ratio": 0.1}).make_key_encoder(
        "w", 3001, "float32", [(0, 3001)]
    )
    replica.begin(g)
    idx, val = replica.chunks[0].encode(g)
    expected = np.zeros(3001, np.float32)
    expected[idx.astype(np.int64)] = val
    assert out.get().tobytes() == expected.tobytes()
