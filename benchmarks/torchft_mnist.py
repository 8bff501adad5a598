"""One worker of torchft training the MNIST example's model on the example's data: the
local-update peer of :mod:`benchmarks.time_to_accuracy` (torchft's DiLoCo or LocalSGD over gloo).

It mirrors :mod:`benchmarks.ddp_mnist`: the same data shard per rank, model (the same initial
weights, from the seed), batch size, epoch order, steps per epoch and inner SGD (its momentum and
weight decay), through the benchmarks' training runner (:func:`benchmarks.training.train_epochs`).
Each worker is one torchft replica group of one process: a :class:`torchft.Manager` over a
``ProcessGroupGloo`` with ``min_replica_size`` the number of workers, so that every sync needs
every worker, as DDP's allreduce does.

- ``--mode diloco`` (the default): torchft's ``DiLoCo`` (Douillard et al., "DiLoCo: Distributed
  Low-Communication Training of Language Models", 2023). Every ``--sync-every`` H inner steps
  the workers average their pseudo-gradients (the last global weights minus the local ones)
  with a gloo allreduce, and the outer optimizer, SGD with Nesterov momentum (the paper's 0.9,
  learning rate 0.7), steps the global weights, which then replace every worker's.
- ``--mode localsgd``: torchft's ``LocalSGD``, which averages the weights themselves every H
  steps (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", 2018).

Evaluated model: the last global model the job synced (the weights every worker holds right
after a sync), not a worker's local weights after it; before the first sync, the initial
weights. The steps an epoch takes after its last sync count towards the next sync, and those
after the run's last sync are not in the evaluated model (no sync is forced at the end).

Addresses, all from the command line (a worker listens on ``--host`` only as torchft does: its
store and manager server on every interface of its host, at the ports given):

- ``--lighthouse HOST:PORT``: torchft's lighthouse, which forms the quorum of every sync. With
  ``--start-lighthouse``, rank 0 runs it in its own process (torchft's ``LighthouseServer``
  bound to ``HOST:PORT``, ``min_replicas`` the number of workers) and stops it after the last
  worker is done; without, start one first with torchft's own command
  (``torchft_lighthouse --bind HOST:PORT --min_replicas N``) and stop it afterwards.
- ``--host IP``: this worker's address, which its peers reach its store (``--store-port``),
  manager server (``--manager-port``) and gloo pairs at. Unless ``GLOO_SOCKET_IFNAME`` is set,
  gloo is given the interface that holds ``IP``.

Worker 0 prints a JSON line per epoch: mean loss, test accuracy and the epoch's seconds (its
evaluation included, as the example's). Every worker exits 0 when training is done, after a
final barrier, and leaves no process behind (torchft runs its servers as threads).

    python -m benchmarks.torchft_mnist --rank R --num-workers N --host IP \\
        --lighthouse HOST:PORT [--start-lighthouse] [--mode diloco --sync-every H]
"""

from __future__ import annotations

import argparse
import array
import copy
import fcntl
import os
import socket
import struct
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from benchmarks.training import (
    add_worker_arguments,
    example_module,
    print_report,
    start_worker,
    steps_per_epoch,
    train_epochs,
)

if TYPE_CHECKING:  # torch and torchft are imported where training runs
    from torch import nn

MODES = ("diloco", "localsgd")
"""torchft's local-update algorithms this worker runs."""

_SIOCGIFADDR = 0x8915
"""Linux's ioctl that reads an interface's IPv4 address."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--host", required=True, help="this worker's IP address")
    parser.add_argument("--store-port", type=int, default=29520, help="this worker's TCPStore")
    parser.add_argument(
        "--manager-port", type=int, default=29521, help="this worker's torchft manager server"
    )
    parser.add_argument("--lighthouse", required=True, help="HOST:PORT of torchft's lighthouse")
    parser.add_argument(
        "--start-lighthouse",
        action="store_true",
        help="rank 0 runs the lighthouse at --lighthouse (else one must be running)",
    )
    parser.add_argument("--mode", choices=MODES, default="diloco")
    parser.add_argument(
        "--sync-every", type=int, default=10, metavar="H", help="inner steps between syncs"
    )
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD")
    parser.add_argument(
        "--outer-momentum", type=float, default=0.9, help="DiLoCo's outer Nesterov momentum"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds torchft waits for a quorum, a connection or a collective",
    )
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    split_address(args.lighthouse)  # refused here rather than by torchft, mid-start
    if args.start_lighthouse and args.rank != 0:
        parser.error("--start-lighthouse is rank 0's")
    if args.sync_every < 1:
        parser.error("--sync-every must be at least 1")
    return args


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as its host and port.

    Raises:
        ValueError: no port, or one that is not a number.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def lighthouse_url(address: str) -> str:
    """The URL torchft's manager reaches the lighthouse at ``HOST:PORT`` by."""
    host, port = split_address(address)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def interface_of(address: str) -> str | None:
    """The name of this host's network interface whose IPv4 address is ``address``, or None
    (no interface has it as its primary address, or it is not IPv4).

    Gloo binds its pairs to one interface; without ``GLOO_SOCKET_IFNAME`` it picks the one the
    machine's host name resolves to, which is not this worker's in a network namespace.
    """
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if request.tobytes()[20:24] == wanted:
                return name
    return None


class SyncedModel:
    """A copy of the model that holds the global weights the job last synced: what the worker
    evaluates (see the module's docstring).

    ``refresh()`` after every inner step copies the model's weights into the copy when
    ``synced_count()`` (torchft's manager's step: the syncs it committed) has advanced, that
    is right after a sync, when every worker holds the same weights.
    """

    def __init__(self, model: nn.Module, synced_count: Callable[[], int]) -> None:
        self.model: nn.Module = copy.deepcopy(model)
        self._source = model
        self._synced_count = synced_count
        self._seen = synced_count()

    def refresh(self) -> bool:
        """Take the model's weights if a sync committed since the last call; whether it did."""
        count = self._synced_count()
        if count == self._seen:
            return False
        self._seen = count
        self.model.load_state_dict(self._source.state_dict())
        return True


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo, LocalSGD

    training = start_worker(args)
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_of(args.host)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    data = example_module("mnist_data").load_data(args.rank, args.num_workers, torch.device("cpu"))
    # every worker draws the same initial weights from the seed (as DDP's broadcast of rank 0's),
    # so torchft's start needs no sync (init_sync=False, as its Manager's documentation says)
    network = example_module("mnist_models").make_model(args.model)
    timeout = timedelta(seconds=args.timeout)
    lighthouse = None
    if args.start_lighthouse:
        lighthouse = LighthouseServer(bind=args.lighthouse, min_replicas=args.num_workers)
    # torchft's manager connects to its replica group's store (one process here); the peers'
    # process groups meet at the store of the quorum's first member
    store = dist.TCPStore(args.host, args.store_port, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        load_state_dict=network.load_state_dict,
        state_dict=network.state_dict,
        min_replica_size=args.num_workers,
        use_async_quorum=False,  # DiLoCo needs the quorum before the sync that uses it
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=args.host,
        store_port=args.store_port,
        lighthouse_addr=lighthouse_url(args.lighthouse),
        replica_id=f"mnist_{args.rank}",
        port=args.manager_port,
        hostname=args.host,
        init_sync=False,
    )
    opt = torch.optim.SGD(
        network.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd
    )
    algorithm: DiLoCo | LocalSGD
    if args.mode == "diloco":
        outer = torch.optim.SGD(
            network.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True
        )
        algorithm = DiLoCo(manager, [network], opt, outer, sync_every=args.sync_every)
    else:
        algorithm = LocalSGD(manager, network, opt, sync_every=args.sync_every)
    synced = SyncedModel(network, manager.current_step)
    loss_fn = nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(network(images), labels)
        loss.backward()
        opt.step()  # torchft's hooks on it sync every H steps
        synced.refresh()
        return float(loss.item())

    def barrier() -> None:
        pg.barrier(dist.BarrierOptions()).wait()

    steps = steps_per_epoch(training, args.num_workers)
    report = print_report if args.rank == 0 else None
    with algorithm:
        train_epochs(training, step, synced.model, data, steps, report)
    barrier()  # every worker has trained its last step: none needs the lighthouse again
    manager.shutdown()
    barrier()  # every manager server has stopped sending the lighthouse its heartbeats
    pg.shutdown()
    if lighthouse is not None:
        lighthouse.shutdown()
    del store  # (which the peers' process groups met at: it lives until every worker is done)


if __name__ == "__main__":
    main()
