"""One worker of torch DDP (gloo) training the language-model example's transformer: the
allreduce baseline of the language-model workload.

It trains what ``examples/charlm/train.py --mode sync`` trains, the example's way, with the
example's own functions: the same byte-level transformer (``--layers``, ``--width``,
``--heads``, ``--context``), each rank's contiguous shard of the corpus, the same random
windows per rank and step (``--seed``), AdamW with the example's betas, weight decay,
warm-up and cosine schedule, the averaged gradient clipped at the example's norm before every
step, and the same fixed validation windows. DDP averages the gradients with gloo allreduce, in
fp32 or through torch's fp16 or PowerSGD hook (:mod:`benchmarks.ddp_hooks`).

Every ``--eval-every`` steps (and after the last) worker 0 prints one JSON line with the
example's keys: ``step``, ``samples``, ``loss`` (its training loss since the last line),
``val_loss``, ``perplexity`` and ``seconds`` since training started, evaluations included.

    python -m benchmarks.ddp_charlm --master HOST:PORT --rank R --num-workers N \\
        [--compress fp16 | --powersgd 4 --powersgd-start 30] [--steps 300]
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch.distributed as dist

from benchmarks.ddp_hooks import add_hook_arguments, check_hook_arguments, wrap
from benchmarks.lm_training import (
    add_lm_arguments,
    check_lm_arguments,
    cross_entropy,
    load_language_model,
    train_lm,
)
from benchmarks.training import print_report

if TYPE_CHECKING:
    import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    add_lm_arguments(parser)
    add_hook_arguments(parser)
    args = parser.parse_args(argv)
    check_hook_arguments(parser, args)
    check_lm_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    lm = load_language_model(args)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.num_workers
    )
    model = wrap(lm.network, args)
    opt = lm.adamw(model.parameters(), args.lr)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=False)
        loss = cross_entropy(model(inputs), targets)
        loss.backward()  # DDP allreduces the gradients' mean in buckets, inside backward
        lm.clip(model.parameters())
        opt.step()
        return float(loss.item())

    report = print_report if args.rank == 0 else None
    train_lm(args, lm, step, opt, lambda: lm.network, report)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
