"""The example's DiLoCo mode (``--diloco H``): local inner steps, an outer step on the servers
every H steps (``kvstore.torch.DiLoCo``), and what it needs around it: its options, the
wrapper and a slow worker on request.

In this mode ``--compression`` compresses the pseudo-gradient ``Δ = θ - θ_local`` (with the
codec's error feedback), ``--pull-compression`` the outer weights pulled back, and ``--lr``,
``--momentum`` and ``--wd`` are the inner optimizer's. The accuracy worker 0 reports is that of
the outer weights ``θ`` as last pulled (the model the job agrees on; up to H - 1 steps behind
the local replicas; ``DiLoCo.outer_weights_loaded``), and the last epoch ends with an outer
step of the whole model (``synchronize``) unless its last step took one (``DiLoCo.synced``),
so that the final ``θ`` holds every step.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn

import kvstore
import kvstore.torch as kvt

INNER = ("sgd", "adamw")
OUTER = ("sgd", "adam", "dcasgd")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The DiLoCo options, in a group of their own."""
    group = parser.add_argument_group("DiLoCo (--diloco H)")
    group.add_argument(
        "--diloco",
        type=int,
        default=0,
        metavar="H",
        help="train with DiLoCo: H local steps of the inner optimizer, then an outer step on "
        "the servers (0, the default: a push and pull every step)",
    )
    group.add_argument("--inner", choices=INNER, default="sgd", help="inner optimizer")
    group.add_argument(
        "--outer",
        choices=OUTER,
        default="sgd",
        help="outer optimizer on the servers: sgd (Nesterov when --outer-momentum > 0), adam, "
        "or dcasgd (MXNet's delay compensation)",
    )
    group.add_argument("--outer-lr", type=float, default=0.7)
    group.add_argument("--outer-momentum", type=float, default=0.9)
    group.add_argument(
        "--outer-momentum-every",
        type=int,
        default=1,
        metavar="N",
        help="delayed Nesterov: refresh the outer momentum every N updates, momentum-free "
        "steps in between (for dist_async: N = the number of workers)",
    )
    group.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo's F")
    group.add_argument("--overlap", type=int, default=0, help="Streaming DiLoCo's tau")
    group.add_argument("--mixing", type=float, default=0.5, help="Streaming DiLoCo's alpha")
    group.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        metavar="X",
        help="make worker --slow-rank X times slower (it sleeps X - 1 times each step's time)",
    )
    group.add_argument("--slow-rank", type=int, default=-1, metavar="R")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse combinations that cannot mean anything."""
    if args.diloco < 0:
        parser.error(f"--diloco must be >= 0, got {args.diloco}")
    if args.slowdown < 1.0:
        parser.error(f"--slowdown must be >= 1, got {args.slowdown}")
    if not args.diloco:
        return
    if args.optimizer == "local":
        parser.error("--diloco runs its outer optimizer on the servers: no --optimizer local")
    if args.codec["type"] == "dgc":
        parser.error("--diloco: dgc's momentum belongs to per-step gradients, not to Δ")
    if args.outer_momentum_every > 1 and (args.outer != "sgd" or not args.outer_momentum):
        parser.error("--outer-momentum-every is delayed Nesterov: --outer sgd with momentum")


def outer_optimizer(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The servers' outer optimizer, ``(name, hyperparameters)``."""
    if args.outer == "adam":
        return "adam", {"learning_rate": args.outer_lr}
    if args.outer == "dcasgd":
        return "dcasgd", {"learning_rate": args.outer_lr, "momentum": args.outer_momentum}
    hyperparameters: dict[str, Any] = {
        "learning_rate": args.outer_lr,
        "momentum": args.outer_momentum,
        "nesterov": args.outer_momentum > 0,
    }
    if args.outer_momentum_every > 1:
        hyperparameters["momentum_every"] = args.outer_momentum_every
    return "sgd", hyperparameters


def make_diloco(args: argparse.Namespace, model: nn.Module, kv: kvstore.KVStore) -> kvt.DiLoCo:
    """The DiLoCo wrapper over the inner optimizer (collective: it initialises the keys)."""
    if args.inner == "adamw":
        inner: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=args.lr, weight_decay=args.wd
        )
    else:
        inner = torch.optim.SGD(
            model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd
        )
    return kvt.DiLoCo(
        inner,
        model.named_parameters(),
        kv=kv,
        sync_every=args.diloco,
        outer=outer_optimizer(args),
        compression=args.codec,
        fragments=args.fragments,
        overlap=args.overlap,
        mixing=args.mixing,
        key_prefix="",
    )


class Slowdown:
    """Makes a worker ``factor`` times slower: after each step it sleeps ``factor - 1`` times
    the step's own time (a worker on a slower device)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._started = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()

    def finish(self) -> None:
        if self.factor > 1.0:
            time.sleep((self.factor - 1.0) * (time.perf_counter() - self._started))
