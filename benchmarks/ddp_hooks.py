"""The DDP workers' common part: torch's communication hooks, chosen on the command line, and
the DDP wrapper they go on (:mod:`benchmarks.ddp_mnist`, :mod:`benchmarks.ddp_charlm`).

``--compress fp16`` is torch's fp16 compression hook (the gradients travel as 16-bit floats and
are averaged in fp32 again; torch refuses its bf16 hook without NCCL, so on gloo fp16 is the
16-bit baseline); ``--powersgd RANK`` its PowerSGD hook, with its error feedback and warm
start, after ``--powersgd-start`` steps of plain fp32 allreduce (the warm-up torch's
documentation recommends).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where training runs
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel


def add_hook_arguments(parser: argparse.ArgumentParser) -> None:
    """``--powersgd``, ``--powersgd-start`` and ``--compress``."""
    parser.add_argument(
        "--powersgd", type=int, default=0, metavar="RANK", help="PowerSGD hook rank (0: none)"
    )
    parser.add_argument(
        "--powersgd-start",
        type=int,
        default=2,
        metavar="STEP",
        help="PowerSGD's warm-up: plain fp32 allreduce before this step",
    )
    parser.add_argument(
        "--compress",
        choices=["none", "fp16"],
        default="none",
        help="torch's fp16 compression hook (not with --powersgd)",
    )


def check_hook_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse two hooks at once (exits through ``parser.error``)."""
    if args.powersgd and args.compress != "none":
        parser.error("--compress and --powersgd are two hooks: give one")


def wrap(network: nn.Module, args: argparse.Namespace) -> DistributedDataParallel:
    """``network`` in DDP (which broadcasts rank 0's weights) with the hook the options name.

    With PowerSGD the gradients go in one bucket: torch's hook runs its gloo collectives
    asynchronously, and two buckets' could interleave differently on each rank.
    """
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(network, bucket_cap_mb=1024 if args.powersgd else 25)
    if args.powersgd:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.powersgd,
            start_powerSGD_iter=args.powersgd_start,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif args.compress == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return model


__all__ = ["add_hook_arguments", "check_hook_arguments", "wrap"]
