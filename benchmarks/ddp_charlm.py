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
import math
import time

import torch
import torch.distributed as dist

from benchmarks.ddp_hooks import add_hook_arguments, check_hook_arguments, wrap
from benchmarks.training import CHARLM, example_module, print_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = example_module("model", CHARLM).DEFAULT_SIZE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--steps", type=int, default=300, help="steps per worker")
    parser.add_argument("--eval-every", type=int, default=50, metavar="STEPS")
    parser.add_argument("--val-windows", type=int, default=64, help="validation windows")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per step and worker")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--width", type=int, default=defaults.width)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--context", type=int, default=defaults.context)
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW's peak learning rate")
    parser.add_argument("--warmup", type=int, default=30, metavar="STEPS")
    parser.add_argument("--seed", type=int, default=0)
    add_hook_arguments(parser)
    args = parser.parse_args(argv)
    check_hook_arguments(parser, args)
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    example = example_module("train", CHARLM)  # the example's schedule, evaluation, constants
    corpus, models = example_module("corpus", CHARLM), example_module("model", CHARLM)
    torch.manual_seed(args.seed)  # every rank draws the same initial weights, as the example's
    torch.set_num_threads(1)  # one core per worker: the emulated hosts share the machine
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.num_workers
    )
    text_corpus = corpus.load_corpus()
    text = corpus.shard(text_corpus.train, args.rank, args.num_workers)
    validation = corpus.fixed_windows(text_corpus.validation, args.val_windows, args.context)
    size = models.ModelSize(args.layers, args.width, args.heads, args.context)
    network = models.CharTransformer(size)
    model = wrap(network, args)
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=example.BETAS, weight_decay=example.WEIGHT_DECAY
    )
    started = time.perf_counter()
    loss_sum, loss_steps = 0.0, 0
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = example.learning_rate(args, step)
        inputs, targets = corpus.sample_windows(
            text, args.batch_size, args.context, seed=args.seed, rank=args.rank, step=step
        )
        opt.zero_grad(set_to_none=False)
        loss = models.cross_entropy(model(inputs), targets)
        loss.backward()  # DDP allreduces the gradients' mean in buckets, inside backward
        torch.nn.utils.clip_grad_norm_(model.parameters(), example.CLIP_NORM)
        opt.step()
        loss_sum += loss.item()
        loss_steps += 1
        if (step % args.eval_every and step != args.steps) or args.rank != 0:
            continue
        val_loss = example.evaluate(network, validation)
        record = {
            "step": step,
            "samples": step * args.batch_size * args.num_workers,
            "loss": loss_sum / loss_steps,
            "val_loss": val_loss,
            "perplexity": math.exp(val_loss),
            "seconds": time.perf_counter() - started,
        }
        print_report(record)
        loss_sum, loss_steps = 0.0, 0
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
