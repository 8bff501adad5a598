"""One worker of torchft training the MNIST example's model on the example's data: the
local-update peer of :mod:`benchmarks.time_to_accuracy` (torchft's DiLoCo or LocalSGD over gloo,
:mod:`benchmarks.torchft_peer`).

It mirrors :mod:`benchmarks.ddp_mnist`: the same data shard per rank, model (the same initial
weights, from the seed), batch size, epoch order, steps per epoch and inner SGD (its momentum and
weight decay), through the benchmarks' training runner (:func:`benchmarks.training.train_epochs`).
The steps an epoch takes after its last sync count towards the next sync, and those after the
run's last sync are not in the evaluated model (the last global model the job synced).

Worker 0 prints a JSON line per epoch: mean loss, test accuracy and the epoch's seconds (its
evaluation included, as the example's).

    python -m benchmarks.torchft_mnist --rank R --num-workers N --host IP \\
        --lighthouse HOST:PORT [--start-lighthouse] [--mode diloco --sync-every H]
"""

from __future__ import annotations

import argparse

from benchmarks.torchft_peer import TorchftWorker, add_peer_arguments, check_peer_arguments
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
    add_peer_arguments(parser)
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    check_peer_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from torch import nn

    training = start_worker(args)
    data = example_module("mnist_data").load_data(args.rank, args.num_workers, torch.device("cpu"))
    network = example_module("mnist_models").make_model(args.model)
    opt = torch.optim.SGD(
        network.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd
    )
    loss_fn = nn.CrossEntropyLoss()
    with TorchftWorker(args, network, opt) as job:

        def step(images: torch.Tensor, labels: torch.Tensor) -> float:
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(network(images), labels)
            loss.backward()
            opt.step()  # torchft's hooks on it sync every H steps
            job.synced.refresh()
            return float(loss.item())

        steps = steps_per_epoch(training, args.num_workers)
        report = print_report if args.rank == 0 else None
        train_epochs(training, step, job.synced.model, data, steps, report)


if __name__ == "__main__":
    main()
