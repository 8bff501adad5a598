"""CuPy 2-bit kernels: bit parity with the numpy reference and the CPU kernel; GPU values."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import require_cupy

import kvstore
from kvstore.codecs import get_codec, twobit

cupy = require_cupy()

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 15, 16, 17, 31, 33, 1000, 4097, 65_537, 1_000_003]


def _inputs(rng, n, threshold):
    parts = [
        rng.standard_normal(n) * threshold * 1.5,
        rng.choice(np.array([threshold, -threshold, 0.0, -0.0, 2 * threshold]), n),
        np.sign(rng.standard_normal(n)) * 10.0 ** rng.uniform(-42, 30, n),
    ]
    return [p.astype(np.float32) for p in parts]


@pytest.mark.parametrize("threshold", [1e-3, 0.5, 3.75])
def test_encode_and_decode_match_the_cpu_bit_for_bit(threshold):
    rng = np.random.default_rng(int(threshold * 1000))
    for n in LENGTHS:
        r_cpu = (rng.standard_normal(n) * threshold * 0.5).astype(np.float32)
        r_gpu = cupy.asarray(r_cpu)
        for step, g in enumerate(_inputs(rng, n, threshold)):  # residual carried over steps
            words_cpu = twobit.encode(g, r_cpu, threshold, kernels="numpy")
            words_gpu = twobit.encode(cupy.asarray(g), r_gpu, threshold)
            assert words_gpu.get().tobytes() == words_cpu.tobytes(), (n, step)
            assert np.array_equal(r_gpu.get().view(np.uint32), r_cpu.view(np.uint32)), (n, step)
            dec_cpu = twobit.decode(words_cpu, n, threshold, kernels="numba")
            dec_gpu = twobit.decode(words_gpu, n, threshold)
            assert np.array_equal(dec_gpu.get(), dec_cpu)
            acc = cupy.ones(n, cupy.float32)
            twobit.decode(words_gpu, n, threshold, acc, accumulate=True)
            assert np.array_equal(acc.get(), np.float32(1) + dec_cpu)


def test_worked_example_on_the_gpu():
    g = cupy.asarray([0.6, -0.7, 0.1, 0.5, -0.5] + [0.0] * 10 + [1.0, 0.9], dtype=cupy.float32)
    r = cupy.zeros(17, cupy.float32)
    words = twobit.encode(g, r, 0.5)
    assert words.get().tobytes().hex() == "e3800003c0000000"


def test_gpu_encoder_writes_pinned_host_frames_equal_to_the_cpu_encoder():
    codec = get_codec("2bit", threshold=0.25)
    gpu = codec.make_encoder(100_003, "float32", device=cupy.cuda.Device(0))
    cpu = codec.make_encoder(100_003, "float32")
    rng = np.random.default_rng(0)
    for _ in range(3):
        g = rng.standard_normal(100_003).astype(np.float32)
        (frame_gpu,) = gpu.encode(cupy.asarray(g))
        (frame_cpu,) = cpu.encode(g)
        assert isinstance(frame_gpu, np.ndarray)
        assert bytes(frame_gpu) == bytes(frame_cpu)


def test_cupy_values_through_the_store_keep_their_device():
    with kvstore.create("local") as kv:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init("w", cupy.zeros(17, cupy.float32))
        g = cupy.asarray([0.6, -0.7, 0.1, 0.5, -0.5] + [0.0] * 10 + [1.0, 0.9], cupy.float32)
        kv.push("w", g)
        out = cupy.empty(17, cupy.float32)
        kv.pull("w", out=out)
        assert isinstance(out, cupy.ndarray)
        expected = [0.5, -0.5, 0, 0.5, -0.5] + [0] * 10 + [0.5, 0.5]
        assert out.get().tolist() == expected


def test_torch_cuda_tensors():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    with kvstore.create("local") as kv:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        weight = torch.zeros(4, 4, device="cuda")
        kv.init("w", weight)
        kv.push("w", torch.full((4, 4), 0.75, device="cuda"))
        kv.pull("w", out=weight)
        assert weight.device.type == "cuda"
        assert weight.flatten().tolist() == [0.5] * 16


@pytest.mark.parametrize("workers", [1, 2, 5, 8])
def test_relayed_sum_on_the_gpu_matches_the_server_sum(workers):
    codec = get_codec("2bit", threshold=0.02)
    rng = np.random.default_rng(workers)
    for n in LENGTHS[1:]:
        pushes = []
        for _ in range(workers):
            g = rng.normal(0, 0.03, n).astype(np.float32)
            pushes.append([twobit.encode(g, np.zeros(n, np.float32), 0.02).tobytes()])
        aggregator = codec.make_aggregator(n, "float32")
        for i, payloads in enumerate(pushes):
            aggregator.add(payloads, first=i == 0)
        out = cupy.full(n, cupy.nan, cupy.float32)
        codec.sum_relay(pushes, n, "float32", out)
        assert out.get().tobytes() == aggregator.result.tobytes()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_subnormals_are_kept_like_numpy(clip):
    """CuPy compiles with flush-to-zero; the kernels' adds must keep subnormals as numpy does."""
    rng = np.random.default_rng(11)
    n = 4099
    tiny = (rng.choice([-1.0, 1.0], n) * rng.uniform(1e-45, 1e-38, n)).astype(np.float32)
    codec = get_codec("2bit", threshold=0.5, **({} if clip is None else {"residual_clip": clip}))
    gpu = codec.make_encoder(n, "float32", device=cupy.cuda.Device(0))
    cpu = codec.make_encoder(n, "float32")
    for _ in range(2):
        (frame_gpu,) = gpu.encode(cupy.asarray(tiny))
        (frame_cpu,) = cpu.encode(tiny)
        assert bytes(frame_gpu) == bytes(frame_cpu)
        assert np.array_equal(gpu.residual.get().view(np.uint32), cpu.residual.view(np.uint32))
    words = cupy.zeros(twobit.packed_words(n), cupy.uint32)
    acc = cupy.asarray(tiny)
    twobit.decode(words, n, 0.5, acc, accumulate=True)
    assert np.array_equal(acc.get().view(np.uint32), (tiny + np.float32(0)).view(np.uint32))
