"""One worker of torch DDP (gloo) training the MNIST example's model on the example's data: the
allreduce baseline of :mod:`benchmarks.time_to_accuracy`.

Same data shard per rank, model, batch size, seed, epoch order and SGD (with its momentum and
weight decay) as ``examples/mnist/train.py`` with ``--optimizer local``, through the benchmarks'
training runner (:func:`benchmarks.training.train_epochs`); DDP averages the gradients with gloo
allreduce, in fp32 or through torch's fp16 or PowerSGD hook (:mod:`benchmarks.ddp_hooks`).
Worker 0 prints a JSON line per epoch: mean loss, test accuracy and the epoch's seconds (its
evaluation included, as the example's).

    python -m benchmarks.ddp_mnist --master HOST:PORT --rank R --num-workers N \
        [--compress fp16 | --powersgd 4 --powersgd-start 31]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.ddp_hooks import add_hook_arguments, check_hook_arguments, wrap
from benchmarks.training import (
    add_worker_arguments,
    example_module,
    print_report,
    start_worker,
    steps_per_epoch,
    train_epochs,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    add_worker_arguments(parser)
    add_hook_arguments(parser)
    args = parser.parse_args(argv)
    check_hook_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    training = start_worker(args)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.num_workers,
    )
    data = example_module("mnist_data").load_data(args.rank, args.num_workers, torch.device("cpu"))
    network = example_module("mnist_models").make_model(args.model)
    model = wrap(network, args)  # (broadcasts rank 0's weights)
    opt = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd
    )
    loss_fn = nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(images), labels)
        loss.backward()  # DDP allreduces the gradients' mean in buckets, inside backward
        opt.step()
        return loss.item()

    steps = steps_per_epoch(training, args.num_workers)
    train_epochs(training, step, network, data, steps, print_report if args.rank == 0 else None)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
