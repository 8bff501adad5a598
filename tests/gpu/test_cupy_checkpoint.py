"""Checkpoints of GPU encoders: their state goes to the host and back, bit for bit, and a job
of CuPy values resumes exactly as one that never stopped."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import require_cupy

import kvstore
from kvstore.codecs import get_codec

cupy = require_cupy()

pytestmark = pytest.mark.gpu

N = 100_003


def _grads(steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.normal(0, 0.4, N).astype(np.float32) for _ in range(steps)]


def test_gpu_encoder_state_is_a_host_copy_and_loads_on_either_device():
    codec = get_codec("2bit", threshold=0.5)
    grads = _grads(6)
    gpu = codec.make_encoder(N, "float32", device=cupy.cuda.Device(0))
    for g in grads[:3]:
        gpu.encode(cupy.asarray(g))
    saved = gpu.state()
    assert isinstance(saved["residual"], np.ndarray) and np.count_nonzero(saved["residual"])
    on_gpu = codec.make_encoder(N, "float32", device=cupy.cuda.Device(0))
    on_gpu.load_state(saved)
    on_cpu = codec.make_encoder(N, "float32")
    on_cpu.load_state(saved)  # the kernels agree bit for bit, so the state moves freely
    for g in grads[3:]:
        (a,) = gpu.encode(cupy.asarray(g))
        (b,) = on_gpu.encode(cupy.asarray(g))
        (c,) = on_cpu.encode(g)
        assert bytes(a) == bytes(b) == bytes(c)
    assert gpu.state()["residual"].tobytes() == on_cpu.state()["residual"].tobytes()


def _job(steps, *, load=None, save=None):
    grads = _grads(6)
    with kvstore.create("local") as kv:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.set_optimizer("adam", learning_rate=0.01)
        kv.init("w", cupy.zeros(N, cupy.float32))
        if load is not None:
            kv.load_checkpoint(load)
        out = cupy.empty(N, cupy.float32)
        for step in steps:
            kv.push("w", cupy.asarray(grads[step]))
            kv.pull("w", out=out)
        if save is not None:
            kv.save_checkpoint(save)
        residual = [e.state()["residual"] for e in kv._shared.keys["w"].encoders]
        return out.get(), np.concatenate(residual)


def test_a_job_of_cupy_values_resumes_bit_identically(tmp_path):
    expected, expected_residual = _job(range(6))
    _job(range(3), save=tmp_path / "ckpt")
    got, residual = _job(range(3, 6), load=tmp_path / "ckpt")
    assert got.tobytes() == expected.tobytes()
    assert residual.tobytes() == expected_residual.tobytes()
