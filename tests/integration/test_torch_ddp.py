"""DDP with the store's communication hook, two processes started by torchrun.

The job (``torch_ddp_worker.py``) runs under ``python -m torch.distributed.run`` with
``KVSTORE_SERVERS`` set and no ``KVSTORE_RANK`` / ``KVSTORE_NUM_WORKERS``: the workers find
their rank and the job's size in torchrun's ``RANK`` and ``WORLD_SIZE``. Each trains the same
model with plain DDP (gloo allreduce), with the hook and no compression, and with the hook and
2-bit compression, on the same batches.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvtest import start_servers, stop_processes

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("torch_ddp_worker.py")
STEPS = 4  # torch_ddp_worker.STEPS


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    servers = start_servers(1, 2)
    try:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("KVSTORE_RANK", "KVSTORE_NUM_WORKERS", "RANK", "WORLD_SIZE")
        }
        env.update(KVSTORE_SERVERS=servers[0].address, OMP_NUM_THREADS="1")
        job = subprocess.run(
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), str(WORKER), str(out),
            ],
            env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    finally:
        stop_processes([s.process for s in servers])
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def test_workers_take_their_place_from_torchrun(results):
    assert [r["kv_rank"] for r in results] == [0, 1]
    assert [r["kv_workers"] for r in results] == [2, 2]


def test_the_hook_without_compression_matches_plain_ddp(results):
    for result in results:
        plain, hooked = result["params"]["allreduce"], result["params"]["none"]
        for a, b in zip(plain, hooked, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    # DDP's buckets went through the servers, more than one per step once DDP rebuilt them
    # (after the first step) at bucket_cap_mb, for both hooked models (torchrun's two workers
    # share a host, so each pushed a share of them)
    assert results[0]["pushed"] + results[1]["pushed"] > 2 * STEPS


def test_the_hook_with_2bit_keeps_the_workers_identical(results):
    first, second = (r["params"]["2bit"] for r in results)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    plain = results[0]["params"]["allreduce"]
    assert not all(torch.equal(a, b) for a, b in zip(first, plain, strict=True))
    assert results[0]["compression_ratio"] > 1
