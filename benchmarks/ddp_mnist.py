"""One worker of torch DDP (gloo) training the MNIST example's model on the example's data: the
allreduce baseline of :mod:`benchmarks.time_to_accuracy`.

Same data shard per rank, model, batch size, seed, epoch order and SGD (with its momentum and
weight decay) as ``examples/mnist/train.py`` with ``--optimizer local``; DDP averages the
gradients with gloo allreduce, in fp32 or through torch's PowerSGD communication hook. Worker 0
prints a JSON line per epoch: test accuracy and the epoch's seconds (its evaluation included, as
the example's).

    python -m benchmarks.ddp_mnist --master HOST:PORT --rank R --num-workers N [--powersgd 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "mnist"
sys.path.insert(0, str(EXAMPLE))

from mnist_data import load_data, train_images_per_worker  # noqa: E402
from mnist_models import make_model  # noqa: E402
from train import accuracy  # noqa: E402  (the example's own test accuracy)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--model", choices=["mlp", "cnn"], default="cnn")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--powersgd", type=int, default=0, metavar="RANK", help="PowerSGD hook rank (0: fp32)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.num_workers,
    )
    train_x, train_y, test_x, test_y = load_data(args.rank, args.num_workers, torch.device("cpu"))
    # (broadcasts rank 0's weights; with PowerSGD one bucket: torch's hook runs its gloo
    # collectives asynchronously, and two buckets' could interleave differently on each rank)
    bucket_mb = 1024 if args.powersgd else 25
    model = DistributedDataParallel(make_model(args.model), bucket_cap_mb=bucket_mb)
    if args.powersgd:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd, start_powerSGD_iter=2
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd
    )
    loss_fn = nn.CrossEntropyLoss()
    steps = train_images_per_worker(args.num_workers) // args.batch_size
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        shuffle = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
        order = torch.randperm(len(train_y), generator=shuffle)
        total = 0.0
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(model(train_x[batch]), train_y[batch])
            loss.backward()  # DDP allreduces the gradients' mean in buckets, inside backward
            opt.step()
            total += loss.item()
        if args.rank == 0:
            record = {
                "epoch": epoch,
                "loss": total / steps,
                "accuracy": accuracy(model.module, test_x, test_y),
                "seconds": time.perf_counter() - start,
            }
            print(json.dumps(record), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
