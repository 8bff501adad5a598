"""Hierarchical aggregation of GPU values (docs/design.md, "Hierarchical aggregation"): the
workers of a host, each a process on the one GPU, sum their pushes in GPU memory they share
through CUDA IPC (:mod:`kvstore.worker.host_gpu`), and give the bits the host-memory path gives.

Both sum a host's pushes in local-rank order with one float32 add per element and step, so the
GPU path's sums equal the host path's and a numpy oracle's bit for bit (not only to rounding).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kvtest import REPO, require_cupy, start_servers, stop_processes

require_cupy()

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("host_gpu_worker.py")
sys.path.insert(0, str(WORKER.parent))
from host_gpu_worker import SHAPES, STEPS, values  # noqa: E402


def _run_workers(argvs: list[list[str]]) -> None:
    """Run one worker process per argv at once (each its own CUDA context on the one GPU);
    every one must succeed within the hang guard."""
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    processes = [
        subprocess.Popen([sys.executable, str(WORKER), *argv], env=env, stderr=subprocess.PIPE)
        for argv in argvs
    ]
    try:
        errors = [process.communicate(timeout=180)[1] for process in processes]
    finally:
        stop_processes(processes)
    for process, error in zip(processes, errors, strict=True):
        assert process.returncode == 0, error.decode()[-3000:]


def _run_job(scenario: list[str], workers: int, local_size: int, outdir: Path) -> None:
    """Run ``scenario`` (its name, then its arguments after the job's) as a job of its own:
    2 servers, and ``workers`` worker processes in hosts of ``local_size``."""
    name, *args = scenario
    servers = start_servers(2, workers)
    try:
        addresses = ",".join(s.address for s in servers)
        _run_workers([
            [name, str(outdir), str(r % local_size), str(local_size), addresses, str(r),
             str(workers), *args]
            for r in range(workers)
        ])  # fmt: skip
    finally:
        stop_processes([s.process for s in servers])


def _oracle(ranks: list[int], step: int, shape: tuple[int, ...]) -> np.ndarray:
    """The host's sum in local-rank order, one float32 add at a time."""
    total = values(ranks[0], step, shape).copy()
    for rank in ranks[1:]:
        total += values(rank, step, shape)
    return total


@pytest.mark.parametrize("local_size", [2, 3])
def test_processes_on_one_gpu_sum_through_cuda_ipc_as_host_memory_does(tmp_path, local_size):
    _run_workers([["group", str(tmp_path), str(r), str(local_size)] for r in range(local_size)])
    saved = [dict(np.load(tmp_path / f"group_{r}.npz")) for r in range(local_size)]
    ranks = list(range(local_size))
    for worker in saved:
        assert worker["on_gpu/host"] == np.array(False)
        for key in [f"gpu-{k}" for k in SHAPES] + ["ints"]:
            assert worker[f"on_gpu/{key}"] == np.array(True), key
        for step in range(STEPS):
            for name, shape in SHAPES.items():
                np.testing.assert_array_equal(worker[f"gpu-{name}/{step}"],
                                              _oracle(ranks, step, shape).ravel())  # fmt: skip
            np.testing.assert_array_equal(worker[f"host/{step}"], _oracle(ranks, step, (4099,)))
            expected = sum(rank * 10 + step for rank in ranks)
            np.testing.assert_array_equal(worker[f"ints/{step}"], np.full(1000, expected))


@pytest.mark.parametrize("codec", ["none", "2bit"])
def test_a_job_of_gpu_hosts_pulls_what_the_same_job_from_host_memory_pulls(tmp_path, codec):
    workers, local_size = 4, 2
    for place in ("cupy", "host"):
        _run_job(["job", place, codec], workers, local_size, tmp_path)
    for rank in range(workers):
        gpu = dict(np.load(tmp_path / f"job_cupy_{codec}_{rank}.npz"))
        host = dict(np.load(tmp_path / f"job_host_{codec}_{rank}.npz"))
        for key in SHAPES:
            assert gpu[f"on_gpu/{key}"] == np.array(True), key
            assert host[f"on_gpu/{key}"] == np.array(False), key
            for step in range(STEPS):
                np.testing.assert_array_equal(gpu[f"{key}/{step}"], host[f"{key}/{step}"])
    if codec == "none":  # the dense job's round is the sum of the two hosts' sums
        pulled = dict(np.load(tmp_path / f"job_cupy_{codec}_0.npz"))
        for key, shape in SHAPES.items():
            for step in range(STEPS):
                hosts = _oracle([0, 1], step, shape) + _oracle([2, 3], step, shape)
                np.testing.assert_allclose(pulled[f"{key}/{step}"], hosts, rtol=1e-6, atol=1e-6)


def test_kvstore_torch_on_gpu_hosts_sums_on_the_gpus_and_trains_as_on_the_cpu(tmp_path):
    pytest.importorskip("torch")
    workers, local_size = 4, 2
    for place in ("cuda", "cpu"):
        _run_job(["torch", place], workers, local_size, tmp_path)
    cpu = dict(np.load(tmp_path / "torch_cpu_0.npz"))
    for rank in range(workers):
        gpu = dict(np.load(tmp_path / f"torch_cuda_{rank}.npz"))
        flags = {k: v for k, v in gpu.items() if k.startswith("on_gpu/")}
        assert flags and all(bool(v) for v in flags.values()), flags
        for name, value in gpu.items():
            if not name.startswith("on_gpu/"):  # (cuBLAS rounds its products its own way)
                np.testing.assert_allclose(value, cpu[name], rtol=1e-4, atol=1e-5, err_msg=name)
