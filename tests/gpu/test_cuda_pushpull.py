"""CUDA values through real servers: 2 workers x 2 servers, torch CUDA tensors and CuPy arrays.

Pushes encode on the GPU and copy the payload to pinned host memory; pulled values land in the
caller's CUDA tensors through the pinned staging buffer (counted by ``TRANSFERS``). The sums
must equal what the same pushes give from host memory.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import connect, require_cupy, run_ranks

from kvstore.codecs import twobit, xp

cupy = require_cupy()
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA", allow_module_level=True)

SHAPES = {"w": (300, 257), "b": (17,)}


def _gradients(rank: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 * rank + step)
    return {k: rng.normal(0, 0.05, s).astype(np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("compression", [None, {"type": "2bit", "threshold": 0.02}])
@pytest.mark.parametrize("relay", [False, True])
def test_cuda_tensors_sum_like_host_values(servers_factory, compression, relay):
    if relay and compression is None:
        pytest.skip("dense pulls are not relayed")

    def run(rank: int, device: str, addresses: list[str]) -> list[dict[str, np.ndarray]]:
        kv = connect(addresses, rank, 2, partition_bytes=64 * 1024, pull_relay=relay)
        try:
            if compression:
                kv.set_gradient_compression(compression)
            names = list(SHAPES)
            params = [torch.zeros(SHAPES[k], device=device) for k in names]
            kv.init(names, params)
            pulled = []
            for step in range(3):
                grads = _gradients(rank, step)
                kv.push(names, [torch.from_numpy(grads[k]).to(device) for k in names])
                kv.pull(names, out=params)
                assert all(p.device.type == device for p in params)
                host = [p.cpu().numpy().copy() for p in params]
                pulled.append(dict(zip(names, host, strict=True)))
            return pulled
        finally:
            kv.close()

    before = xp.TRANSFERS.h2d_bytes
    gpu_addresses = servers_factory(2, 2)
    gpu = run_ranks(2, lambda r: run(r, "cuda", gpu_addresses), timeout=120)
    assert xp.TRANSFERS.h2d_bytes > before  # pulled values came through pinned staging
    cpu_addresses = servers_factory(2, 2)
    cpu = run_ranks(2, lambda r: run(r, "cpu", cpu_addresses), timeout=120)
    for rank in range(2):
        for step in range(3):
            for k in SHAPES:
                assert np.array_equal(gpu[rank][step][k], cpu[rank][step][k]), (rank, step, k)


def test_misaligned_views_encode_and_decode_like_the_cpu():
    """Views that do not start on a 16-byte boundary take the element-per-thread kernels."""
    rng = np.random.default_rng(7)
    for n in [1, 5, 16, 17, 1001, 65_539]:
        g = rng.normal(0, 0.4, n + 1).astype(np.float32)
        r_cpu = rng.normal(0, 0.2, n).astype(np.float32)
        g_gpu = cupy.asarray(g)[1:]
        r_gpu = cupy.zeros(n + 1, cupy.float32)[1:]
        r_gpu[...] = cupy.asarray(r_cpu)
        words_cpu = twobit.encode(g[1:].copy(), r_cpu, 0.5, kernels="numpy")
        words_gpu = twobit.encode(g_gpu, r_gpu, 0.5)
        assert words_gpu.get().tobytes() == words_cpu.tobytes(), n
        assert np.array_equal(r_gpu.get().view(np.uint32), r_cpu.view(np.uint32)), n
        acc = cupy.ones(n + 1, cupy.float32)[1:]
        twobit.decode(words_gpu, n, 0.5, acc, accumulate=True)
        expected = np.float32(1) + twobit.decode(words_cpu, n, 0.5, kernels="numpy")
        assert np.array_equal(acc.get(), expected), n


def test_transfers_through_pinned_staging_round_trip():
    rng = np.random.default_rng(3)
    host = rng.standard_normal(1_000_003).astype(np.float32)
    device = cupy.empty(host.size, cupy.float32)
    xp.host_to_device(host, device)
    back = xp.pinned_empty(host.size, np.float32)
    xp.device_to_host(device, back)
    assert np.array_equal(back, host)
    assert np.array_equal(xp.to_device(host.tobytes(), np.float32).get(), host)
    with pytest.raises(ValueError, match="bytes"):
        xp.host_to_device(host[:10], device)


def test_dlpack_view_shares_the_tensor_memory():
    from kvstore.worker import values

    tensor = torch.arange(10, dtype=torch.float32, device="cuda")
    flat = values.flat_source(tensor)
    assert isinstance(flat, cupy.ndarray)
    assert flat.data.ptr == tensor.data_ptr()
