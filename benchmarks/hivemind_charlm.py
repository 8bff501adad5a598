"""One worker of hivemind training the language-model example's transformer: the hivemind peer
of the language-model workload of :mod:`benchmarks.time_to_accuracy`, the twin of
:mod:`benchmarks.ddp_charlm`, set up as :mod:`benchmarks.hivemind_peer` says.

It trains what the DDP worker trains (:mod:`benchmarks.lm_training`: the example's model,
shards, windows and validation), inside ``hivemind.Optimizer``: the example's AdamW (betas,
weight decay) with its warm-up and cosine schedule as hivemind's scheduler, stepped every
round (one round is one step of every worker), and the gradient the optimizer applies clipped
at the example's norm first: the averaged one (as DDP clips its allreduced mean), or with
``--local-updates`` each worker's own (as the example's DiLoCo mode clips its inner steps').

Worker 0 prints the example's JSON keys every ``--eval-every`` steps and after the last, plus
``hivemind_epoch`` and ``hivemind_peers``.

    python -m benchmarks.hivemind_charlm --rank R --num-workers N --host IP --peer-file PATH \\
        [--compression {none,fp16,uint8}] [--local-updates] [--steps 300]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.hivemind_peer import (
    add_peer_arguments,
    evaluated_model,
    reporter,
    step_in_round,
    swarm,
)
from benchmarks.lm_training import (
    add_lm_arguments,
    check_lm_arguments,
    cross_entropy,
    load_language_model,
    train_lm,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_arguments(parser, run_id="charlm")
    add_lm_arguments(parser)
    args = parser.parse_args(argv)
    check_lm_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    lm = load_language_model(args)
    network = lm.network

    def adamw(params: Any) -> torch.optim.Optimizer:
        opt = lm.adamw(params, args.lr)
        # clip what this optimizer is about to apply, wherever hivemind keeps its parameters
        opt.register_step_pre_hook(
            lambda opt, *_: lm.clip([p for group in opt.param_groups for p in group["params"]])
        )
        return opt

    def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        # the factor for the step after `rounds` rounds (steps count from 1)
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda rounds: lm.example.learning_rate(args, rounds + 1) / args.lr
        )

    with swarm(args, network, adamw, schedule) as opt:

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
            opt.zero_grad()
            loss = cross_entropy(network(inputs), targets)
            loss.backward()
            step_in_round(args, opt, len(inputs))
            return float(loss.item())

        evaluated = evaluated_model(args, network, opt)
        train_lm(args, lm, step, None, lambda: evaluated,
                 reporter(args, opt))  # fmt: skip


if __name__ == "__main__":
    main()
