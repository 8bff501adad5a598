"""CuPy kernels of ``terngrad`` and ``qsgd``: payload bytes and push counts bit-identical to the
numpy reference, over many lengths, edge values, steps, misaligned views and chunked keys."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import require_cupy

from kvstore.codecs import codec_from_spec
from kvstore.codecs.quantize import ChunkPlace

cupy = require_cupy()

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 4095, 4097, 10007, 1_000_003]
SPECS = [
    {"type": "terngrad", "seed": 3},
    {"type": "terngrad", "clip": 0},
    {"type": "terngrad", "clip": 0.5},
    {"type": "qsgd", "seed": 3},
    {"type": "qsgd", "levels": 1, "bucket": 7},
    {"type": "qsgd", "levels": 127, "bucket": 5000},
    {"type": "qsgd", "levels": 6, "bucket": 9000, "seed": 1},
]
IDS = ["tern", "tern-noclip", "tern-clip05", "qsgd", "qsgd-1-7", "qsgd-127-5000", "qsgd-6-9000"]


def _inputs(n, seed):
    """Normal values, mixed magnitudes with signed zeros and subnormals, values near float32's
    largest, all subnormal, all zero, all equal: one per step."""
    rng = np.random.default_rng(seed)
    mixed = rng.standard_normal(n).astype(np.float32)
    picks = rng.integers(0, 5, n)
    mixed[picks == 0] = -0.0
    mixed[picks == 1] = rng.uniform(-1e-38, 1e-38, n)[picks == 1]
    mixed[picks == 2] *= 1e30
    return [
        rng.standard_normal(n).astype(np.float32),
        mixed,
        (np.sign(rng.standard_normal(n)) * rng.uniform(1e38, 3.4e38, n)).astype(np.float32),
        rng.uniform(-1e-39, 1e-39, n).astype(np.float32),
        np.where(rng.random(n) < 0.5, 0.0, -0.0).astype(np.float32),
        np.full(n, 0.375, np.float32),
    ]


def _encoders(spec, n, monkeypatch, start=5, worker=2):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numpy")
    codec = codec_from_spec(spec)
    place = ChunkPlace(start, n, 1234, worker)
    return codec.make_chunk_encoder(place), codec.make_chunk_encoder(place, cupy.cuda.Device(0))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_cupy_encodes_like_the_numpy_reference(spec, monkeypatch):
    for n in LENGTHS:
        cpu, gpu = _encoders(spec, n, monkeypatch)
        grads = _inputs(n, n)[: 2 if n > 100_000 else None]
        for step, g in enumerate(grads):  # the push count carries from step to step
            want = [bytes(f) for f in cpu.encode(g)]
            got = gpu.encode(cupy.asarray(g))
            assert all(isinstance(f, np.ndarray) for f in got)
            assert [bytes(f) for f in got] == want, (n, step)
            assert gpu.state()["step"] == cpu.state()["step"] == step + 1


@pytest.mark.parametrize("spec", SPECS[:1] + SPECS[3:5], ids=IDS[:1] + IDS[3:5])
def test_misaligned_views_and_many_steps(spec, monkeypatch):
    n = 10_007
    cpu, gpu = _encoders(spec, n, monkeypatch)
    rng = np.random.default_rng(0)
    for step in range(12):
        bigger = rng.standard_normal(n + 1).astype(np.float32)
        view = cupy.asarray(bigger)[1:]  # starts 4 bytes into its allocation
        assert view.data.ptr % 16 != 0
        want = [bytes(f) for f in cpu.encode(bigger[1:])]
        assert [bytes(f) for f in gpu.encode(view)] == want, step


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[3]], ids=["tern", "qsgd"])
def test_chunked_keys_and_checkpoints(spec, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numba")
    n = 70_001
    bounds = [(0, 30_000), (30_000, 65_536), (65_536, n)]
    codec = codec_from_spec(spec)
    cpu = codec.make_key_encoder("layer.3", n, "float32", bounds, worker=4)
    gpu = codec.make_key_encoder("layer.3", n, "float32", bounds, cupy.cuda.Device(0), worker=4)
    rng = np.random.default_rng(1)
    for _ in range(3):
        g = rng.standard_normal(n).astype(np.float32)
        d = cupy.asarray(g)
        cpu.begin(g)
        gpu.begin(d)
        for c_chunk, g_chunk, (a, b) in zip(cpu.chunks, gpu.chunks, bounds, strict=True):
            want = [bytes(f) for f in c_chunk.encode(g[a:b])]
            assert [bytes(f) for f in g_chunk.encode(d[a:b])] == want
    # a GPU encoder's state restores a CPU one, and back
    g = rng.standard_normal(n).astype(np.float32)
    restored = codec.make_key_encoder("layer.3", n, "float32", bounds, worker=4)
    for mine, theirs in zip(restored.chunks, gpu.chunks, strict=True):
        mine.load_state(theirs.state())
    for mine, theirs, (a, b) in zip(restored.chunks, gpu.chunks, bounds, strict=True):
        want = [bytes(f) for f in mine.encode(g[a:b])]
        assert [bytes(f) for f in theirs.encode(cupy.asarray(g[a:b]))] == want
