"""CuPy kernels of the sign quantizers ``1bit`` and ``efsign``: payload bytes and residual
bit-identical to the numpy reference over many lengths, edge values (subnormals, -0.0, values
near float32's largest, saturated sums), a misaligned view and many pushes; the GPU encoder's
checkpoint round trip."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import require_cupy

from kvstore.codecs import get_codec

cupy = require_cupy()

pytestmark = pytest.mark.gpu

NAMES = ["1bit", "efsign"]
LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 4095, 4096, 4097, 10007, 1_000_003]
FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
TINY = np.float32(1e-45)


def _cpu(name, n, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numpy")
    return get_codec(name).make_encoder(n, "float32")


def _gpu(name, n):
    return get_codec(name).make_encoder(n, "float32", cupy.cuda.Device(0))


def _push(encoder, values):
    frames = encoder.encode(values)
    residual = encoder.residual
    residual = residual.get() if isinstance(residual, cupy.ndarray) else residual
    return bytes(memoryview(frames[0])), bytes(memoryview(frames[1])), residual.tobytes()


def _inputs(rng, n):
    """One per push: normal values with zeros of both signs and subnormals, heavy tails down to
    subnormals, values near float32's largest (twice: the second push saturates r + g), ties."""
    normal = rng.standard_normal(n).astype(np.float32)
    if n:
        normal[rng.integers(0, n, max(1, n // 7))] = -0.0
        normal[rng.integers(0, n, max(1, n // 9))] = 0.0
        normal[rng.integers(0, n, max(1, n // 11))] = -TINY * np.float32(3)
    signs = np.where(rng.random(n) < 0.5, np.float32(-1), np.float32(1))
    huge = signs * FLOAT32_MAX * rng.uniform(0.9, 1, n).astype(np.float32)
    return [
        normal,
        (signs * 10.0 ** rng.uniform(-45, 3, n)).astype(np.float32),
        huge,
        huge,
        rng.choice(np.array([0.5, -0.5, 0.0, -0.0, 1.0], np.float32), n),
        np.zeros(n, np.float32),
    ]


@pytest.mark.parametrize("name", NAMES)
def test_cupy_encodes_like_the_numpy_reference(name, monkeypatch):
    rng = np.random.default_rng(len(name))
    for n in LENGTHS:
        cpu, gpu = _cpu(name, n, monkeypatch), _gpu(name, n)
        for step, g in enumerate(_inputs(rng, n)):
            assert _push(gpu, cupy.asarray(g)) == _push(cpu, g), (n, step)


@pytest.mark.parametrize("name", NAMES)
def test_edge_chunks(name, monkeypatch):
    n = 4097
    rng = np.random.default_rng(2)
    chunks = [
        np.full(n, -0.0, np.float32),
        np.full(n, 0.375, np.float32),
        np.full(n, -2.5, np.float32),
        -TINY * rng.integers(1, 1000, n).astype(np.float32),
        TINY * rng.integers(-1000, 1000, n).astype(np.float32),
        np.full(n, FLOAT32_MAX, np.float32),
        np.full(n, -FLOAT32_MAX, np.float32),
    ]
    for i, g in enumerate(chunks):
        cpu, gpu = _cpu(name, n, monkeypatch), _gpu(name, n)
        for step in range(2):
            assert _push(gpu, cupy.asarray(g)) == _push(cpu, g), (i, step)


@pytest.mark.parametrize("name", NAMES)
def test_a_misaligned_view(name, monkeypatch):
    n = 10_001
    rng = np.random.default_rng(3)
    base = rng.standard_normal(n + 3).astype(np.float32)
    device_base = cupy.asarray(base)
    for offset in (1, 2, 3):
        cpu, gpu = _cpu(name, n, monkeypatch), _gpu(name, n)
        for _ in range(2):
            values = device_base[offset : offset + n]
            assert values.data.ptr % 16 != 0
            assert _push(gpu, values) == _push(cpu, base[offset : offset + n]), offset


@pytest.mark.parametrize("name", NAMES)
def test_many_pushes_carry_the_residual(name, monkeypatch):
    n = 65_537
    rng = np.random.default_rng(4)
    cpu, gpu = _cpu(name, n, monkeypatch), _gpu(name, n)
    for step in range(12):
        g = (rng.standard_normal(n) * (1 + step % 4)).astype(np.float32)
        assert _push(gpu, cupy.asarray(g)) == _push(cpu, g), step


@pytest.mark.parametrize("name", NAMES)
def test_key_chunks_and_checkpoint_on_the_gpu(name, monkeypatch):
    n, bounds = 9000, [(0, 4000), (4000, 9000)]
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numpy")
    cpu = get_codec(name).make_key_encoder("w", n, "float32", bounds)
    gpu = get_codec(name).make_key_encoder("w", n, "float32", bounds, cupy.cuda.Device(0))
    for g in grads[:2]:
        device_g = cupy.asarray(g)
        cpu.begin(g)
        gpu.begin(device_g)
        for (start, stop), c, d in zip(bounds, cpu.chunks, gpu.chunks, strict=True):
            assert _push(d, device_g[start:stop]) == _push(c, g[start:stop])
    restored = get_codec(name).make_key_encoder("w", n, "float32", bounds, cupy.cuda.Device(0))
    for source, target in zip(gpu.chunks, restored.chunks, strict=True):
        target.load_state(source.state())
    device_g = cupy.asarray(grads[2])
    for (start, stop), a, b in zip(bounds, gpu.chunks, restored.chunks, strict=True):
        assert _push(b, device_g[start:stop]) == _push(a, device_g[start:stop])
