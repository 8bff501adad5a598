"""The one training runner of the MNIST benchmarks: :mod:`benchmarks.convergence`,
:mod:`benchmarks.time_to_accuracy` and :mod:`benchmarks.ddp_mnist`.

Every run trains the MNIST example's models on the example's data (``examples/mnist``), one
process per worker. A parameter-server run is the example itself (``examples/mnist/train.py``:
:func:`example_command`); a DDP run is :mod:`benchmarks.ddp_mnist` (:func:`ddp_command`), which
trains the same epochs in the same order through :func:`train_epochs`. Both take the same
:class:`Training` flags, and worker 0 of either writes one JSON line per epoch, which
:func:`epoch_record` reads back.

The example is a folder of scripts, not a package: :func:`example_module` loads its modules from
their files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from benchmarks.common import REPO, module_command

if TYPE_CHECKING:  # torch is imported where training runs; the harnesses need none
    import torch
    from torch import nn

EXAMPLE = REPO / "examples" / "mnist"
"""The MNIST example's folder."""

TRAIN = EXAMPLE / "train.py"
"""The example's training script: a parameter-server worker."""

CHARLM = REPO / "examples" / "charlm"
"""The language-model example's folder."""


def example_module(name: str, folder: Path = EXAMPLE) -> ModuleType:
    """The example's module ``name`` (``examples/mnist/<name>.py``, or in ``folder``), loaded
    from its file once.

    It is registered under its own name, as the example's scripts import each other
    (``from mnist_data import load_data``), so that they and the benchmarks share one module.
    """
    path = folder / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module {name!r} in {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@dataclass(frozen=True)
class Training:
    """What every worker of a run trains, and how: the options that the example and the DDP
    worker both take, with the same meaning (SGD's learning rate and momentum, the seed of the
    model's initial weights and of every epoch's order, images per worker and step)."""

    model: str
    epochs: int
    lr: float
    momentum: float
    seed: int = 0
    batch_size: int = 32

    def flags(self) -> list[str]:
        """The command-line options that set this training."""
        return ["--model", self.model, "--epochs", str(self.epochs), "--lr", str(self.lr),
                "--momentum", str(self.momentum), "--seed", str(self.seed),
                "--batch-size", str(self.batch_size)]  # fmt: skip


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark worker that trains outside the example takes (DDP's and the
    peers'), with the example's meaning: :class:`Training`'s and the SGD's weight decay."""
    parser.add_argument("--model", choices=["mlp", "cnn"], default="cnn")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)


def start_worker(args: argparse.Namespace) -> Training:
    """The :class:`Training` of a worker's options (:func:`add_worker_arguments`), with torch
    seeded by its seed (every worker draws the same initial weights) and on one thread (the
    emulated hosts share this machine's cores)."""
    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    return Training(args.model, args.epochs, args.lr, args.momentum, args.seed, args.batch_size)


def example_command(
    training: Training,
    *,
    push: str,
    pull: str,
    optimizer: str,
    json_to: str,
    device: str = "cpu",
    extra: Sequence[str] = (),
) -> list[str]:
    """One parameter-server worker: the example with ``push`` and ``pull`` compression specs,
    SGD on the ``server`` or the workers (``local``), worker 0 writing its epochs' JSON lines to
    ``json_to`` (``-``: its stdout), no progress bar, and the example's options ``extra`` (its
    DiLoCo mode: ``["--diloco", "10", ...]``). It reads its place in the job from the
    launcher's environment."""
    return [sys.executable, str(TRAIN), "--no-progress", "--json", json_to,
            "--compression", push, "--pull-compression", pull, "--optimizer", optimizer,
            "--device", device, *training.flags(), *extra]  # fmt: skip


def ddp_command(
    training: Training,
    *,
    master: str,
    rank: int,
    num_workers: int,
    powersgd: int,
    powersgd_start: int = 2,
    compress: str = "none",
) -> list[str]:
    """One DDP worker (:mod:`benchmarks.ddp_mnist`; start it with ``cwd=REPO``): rank ``rank``
    of ``num_workers``, meeting at ``master`` (``HOST:PORT``), allreducing fp32 gradients
    (``powersgd`` 0, ``compress`` ``"none"``), fp16 ones (``compress`` ``"fp16"``) or through
    torch's PowerSGD hook of rank ``powersgd`` after ``powersgd_start`` steps of fp32."""
    return module_command("ddp_mnist", "--master", master, "--rank", str(rank),
                          "--num-workers", str(num_workers), "--powersgd", str(powersgd),
                          "--powersgd-start", str(powersgd_start), "--compress", compress,
                          *training.flags())  # fmt: skip


def print_report(record: dict[str, Any]) -> None:
    """Worker 0's report: one JSON line on its stdout, flushed at once (the harness reads it
    as it comes, and stops a run at its target)."""
    print(json.dumps(record), flush=True)


def epoch_record(line: str) -> dict[str, Any] | None:
    """The epoch record in a line of a worker's output (a JSON object with an ``epoch``), or
    None for any other line (the example also prints a header and a text line per epoch)."""
    if not line.startswith("{"):
        return None
    record = json.loads(line)
    return record if isinstance(record, dict) and "epoch" in record else None


def steps_per_epoch(training: Training, num_workers: int) -> int:
    """Steps of every worker's epoch, the example's: its images over the batch size, the ragged
    batch dropped, so that every worker runs the same number of steps."""
    mnist_data = example_module("mnist_data")
    return mnist_data.train_images_per_worker(num_workers) // training.batch_size


def train_epochs(
    training: Training,
    step: Callable[[torch.Tensor, torch.Tensor], float],
    model: nn.Module,
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    steps: int,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Train ``training.epochs`` epochs of ``steps`` steps the example's way: each epoch visits
    this worker's images (``data``: train images, train labels, test images, test labels) in a
    permutation drawn from ``seed * 1_000_003 + epoch``, ``batch_size`` at a time, and
    ``step(images, labels)`` trains on one batch and returns its loss.

    With ``report`` (worker 0), each epoch ends by evaluating ``model`` with the example's test
    accuracy and calling ``report({"epoch", "loss", "accuracy", "seconds"})``: the mean loss of
    its steps, and its seconds, the evaluation included (as the example counts them).
    """
    import torch

    accuracy = example_module("train").accuracy
    train_x, train_y, test_x, test_y = data
    size = training.batch_size
    for epoch in range(1, training.epochs + 1):
        start = time.perf_counter()
        shuffle = torch.Generator().manual_seed(training.seed * 1_000_003 + epoch)
        order = torch.randperm(len(train_y), generator=shuffle).to(train_y.device)
        total = 0.0
        for index in range(steps):
            batch = order[index * size : (index + 1) * size]
            total += step(train_x[batch], train_y[batch])
        if report is not None:
            report({
                "epoch": epoch,
                "loss": total / steps,
                "accuracy": accuracy(model, test_x, test_y),
                "seconds": time.perf_counter() - start,
            })  # fmt: skip
