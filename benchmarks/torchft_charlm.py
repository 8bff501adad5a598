"""One worker of torchft training the language-model example's transformer: the local-update
peer of the language-model workload of :mod:`benchmarks.time_to_accuracy` (torchft's DiLoCo or
LocalSGD over gloo, :mod:`benchmarks.torchft_peer`).

Its inner training is the example's DiLoCo mode's (``examples/charlm/train.py --mode diloco``),
through :mod:`benchmarks.lm_training`: the same model, shards, windows, AdamW with the example's
schedule, and each worker's own gradient clipped at the example's norm before every inner step.
Every ``--sync-every`` H steps torchft syncs (DiLoCo: the outer Nesterov SGD on the averaged
pseudo-gradient; LocalSGD: the average of the weights). Worker 0 evaluates the last model the
job synced and prints the example's JSON keys every ``--eval-every`` steps and after the last.

    python -m benchmarks.torchft_charlm --rank R --num-workers N --host IP \\
        --lighthouse HOST:PORT [--start-lighthouse] [--mode diloco --sync-every 20]
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from benchmarks.lm_training import (
    add_lm_arguments,
    check_lm_arguments,
    cross_entropy,
    load_language_model,
    train_lm,
)
from benchmarks.torchft_peer import TorchftWorker, add_peer_arguments, check_peer_arguments
from benchmarks.training import print_report

if TYPE_CHECKING:
    import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_arguments(parser)
    add_lm_arguments(parser)
    args = parser.parse_args(argv)
    check_peer_arguments(parser, args)
    check_lm_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    lm = load_language_model(args)
    network = lm.network
    inner = lm.adamw(network.parameters(), args.lr)

    with TorchftWorker(args, network, inner) as job:

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
            inner.zero_grad(set_to_none=False)
            loss = cross_entropy(network(inputs), targets)
            loss.backward()
            lm.clip(network.parameters())
            inner.step()  # torchft's hooks on it sync every H steps
            job.synced.refresh()
            return float(loss.item())

        report = print_report if args.rank == 0 else None
        train_lm(args, lm, step, inner, lambda: job.synced.model,
                 report)  # fmt: skip


if __name__ == "__main__":
    main()
