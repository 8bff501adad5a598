"""One worker of hivemind training the MNIST example's model on the example's data: the hivemind
peer of :mod:`benchmarks.time_to_accuracy`, the twin of :mod:`benchmarks.ddp_mnist`, set up as
:mod:`benchmarks.hivemind_peer` says.

Same data shard per rank, model, batch size, seed, epoch order, steps per epoch and SGD (with its
momentum and weight decay) as the DDP worker, through the benchmarks' training runner
(:func:`benchmarks.training.train_epochs`), inside ``hivemind.Optimizer``.

Worker 0 prints a JSON line per epoch: the training runner's keys plus ``hivemind_epoch`` (the
collective rounds done so far) and ``hivemind_peers`` (the peers hivemind's progress tracker
saw).

    python -m benchmarks.hivemind_mnist --rank R --num-workers N --host IP --peer-file PATH \\
        [--compression {none,fp16,uint8}] [--local-updates]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from benchmarks.hivemind_peer import (
    add_peer_arguments,
    evaluated_model,
    reporter,
    step_in_round,
    swarm,
)
from benchmarks.training import (
    add_worker_arguments,
    example_module,
    start_worker,
    steps_per_epoch,
    train_epochs,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_arguments(parser, run_id="mnist")
    add_worker_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    training = start_worker(args)
    data = example_module("mnist_data").load_data(args.rank, args.num_workers, torch.device("cpu"))
    model = example_module("mnist_models").make_model(args.model)
    loss_fn = nn.CrossEntropyLoss()

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.wd)

    with swarm(args, model, sgd) as opt:

        def step(images: torch.Tensor, labels: torch.Tensor) -> float:
            opt.zero_grad()
            loss = loss_fn(model(images), labels)
            loss.backward()
            step_in_round(args, opt, len(labels))
            return float(loss.item())

        steps = steps_per_epoch(training, args.num_workers)
        evaluated = evaluated_model(args, model, opt)
        train_epochs(training, step, evaluated, data, steps, reporter(args, opt))


if __name__ == "__main__":
    main()
