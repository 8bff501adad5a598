"""What the hivemind peer's workers share (:mod:`benchmarks.hivemind_mnist`,
:mod:`benchmarks.hivemind_charlm`): their options, how the peers find each other, hivemind's
optimizer set up for synchronous data-parallel training (or its local updates), the lockstep
of its rounds, and the model worker 0 evaluates.

Each worker runs a ``hivemind.DHT`` (its p2p daemon listening on ``--host``) and a
``hivemind.Optimizer`` around the workload's torch optimizer, set up as hivemind's documentation
says for synchronous data-parallel training:

- ``target_batch_size`` = workers x batch size and ``batch_size_per_step`` = batch size, so that
  one hivemind epoch (one collective round) is one step of every worker, as DDP's allreduce;
- averaging groups of exactly the workers (``target_group_size``), formed within
  ``--matchmaking-time`` seconds, a round given up after ``--averaging-timeout`` seconds;
- ``--compression`` picks hivemind's ``NoCompression``, ``Float16Compression`` or
  ``Uniform8BitQuantization`` for what is averaged (gradients, and the parameters' averaging);
- by default the gradients are averaged every round and every worker applies the same step to
  the average (hivemind's synchronous mode), so that every worker holds the same model; the
  parameters are also averaged every 10th round, in the background, to repair any drift (a
  skipped round, lossy compression), as hivemind's docs advise for peers that seldom skip rounds;
- ``--local-updates`` is hivemind's ``use_local_updates=True``: each worker applies its optimizer
  to its own gradients every step, and the workers average their parameters every
  ``target_batch_size`` samples (every round, in the background, with hivemind's delta rule);
- ``--average-state-every`` overrides either period of the parameters' averaging.

hivemind decides that a round is due from the progress every worker publishes in the DHT, which
it reads every ``--refresh-period`` seconds; a fast worker would otherwise add several of its own
batches to one round. Each step therefore announces its batch first and waits (at most
``--averaging-timeout``) until hivemind sees the round's samples complete, so that every worker
contributes exactly one batch to every round, in lockstep, as DDP (:func:`announce_batch`).

The evaluated model is worker 0's: with gradient averaging, the model every worker holds; with
``--local-updates``, worker 0's parameters once the last averaging round has been applied
(the workers' average plus worker 0's local steps taken while that round was in flight:
:class:`EvaluatedModel`).

Peers find each other through a file on a filesystem every host shares: rank 0 starts first and
writes its multiaddrs (with its peer id) to ``--peer-file``; the other ranks wait for that file
(``--peer-timeout``), then join rank 0's DHT. Use a fresh path for every run.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # hivemind is an optional benchmark peer, imported where a worker runs
    import hivemind
    from hivemind.compression import CompressionBase

COMPRESSIONS = ("none", "fp16", "uint8")
"""The ``--compression`` choices, after hivemind's ``NoCompression``, ``Float16Compression`` and
``Uniform8BitQuantization``."""


def add_peer_arguments(parser: argparse.ArgumentParser, run_id: str) -> None:
    """The options of a hivemind worker's place in the swarm and of hivemind's averaging;
    ``run_id``: the default of hivemind's run id (the workload's name)."""
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="IP address this worker listens on")
    parser.add_argument("--port", type=int, default=0, help="TCP port it listens on (0: any)")
    parser.add_argument(
        "--peer-file", required=True, help="file (on a shared filesystem) with rank 0's multiaddrs"
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=120.0, help="seconds to wait for rank 0 and peers"
    )
    parser.add_argument("--run-id", default=run_id, help="hivemind's run id (DHT key prefix)")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none")
    parser.add_argument(
        "--local-updates",
        action="store_true",
        help="local steps, parameters averaged every round (use_local_updates=True)",
    )
    parser.add_argument(
        "--matchmaking-time", type=float, default=0.5, help="seconds to form an averaging group"
    )
    parser.add_argument(
        "--averaging-timeout", type=float, default=30.0, help="seconds before a round is given up"
    )
    parser.add_argument(
        "--average-state-every",
        type=int,
        default=None,
        help="rounds between two averagings of the parameters (hivemind's average_state_every; "
        "default: 1 with local updates, 10 with gradient averaging)",
    )
    parser.add_argument(
        "--refresh-period",
        type=float,
        default=0.05,
        help="least seconds between two reads of the swarm's progress",
    )


def listen_maddr(host: str, port: int) -> str:
    """The multiaddr a worker's p2p daemon listens on: TCP on ``host`` (an IPv4 address)."""
    return f"/ip4/{host}/tcp/{port}"


def write_peer_file(path: Path, maddrs: list[str]) -> None:
    """Publish rank 0's multiaddrs, one a line, replacing ``path`` at once (a reader sees the old
    file or the whole new one, never a part)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text("".join(f"{maddr}\n" for maddr in maddrs))
    os.replace(partial, path)


def read_peer_file(path: Path, timeout: float, poll: float = 0.1) -> list[str]:
    """Rank 0's multiaddrs from ``path``, waiting up to ``timeout`` seconds for the file to hold
    at least one; TimeoutError (naming the file) if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            maddrs = [line for line in path.read_text().split() if line]
        except FileNotFoundError:
            maddrs = []
        if maddrs:
            return maddrs
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"no multiaddr of rank 0 in {path} after {timeout:g} s: start rank 0 first, with "
                f"the same --peer-file on a filesystem this host shares"
            )
        time.sleep(poll)


def compression_named(name: str) -> CompressionBase:
    """hivemind's compression for a ``--compression`` choice."""
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    kinds = {
        "none": NoCompression,
        "fp16": Float16Compression,
        "uint8": Uniform8BitQuantization,
    }
    return kinds[name]()


def check_compression(compression: CompressionBase) -> None:
    """Round-trip a tensor through ``compression``; RuntimeError naming the failure if it cannot
    (hivemind's 8-bit codecs read their codebook size with a NumPy conversion that recent NumPy
    refuses), since hivemind would otherwise log every failed round and go on with each worker's
    local gradients, training without averaging."""
    import numpy as np
    from hivemind.compression import CompressionInfo

    probe = torch.linspace(-1.0, 1.0, 4096)
    try:
        restored = compression.extract(
            compression.compress(probe, CompressionInfo.from_tensor(probe))
        )
    except Exception as error:
        raise RuntimeError(
            f"hivemind's {type(compression).__name__} cannot decode what it encodes with NumPy "
            f"{np.__version__} and torch {torch.__version__}: {error!r}"
        ) from error
    if restored.shape != probe.shape:
        raise RuntimeError(f"hivemind's {type(compression).__name__} changed a tensor's shape")


def start_dht(args: argparse.Namespace) -> hivemind.DHT:
    """This worker's DHT node: rank 0 starts the swarm and publishes its multiaddrs in the peer
    file; the others join it, retrying (a stale peer file, rank 0 not listening yet) until
    ``--peer-timeout``."""
    import hivemind

    host_maddrs = [listen_maddr(args.host, args.port)]
    peer_file = Path(args.peer_file)
    if args.rank == 0:
        dht = hivemind.DHT(host_maddrs=host_maddrs, start=True)
        write_peer_file(peer_file, [str(maddr) for maddr in dht.get_visible_maddrs()])
        return dht
    deadline = time.monotonic() + args.peer_timeout
    while True:
        peers = read_peer_file(peer_file, max(0.0, deadline - time.monotonic()))
        try:
            return hivemind.DHT(host_maddrs=host_maddrs, initial_peers=peers, start=True)
        except Exception as error:  # hivemind raises a bare Exception/RuntimeError on bootstrap
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"could not join rank 0 at {peers} (from {peer_file}) within "
                    f"{args.peer_timeout:g} s: {error}"
                ) from error
            time.sleep(0.5)


def barrier(dht: hivemind.DHT, key: str, rank: int, num_workers: int, timeout: float) -> bool:
    """Wait until every rank has stored ``key`` in the DHT (each under its own subkey), at most
    ``timeout`` seconds; whether all of them did."""
    from hivemind.utils import get_dht_time

    deadline = time.monotonic() + timeout
    while True:
        dht.store(key, subkey=rank, value=True, expiration_time=get_dht_time() + 600)
        found = dht.get(key, latest=True)
        seen = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        if seen >= num_workers:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def make_optimizer(
    args: argparse.Namespace,
    dht: hivemind.DHT,
    model: nn.Module,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> hivemind.Optimizer:
    """hivemind's optimizer over the torch optimizer ``optimizer(params)`` makes (and the
    learning-rate schedule ``scheduler(optimizer)`` makes, stepped every round),
    synchronous (or with local updates) as set in the module's docstring."""
    import hivemind
    from hivemind.optim.grad_averager import GradientAverager

    compression = compression_named(args.compression)
    # a group is complete with every worker in it (no waiting out the matchmaking time), and a
    # join request gives up before the matchmaking does (hivemind's averager says so); the
    # optimizer hands averager_opts to its state averager only, so the gradient averager gets
    # them through its factory
    group = {
        "target_group_size": args.num_workers,
        "request_timeout": min(3.0, args.matchmaking_time / 2),
    }
    gradient_averager = None
    if not args.local_updates:
        gradient_averager = functools.partial(GradientAverager, **group)
    return hivemind.Optimizer(
        dht=dht,
        run_id=args.run_id,
        params=model.parameters(),
        optimizer=optimizer,
        scheduler=scheduler,
        target_batch_size=args.num_workers * args.batch_size,
        batch_size_per_step=args.batch_size,
        use_local_updates=args.local_updates,
        average_state_every=state_averaging_period(args),
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        grad_compression=compression,
        state_averaging_compression=compression,
        grad_averager_factory=gradient_averager,
        averager_opts=group,
        tracker_opts={"min_refresh_period": args.refresh_period},
    )


@contextmanager
def swarm(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> Iterator[hivemind.Optimizer]:
    """This worker in the swarm: its DHT, every worker joined, then hivemind's optimizer over
    ``model`` (:func:`make_optimizer`) once every worker has one; on leaving, a worker that
    finishes first waits a while for the others' last rounds, then shuts it all down.

    Every worker must build the same initial weights (the seed), as DDP broadcasts rank 0's.
    """
    check_compression(compression_named(args.compression))
    dht = start_dht(args)
    opt = None
    try:
        # the first round starts once every worker is in the swarm
        if not barrier(
            dht, f"{args.run_id}_joined", args.rank, args.num_workers, args.peer_timeout
        ):
            raise TimeoutError(
                f"not all {args.num_workers} workers joined in {args.peer_timeout} s"
            )
        opt = make_optimizer(args, dht, model, optimizer, scheduler)
        barrier(dht, f"{args.run_id}_ready", args.rank, args.num_workers, args.peer_timeout)
        yield opt
    finally:
        if opt is not None:
            barrier(dht, f"{args.run_id}_done", args.rank, args.num_workers, args.averaging_timeout)
            opt.shutdown()
        dht.shutdown()


def state_averaging_period(args: argparse.Namespace) -> int:
    """Rounds between two averagings of the parameters: ``--average-state-every``, else every
    round with local updates (the averaging is their only exchange) and every 10th with gradient
    averaging, where every worker applies the same averaged gradients and the averaging only
    repairs a drift (hivemind's docs: peers that hardly ever skip a round may average their state
    less often)."""
    if args.average_state_every is not None:
        return int(args.average_state_every)
    return 1 if args.local_updates else 10


def announce_batch(opt: hivemind.Optimizer, batch_size: int, timeout: float) -> int:
    """Publish this worker's batch toward the current round, then wait (at most ``timeout``
    seconds) until hivemind's progress tracker sees every batch of the round; the
    ``batch_size`` to pass to ``opt.step`` so that the batch is counted once.

    The announcement is what ``opt.step`` would report itself; reporting it first lets every
    worker see the others' batches before it decides whether the round is due.
    """
    tracker = opt.tracker
    tracker.report_local_progress(opt.local_epoch, batch_size)
    deadline = time.monotonic() + timeout
    # the round's samples seen, or a peer already past it; not hivemind's estimate of when they
    # should have arrived, which would let a worker start a round before the others' batches
    while time.monotonic() < deadline:
        progress = tracker.global_progress
        if (
            progress.epoch > opt.local_epoch
            or progress.samples_accumulated >= tracker.target_batch_size
        ):
            break
        time.sleep(0.002)
    # with gradient averaging, step accumulates the gradients weighted by its batch size and
    # reports its accumulated samples (this batch: no change); with local updates it reports the
    # samples already reported plus its batch size, so it must add none
    return 0 if opt.use_local_updates else batch_size


class EvaluatedModel(nn.Module):
    """With local updates, the model to evaluate: ``model`` once ``opt``'s averaging round in
    flight (if any) has been applied to it."""

    def __init__(self, model: nn.Module, opt: hivemind.Optimizer) -> None:
        super().__init__()
        self.model = model
        self.opt = opt

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.opt.state_averager.step(wait_for_delayed_updates=True)
        return self.model(images)


def evaluated_model(
    args: argparse.Namespace, model: nn.Module, opt: hivemind.Optimizer
) -> nn.Module:
    """The model worker 0 evaluates: ``model`` itself, or with local updates
    :class:`EvaluatedModel`."""
    return EvaluatedModel(model, opt) if args.local_updates else model


def step_in_round(args: argparse.Namespace, opt: hivemind.Optimizer, samples: int) -> None:
    """hivemind's step for this worker's batch of ``samples`` (its gradients computed), in
    lockstep with the other workers (:func:`announce_batch`)."""
    opt.step(batch_size=announce_batch(opt, samples, args.averaging_timeout))


def reporter(
    args: argparse.Namespace, opt: hivemind.Optimizer
) -> Callable[[dict[str, Any]], None] | None:
    """Worker 0's report: the training runner's record plus ``hivemind_epoch`` (the collective
    rounds done so far) and ``hivemind_peers`` (the peers hivemind's progress tracker saw),
    printed as a JSON line; None on the other workers."""
    from benchmarks.training import print_report

    if args.rank != 0:
        return None

    def report(record: dict[str, Any]) -> None:
        record["hivemind_epoch"] = opt.local_epoch
        record["hivemind_peers"] = opt.tracker.global_progress.num_peers
        print_report(record)

    return report


__all__ = [
    "COMPRESSIONS",
    "EvaluatedModel",
    "add_peer_arguments",
    "announce_batch",
    "check_compression",
    "compression_named",
    "evaluated_model",
    "listen_maddr",
    "read_peer_file",
    "reporter",
    "state_averaging_period",
    "step_in_round",
    "swarm",
    "write_peer_file",
]
