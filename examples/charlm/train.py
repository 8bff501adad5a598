"""A byte-level transformer language model trained with kvstore: data-parallel AdamW or DiLoCo.

Every worker trains the same small decoder-only transformer (:mod:`model`) on its own
contiguous shard of the docstrings of the Python standard library (:mod:`corpus`, collected at
run time, nothing downloaded), with AdamW inside (betas (0.9, 0.95), weight decay 0.1, linear
warm-up then cosine decay to 10% of ``--lr``, gradient clipping at norm 1.0, all local to the
worker). Two ways to train together:

- ``--mode sync`` (the baseline, synchronous data-parallel): a
  ``kvstore.torch.DistributedOptimizer`` without a server optimizer pushes every gradient
  (compressed by ``--compression``), each step pulls the mean, and every worker clips it and
  steps its own AdamW, so the workers' models stay equal;
- ``--mode diloco``: ``kvstore.torch.DiLoCo`` runs ``--sync-every`` H inner AdamW steps, then
  pushes the pseudo-gradient ``θ - θ_local`` (compressed by ``--compression``, with its error
  feedback) and the servers take an outer Nesterov SGD step (``--outer-lr``,
  ``--outer-momentum``) on the workers' mean; ``--fragments`` and ``--overlap`` make it
  Streaming DiLoCo, ``--store dist_async`` asynchronous.

Run it under the launcher::

    kvstore-launch -n 4 -s 1 -- python examples/charlm/train.py --mode sync --steps 300
    kvstore-launch -n 4 -s 1 -- python examples/charlm/train.py --mode diloco \\
        --sync-every 50 --compression topk:ratio=0.01

Without the launcher's environment (``KVSTORE_SERVERS`` not set) it trains alone in ``local``
mode and says so on stderr. Every ``--eval-every`` steps (and after the last), worker 0
evaluates its model on the same fixed validation windows (mean next-byte cross-entropy and
perplexity ``exp(loss)``), prints a line, and with ``--json PATH`` (``-``: stdout) writes one
JSON line: ``step``, ``samples`` (sequences seen by all workers: ``step`` x ``--batch-size`` x
workers, exact when the workers keep step, as on ``dist_sync``), ``loss`` (worker 0's training
loss since the last evaluation), ``val_loss``, ``perplexity``, ``pushed_bytes_total``,
``pushed_raw_bytes_total``, ``pulled_bytes_total`` (worker 0's ``kv.stats()``), ``seconds``
(since training started, evaluations included) and the run's configuration. In ``diloco``
mode the model evaluated is the outer weights ``θ`` as last pulled (the model the job agrees
on), and the last step ends with an outer step of the whole model unless it just took one.

``--slowdown X --slow-rank R`` makes worker R's compute X times slower: after each step it
sleeps X - 1 times what that step's computation took (forward, backward, clipping and the
inner optimizer's step; not the waits for the store), to emulate a slower machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import torch

import kvstore
import kvstore.torch as kvt
from kvstore.codecs import codec_from_spec
from kvstore.codecs.pulled import pull_codec_from_spec
from kvstore.compile_notice import compile_notice
from kvstore.errors import CodecError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # when run from elsewhere too

from corpus import Corpus, fixed_windows, load_corpus, sample_windows, shard  # noqa: E402
from model import DEFAULT_SIZE, CharTransformer, ModelSize, cross_entropy  # noqa: E402


def _load_codec_spec() -> ModuleType:
    """The MNIST example's codec spec parser, loaded from its file (one syntax for both
    examples' ``--compression``)."""
    path = HERE.parent / "mnist" / "codec_spec.py"
    spec = importlib.util.spec_from_file_location("charlm_codec_spec", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


codec_spec = _load_codec_spec()

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0
FINAL_LR_FRACTION = 0.1
"""The cosine decay ends at this fraction of ``--lr``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked; ``args.codec`` and ``args.pull_codec`` are the spec dicts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["sync", "diloco"], default="sync")
    parser.add_argument(
        "--store",
        choices=["dist_sync", "dist_async"],
        default="dist_sync",
        help="the store's mode under the launcher (dist_async: diloco only)",
    )
    parser.add_argument("--steps", type=int, default=300, help="inner steps per worker")
    parser.add_argument("--eval-every", type=int, default=50, metavar="STEPS")
    parser.add_argument("--val-windows", type=int, default=64, help="validation windows")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per step and worker")
    parser.add_argument("--layers", type=int, default=DEFAULT_SIZE.layers)
    parser.add_argument("--width", type=int, default=DEFAULT_SIZE.width)
    parser.add_argument("--heads", type=int, default=DEFAULT_SIZE.heads)
    parser.add_argument("--context", type=int, default=DEFAULT_SIZE.context)
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW's peak learning rate")
    parser.add_argument("--warmup", type=int, default=30, metavar="STEPS")
    parser.add_argument("--sync-every", type=int, default=50, metavar="H")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--fragments", type=int, default=1, metavar="F")
    parser.add_argument("--overlap", type=int, default=0, metavar="TAU")
    parser.add_argument(
        "--compression",
        metavar="SPEC",
        default="none",
        help="push codec (sync: gradients; diloco: pseudo-gradients): none, a name, "
        'name:key=value,... (e.g. topk:ratio=0.01) or a JSON object with a "type"',
    )
    parser.add_argument(
        "--pull-compression",
        metavar="SPEC",
        default="none",
        help="compress what the servers send back, as --compression (default none)",
    )
    parser.add_argument("--slowdown", type=float, default=1.0, metavar="X")
    parser.add_argument("--slow-rank", type=int, metavar="R", help="the rank --slowdown slows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", metavar="PATH", help="worker 0 writes a JSON line per evaluation (- for stdout)"
    )
    args = parser.parse_args(argv)
    for name in ("steps", "eval_every", "val_windows", "batch_size", "sync_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.lr <= 0 or not math.isfinite(args.lr):
        parser.error("--lr must be a positive number")
    if not args.slowdown >= 1.0 or not math.isfinite(args.slowdown):
        parser.error(f"--slowdown must be a number >= 1, got {args.slowdown}")
    if args.slow_rank is not None and args.slow_rank < 0:
        parser.error("--slow-rank must be a rank (>= 0)")
    if args.mode == "sync" and args.store != "dist_sync":
        parser.error("--mode sync needs --store dist_sync (dist_async needs a server optimizer)")
    try:
        args.size = ModelSize(args.layers, args.width, args.heads, args.context)
    except ValueError as error:
        parser.error(str(error))
    if args.json not in (None, "-") and not Path(args.json).parent.is_dir():
        parser.error(f"--json: no directory {str(Path(args.json).parent)!r}")
    try:
        args.codec = codec_spec.parse_codec_spec(args.compression)
        codec_from_spec(args.codec)
    except (ValueError, CodecError) as error:
        parser.error(f"--compression: {error}")
    try:
        args.pull_codec = codec_spec.parse_codec_spec(args.pull_compression)
        pull_codec_from_spec(args.pull_codec)
    except (ValueError, CodecError) as error:
        parser.error(f"--pull-compression: {error}")
    return args


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """AdamW's learning rate for inner step ``step`` (from 1): linear warm-up over
    ``--warmup`` steps, then a cosine from ``--lr`` down to 10% of it at the last step."""
    if step <= args.warmup:
        return args.lr * step / args.warmup
    decay_steps = max(1, args.steps - args.warmup)
    progress = min(1.0, (step - args.warmup) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.lr * (FINAL_LR_FRACTION + (1.0 - FINAL_LR_FRACTION) * cosine)


def make_optimizer(
    args: argparse.Namespace, model: torch.nn.Module, kv: kvstore.KVStore
) -> tuple[torch.optim.AdamW, kvt.DistributedOptimizer | kvt.DiLoCo]:
    """The inner AdamW and its wrapper (collective: the wrapper initialises the keys)."""
    inner = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=BETAS, weight_decay=WEIGHT_DECAY
    )
    compression = None if args.codec["type"] == "none" else args.codec
    if args.mode == "sync":
        kvt.broadcast_parameters(model, kv)  # every worker starts from rank 0's weights
        wrapper: kvt.DistributedOptimizer | kvt.DiLoCo = kvt.DistributedOptimizer(
            inner, model.named_parameters(), kv=kv, compression=compression
        )
    else:
        # DiLoCo's keys start as rank 0's weights and every worker pulls them.
        outer = (
            "sgd",
            {"learning_rate": args.outer_lr, "momentum": args.outer_momentum, "nesterov": True},
        )
        wrapper = kvt.DiLoCo(
            inner,
            model.named_parameters(),
            kv=kv,
            sync_every=args.sync_every,
            outer=outer,
            compression=compression,
            fragments=args.fragments,
            overlap=args.overlap,
        )
    return inner, wrapper


class ComputeClock:
    """Seconds of computation in the current step: forward and backward (timed by the loop)
    plus the inner optimizer's own steps (timed by hooks, so that a DiLoCo sync inside the
    wrapper's ``step`` is not counted)."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.seconds = 0.0
        self._started = 0.0
        inner.register_step_pre_hook(self._before)
        inner.register_step_post_hook(self._after)

    def _before(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def _after(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._started


def train_step(
    model: torch.nn.Module,
    opt: kvt.DistributedOptimizer | kvt.DiLoCo,
    clock: ComputeClock,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> float:
    """One step on one batch (collective in sync mode and at DiLoCo's syncs); its loss."""
    started = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    loss = cross_entropy(model(inputs), targets)
    loss.backward()  # in sync mode, pushes each gradient as backward produces it
    clock.seconds += time.perf_counter() - started
    if isinstance(opt, kvt.DistributedOptimizer):
        opt.synchronize()  # the mean gradient, clipped below as one would clip locally
    started = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    clock.seconds += time.perf_counter() - started
    opt.step()
    return loss.item()


def evaluate(model: torch.nn.Module, windows: tuple[torch.Tensor, ...], batch: int = 16) -> float:
    """Mean next-byte cross-entropy (nats) over the validation windows."""
    inputs, targets = windows
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(inputs), batch):
            chunk = inputs[i : i + batch]
            total += cross_entropy(model(chunk), targets[i : i + batch]).item() * len(chunk)
    model.train()
    return total / len(inputs)


def job_mode(args: argparse.Namespace) -> str:
    """``args.store`` where the launcher's variables are set; else ``local``, said on stderr
    with the command that trains with 4 workers and 1 server instead."""
    if "KVSTORE_SERVERS" in os.environ:
        return str(args.store)
    command = shlex.join(["kvstore-launch", "-n", "4", "-s", "1", "--", "python3", *sys.argv])
    print(
        "KVSTORE_SERVERS is not set: training alone in local mode (one worker and an "
        f"in-process server); to train with 4 workers and 1 server: {command}",
        file=sys.stderr,
        flush=True,
    )
    return "local"


def run_config(args: argparse.Namespace, kv: kvstore.KVStore, params: int) -> dict[str, Any]:
    """What the JSON lines repeat about the run."""
    config: dict[str, Any] = {
        "mode": args.mode,
        "store": kv.type,
        "workers": kv.num_workers,
        "servers": kv.num_servers,
        "codec": codec_spec.format_codec_spec(args.codec),
        "pull_codec": codec_spec.format_codec_spec(args.pull_codec),
        "parameters": params,
        "layers": args.layers,
        "width": args.width,
        "heads": args.heads,
        "context": args.context,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "lr": args.lr,
        "warmup": args.warmup,
        "seed": args.seed,
        "slowdown": args.slowdown,
        "slow_rank": args.slow_rank,
    }
    if args.mode == "diloco":
        config.update(
            sync_every=args.sync_every,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            fragments=args.fragments,
            overlap=args.overlap,
        )
    return config


def open_json(target: str | None) -> TextIO | None:
    if target is None:
        return None
    return sys.stdout if target == "-" else open(target, "w")  # noqa: SIM115 (closed in main)


def evaluate_job_model(
    model: torch.nn.Module,
    opt: kvt.DistributedOptimizer | kvt.DiLoCo,
    windows: tuple[torch.Tensor, ...],
) -> float:
    """:func:`evaluate` of the job's model: the model itself, or with DiLoCo its outer weights
    ``θ`` as last pulled."""
    if isinstance(opt, kvt.DiLoCo):
        with opt.outer_weights_loaded():
            return evaluate(model, windows)
    return evaluate(model, windows)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one core per worker: several workers share the machine
    mode = job_mode(args)
    kv = kvstore.create(mode)
    kv.set_pull_compression(args.pull_codec)  # before any key is initialised
    rank, workers = kv.rank, kv.num_workers
    if rank == 0:
        optimizer = "sgd" if args.mode == "diloco" else None
        notice = compile_notice([args.codec, args.pull_codec], optimizer)
        if notice is not None:
            print(notice, file=sys.stderr, flush=True)
    corpus: Corpus = load_corpus()
    text = shard(corpus.train, rank, workers)
    validation = fixed_windows(corpus.validation, args.val_windows, args.context)
    model = CharTransformer(args.size)
    params = sum(p.numel() for p in model.parameters())
    inner, opt = make_optimizer(args, model, kv)
    clock = ComputeClock(inner)
    slowdown = args.slowdown if args.slow_rank == rank else 1.0
    config = run_config(args, kv, params)
    json_out = open_json(args.json) if rank == 0 else None
    if rank == 0:
        print(
            f"{workers} worker(s) x {kv.num_servers} server(s), {mode}, {opt!r}, "
            f"{params:,} parameters, corpus {len(corpus.train):,} training bytes "
            f"({len(text):,} per worker) and {len(corpus.validation):,} validation bytes"
        )
    started = time.perf_counter()
    loss_sum, loss_steps = 0.0, 0
    for step in range(1, args.steps + 1):
        for group in inner.param_groups:
            group["lr"] = learning_rate(args, step)
        inputs, targets = sample_windows(
            text, args.batch_size, args.context, seed=args.seed, rank=rank, step=step
        )
        clock.seconds = 0.0
        loss_sum += train_step(model, opt, clock, inputs, targets)
        loss_steps += 1
        if slowdown > 1.0:
            time.sleep((slowdown - 1.0) * clock.seconds)
        if step % args.eval_every and step != args.steps:
            continue
        if step == args.steps and isinstance(opt, kvt.DiLoCo) and not opt.synced:
            opt.synchronize()  # the final θ holds every step (every worker's schedule is the same)
        if rank != 0:
            continue
        val_loss = evaluate_job_model(model, opt, validation)
        stats = kv.stats()
        record = {
            "step": step,
            "samples": step * args.batch_size * workers,
            "loss": loss_sum / loss_steps,
            "val_loss": val_loss,
            "perplexity": math.exp(val_loss),
            "pushed_bytes_total": stats.pushed_bytes,
            "pushed_raw_bytes_total": stats.pushed_raw_bytes,
            "pulled_bytes_total": stats.pulled_bytes,
            "seconds": time.perf_counter() - started,
        }
        print(
            f"step {step}: loss {record['loss']:.4f}  validation loss {val_loss:.4f}  "
            f"perplexity {record['perplexity']:.3f}  pushed {stats.pushed_bytes / 1e6:.2f} MB  "
            f"pulled {stats.pulled_bytes / 1e6:.2f} MB  ({record['seconds']:.1f} s)",
            flush=True,
        )
        loss_sum, loss_steps = 0.0, 0
        if json_out is not None:
            json_out.write(json.dumps({**record, **config}) + "\n")
            json_out.flush()
    kv.barrier()
    if json_out not in (None, sys.stdout):
        json_out.close()
    kv.close()


if __name__ == "__main__":
    main()
