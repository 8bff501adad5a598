"""One worker of a host whose workers push GPU values, for ``test_host_group_cuda.py``:
``python host_gpu_worker.py SCENARIO OUTDIR LOCAL_RANK LOCAL_SIZE [SERVERS RANK NUM_WORKERS
PLACE CODEC]``. Each worker is a process of its own (CUDA IPC maps another process's memory,
never the process's own), and all of them use the one GPU.

* ``group``: the host group on its own (no servers): keys of CuPy values, of a CUDA tensor and of
  host values; the host's sum of each push and whether the key was summed on the GPU are saved.
* ``job``: a real job (servers at SERVERS): every rank pushes the same pseudo-random values,
  from PLACE (``cupy``: CuPy arrays; ``host``: numpy) with CODEC (``none`` or ``2bit``), and
  pulls; what it pulled is saved.
* ``torch``: ``kvstore.torch.DistributedOptimizer`` trains a small model on PLACE (``cuda`` or
  ``cpu``) for 3 steps; its weights, and whether its keys were summed on the GPU, are saved.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy
import numpy as np

STEPS = 3
SHAPES = {"odd": (100_003,), "matrix": (300, 257), "small": (5,)}
"""A key whose length is not a multiple of 16, one in several chunks, and a small one."""


def values(rank: int, step: int, shape: tuple[int, ...]) -> np.ndarray:
    """Rank ``rank``'s push of step ``step`` (not integer-valued: sums round)."""
    rng = np.random.default_rng([rank, step, int(np.prod(shape))])
    return rng.normal(0, 0.3, shape).astype(np.float32)


def group(outdir: Path, local_rank: int, local_size: int) -> None:
    from kvstore.config import ClusterConfig
    from kvstore.worker.host_group import HostGroup
    from kvstore.worker.request import Deadline

    tag = (f"ipc://{outdir}",)  # (names the host's group: one of its own for each test)
    cluster = ClusterConfig(tag, local_rank, local_size, local_rank, local_size)
    host = HostGroup(cluster, connect_timeout=60)
    deadline = Deadline(60)
    try:
        keys = {f"gpu-{k}": s for k, s in SHAPES.items()} | {"ints": (1000,), "host": (4099,)}
        for key, shape in keys.items():
            numel = int(np.prod(shape))
            dtype = "int32" if key == "ints" else "float32"
            host.add_key(key, numel, dtype, deadline, None if key == "host" else 0)
        saved: dict[str, np.ndarray] = {}
        for key in keys:
            saved[f"on_gpu/{key}"] = np.array(host.summed_on_gpu(key))
        for step in range(STEPS):
            pairs = []
            for key, shape in keys.items():
                if key == "ints":
                    pairs.append((key, cupy.full(shape, local_rank * 10 + step, np.int32)))
                elif key == "host":
                    pairs.append((key, values(local_rank, step, shape)))
                else:
                    pairs.append((key, cupy.asarray(values(local_rank, step, shape))))
            if step == STEPS - 1:
                torch = _torch()
                if torch is not None:  # a CUDA tensor into a GPU key
                    pairs[0] = (pairs[0][0], torch.as_tensor(pairs[0][1], device="cuda"))
            sums = host.host_sums(pairs, deadline)
            for (key, _), total in zip(pairs, sums, strict=True):
                saved[f"{key}/{step}"] = cupy.asnumpy(total).copy()
        np.savez(outdir / f"group_{local_rank}.npz", **saved)
    finally:
        host.close()


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def job(outdir: Path, local_rank: int, local_size: int, args: list[str]) -> None:
    import kvstore

    servers, rank, num_workers, place, codec = args
    kv = kvstore.create(
        "dist_sync",
        servers=servers.split(","),
        rank=int(rank),
        num_workers=int(num_workers),
        local_rank=local_rank,
        local_size=local_size,
        bigarray_bound=50_000,
        partition_bytes=64 * 1024,
        timeout=60,
    )
    xp = cupy if place == "cupy" else np
    saved: dict[str, np.ndarray] = {}
    with kv:
        if codec != "none":
            kv.set_gradient_compression({"type": codec, "threshold": 0.25})
        keys = list(SHAPES)
        kv.init(keys, [xp.zeros(s, np.float32) for s in SHAPES.values()])
        for key in keys:
            saved[f"on_gpu/{key}"] = np.array(kv._host.summed_on_gpu(key))
        for step in range(STEPS):
            kv.push(keys, [xp.asarray(values(int(rank), step, s)) for s in SHAPES.values()])
            outs = [xp.empty(s, np.float32) for s in SHAPES.values()]
            kv.pull(keys, out=outs)
            for key, out in zip(keys, outs, strict=True):
                saved[f"{key}/{step}"] = cupy.asnumpy(out) if place == "cupy" else out
    np.savez(outdir / f"job_{place}_{codec}_{rank}.npz", **saved)


def train(outdir: Path, local_rank: int, local_size: int, args: list[str]) -> None:
    import torch

    import kvstore
    import kvstore.torch as kvt

    servers, rank, num_workers, place = args
    torch.manual_seed(0)  # every rank starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    model = model.to(place)
    kv = kvstore.create("dist_sync", servers=servers.split(","), rank=int(rank),
                        num_workers=int(num_workers), local_rank=local_rank,
                        local_size=local_size, timeout=60)  # fmt: skip
    with kv:
        opt = kvt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model.named_parameters(),
            kv=kv,
        )
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * int(rank) + step)
            x = torch.randn(8, 6, generator=gen).to(place)
            y = torch.randint(0, 3, (8,), generator=gen).to(place)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        saved = {f"on_gpu/{key}": np.array(kv._host.summed_on_gpu(key)) for key in opt.keys}
    for name, value in model.state_dict().items():
        saved[name] = value.detach().cpu().numpy()
    np.savez(outdir / f"torch_{place}_{rank}.npz", **saved)


if __name__ == "__main__":
    scenario, out, local_rank, local_size, *rest = sys.argv[1:]
    if scenario == "group":
        group(Path(out), int(local_rank), int(local_size))
    elif scenario == "torch":
        train(Path(out), int(local_rank), int(local_size), rest)
    else:
        job(Path(out), int(local_rank), int(local_size), rest)
