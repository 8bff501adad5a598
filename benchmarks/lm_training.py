"""The language-model workload's runner for the benchmark workers that train outside the
example (:mod:`benchmarks.ddp_charlm` and the peers' language-model workers): what
``examples/charlm/train.py`` trains, with the example's own functions, so that every system
trains the same thing.

The same byte-level transformer (``--layers``, ``--width``, ``--heads``, ``--context``; every
rank draws the same initial weights from ``--seed``), each rank's contiguous shard of the
corpus, the same random windows per rank and step, AdamW with the example's betas and weight
decay, its warm-up and cosine schedule (:func:`train_lm` sets each step's learning rate), and
the same fixed validation windows. Every ``--eval-every`` steps (and after the last) worker 0
reports the example's keys: ``step``, ``samples``, ``loss`` (its training loss since the last
report), ``val_loss``, ``perplexity`` and ``seconds`` since training started, evaluations
included.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from benchmarks.training import CHARLM, example_module

if TYPE_CHECKING:  # torch is imported where training runs
    import torch
    from torch import nn


def add_lm_arguments(parser: argparse.ArgumentParser) -> None:
    """The example's training options, with its defaults: the schedule, the model's shape, the
    optimizer's learning rate and warm-up, and the seed."""
    defaults = example_module("model", CHARLM).DEFAULT_SIZE
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


def check_lm_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a schedule with no step or no report (exits through ``parser.error``)."""
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be at least 1")


@dataclass
class LanguageModel:
    """One worker's part of the workload: the example's training module (its schedule,
    evaluation and constants), this rank's shard of the training text, the validation windows
    and the model."""

    example: ModuleType
    corpus: ModuleType
    text: Any
    validation: tuple[torch.Tensor, ...]
    network: nn.Module

    def adamw(self, params: Any, lr: float) -> torch.optim.AdamW:
        """The example's AdamW (its betas and weight decay) over ``params``."""
        import torch

        return torch.optim.AdamW(
            params, lr=lr, betas=self.example.BETAS, weight_decay=self.example.WEIGHT_DECAY
        )

    def clip(self, params: Any) -> None:
        """Clip ``params``' gradients at the example's norm, as it does before every step."""
        import torch

        torch.nn.utils.clip_grad_norm_(params, self.example.CLIP_NORM)


def load_language_model(args: argparse.Namespace) -> LanguageModel:
    """Seed torch, keep it on one thread (the emulated hosts share this machine's cores) and
    load rank ``args.rank``'s part of the workload (:class:`LanguageModel`) of
    ``args.num_workers``."""
    import torch

    torch.manual_seed(args.seed)  # every rank draws the same initial weights, as the example's
    torch.set_num_threads(1)
    example = example_module("train", CHARLM)
    corpus, models = example_module("corpus", CHARLM), example_module("model", CHARLM)
    text_corpus = corpus.load_corpus()
    size = models.ModelSize(args.layers, args.width, args.heads, args.context)
    return LanguageModel(
        example=example,
        corpus=corpus,
        text=corpus.shard(text_corpus.train, args.rank, args.num_workers),
        validation=corpus.fixed_windows(text_corpus.validation, args.val_windows, args.context),
        network=models.CharTransformer(size),
    )


def train_lm(
    args: argparse.Namespace,
    lm: LanguageModel,
    step: Callable[[torch.Tensor, torch.Tensor], float],
    scheduled: torch.optim.Optimizer | None,
    evaluated: Callable[[], nn.Module],
    report: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Train ``args.steps`` steps: before each, the optimizer ``scheduled`` gets the example's
    learning rate for it (None: the worker's optimizer follows the schedule itself), then
    ``step(inputs, targets)`` trains on rank ``args.rank``'s windows for it and returns the
    loss. With
    ``report`` (worker 0), every ``--eval-every`` steps and after the last, the model
    ``evaluated()`` returns is scored on the validation windows and reported (the module's
    keys)."""
    started = time.perf_counter()
    loss_sum, loss_steps = 0.0, 0
    for number in range(1, args.steps + 1):
        if scheduled is not None:
            for group in scheduled.param_groups:
                group["lr"] = lm.example.learning_rate(args, number)
        inputs, targets = lm.corpus.sample_windows(
            lm.text, args.batch_size, args.context, seed=args.seed, rank=args.rank, step=number
        )
        loss_sum += step(inputs, targets)
        loss_steps += 1
        if (number % args.eval_every and number != args.steps) or report is None:
            continue
        val_loss = lm.example.evaluate(evaluated(), lm.validation)
        report({
            "step": number,
            "samples": number * args.batch_size * args.num_workers,
            "loss": loss_sum / loss_steps,
            "val_loss": val_loss,
            "perplexity": math.exp(val_loss),
            "seconds": time.perf_counter() - started,
        })  # fmt: skip
        loss_sum, loss_steps = 0.0, 0


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The example's next-byte loss."""
    return example_module("model", CHARLM).cross_entropy(logits, targets)


__all__ = [
    "LanguageModel",
    "add_lm_arguments",
    "check_lm_arguments",
    "cross_entropy",
    "load_language_model",
    "train_lm",
]
