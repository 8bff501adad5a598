"""One rank of the DDP-hook job that tests/integration/test_torch_ddp.py starts under torchrun.

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the test sets KVSTORE_SERVERS and
nothing else of ours, so ``kvstore.create("dist_sync")`` takes the worker's place in the job
from torchrun's variables. The rank trains three copies of one model with DDP (gloo on
127.0.0.1), each on the same batches: with DDP's own allreduce, with the store's hook and no
compression, and with the hook and 2-bit compression. It writes its results to
``OUT/rank{R}.pt``.

    python -m torch.distributed.run --nproc-per-node 2 ... torch_ddp_worker.py OUT
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import kvstore
import kvstore.torch as kvt

STEPS = 4


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    kv = kvstore.create("dist_sync", timeout=60)
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same model everywhere (DDP would broadcast rank 0's anyway)
    model = torch.nn.Sequential(
        torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )  # fmt: skip
    runs = {
        "allreduce": None,
        "none": {"type": "none"},
        "2bit": {"type": "2bit", "threshold": 0.01},
    }
    models = {}
    for name, compression in runs.items():
        # Small buckets: several per step, so the hook sees more than the last one.
        ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.002)
        if compression is not None:
            state = kvt.DDPHookState(kv, compression=compression, prefix=f"ddp.{name}/")
            ddp.register_comm_hook(state, kvt.ddp_comm_hook)
        models[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(16, 10, generator=gen)
        y = torch.randint(0, 4, (16,), generator=gen)
        for ddp, opt in models.values():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    result = {
        "kv_rank": kv.rank,
        "kv_workers": kv.num_workers,
        "pushed": kv.stats().push_messages,
        "compression_ratio": kv.stats().compression_ratio,
        "params": {
            name: [p.detach().clone() for p in ddp.module.parameters()]
            for name, (ddp, _) in models.items()
        },
    }
    kv.close()
    dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
