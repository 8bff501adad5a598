"""What the torchft peer's workers share (:mod:`benchmarks.torchft_mnist`,
:mod:`benchmarks.torchft_charlm`): their options, the addresses torchft needs, the job of one
worker (:class:`TorchftWorker`: a torchft replica group of one process, its local-update
algorithm and its shutdown) and the model it evaluates (:class:`SyncedModel`).

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
weights. No sync is forced at the end.

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

Every worker exits 0 when training is done, after a final barrier, and leaves no process behind
(torchft runs its servers as threads).
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and torchft are imported where training runs
    import torch
    from torch import nn

MODES = ("diloco", "localsgd")
"""torchft's local-update algorithms the workers run."""

_SIOCGIFADDR = 0x8915
"""Linux's ioctl that reads an interface's IPv4 address."""


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a torchft worker's place in the job and of its algorithm."""
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


def check_peer_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a malformed lighthouse address, a lighthouse off rank 0 or H below 1 (exits
    through ``parser.error``)."""
    try:
        split_address(args.lighthouse)  # refused here rather than by torchft, mid-start
    except ValueError as error:
        parser.error(f"--lighthouse: {error}")
    if args.start_lighthouse and args.rank != 0:
        parser.error("--start-lighthouse is rank 0's")
    if args.sync_every < 1:
        parser.error("--sync-every must be at least 1")


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


class TorchftWorker:
    """One worker's torchft job around ``network`` and its inner optimizer ``inner``: the
    lighthouse (rank 0, with ``--start-lighthouse``), this worker's store, process group and
    manager, and the local-update algorithm of ``--mode``; a context manager whose exit waits
    for every worker and shuts it all down.

    Every worker must draw the same initial weights (the seed): torchft's start needs no sync
    then (``init_sync=False``, as its Manager's documentation says).
    """

    def __init__(
        self, args: argparse.Namespace, network: nn.Module, inner: torch.optim.Optimizer
    ) -> None:
        import torch
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo, LocalSGD

        if "GLOO_SOCKET_IFNAME" not in os.environ:
            interface = interface_of(args.host)
            if interface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        timeout = timedelta(seconds=args.timeout)
        self._barrier_options = dist.BarrierOptions()
        self.lighthouse = None
        if args.start_lighthouse:
            self.lighthouse = LighthouseServer(bind=args.lighthouse, min_replicas=args.num_workers)
        # torchft's manager connects to its replica group's store (one process here); the
        # peers' process groups meet at the store of the quorum's first member
        self.store = dist.TCPStore(
            args.host, args.store_port, is_master=True, wait_for_workers=False
        )
        self.pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self.pg,
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
            replica_id=f"worker_{args.rank}",
            port=args.manager_port,
            hostname=args.host,
            init_sync=False,
        )
        self.algorithm: Any
        if args.mode == "diloco":
            outer = torch.optim.SGD(
                network.parameters(),
                lr=args.outer_lr,
                momentum=args.outer_momentum,
                nesterov=True,
            )
            self.algorithm = DiLoCo(
                self.manager, [network], inner, outer, sync_every=args.sync_every
            )
        else:
            self.algorithm = LocalSGD(self.manager, network, inner, sync_every=args.sync_every)
        self.synced = SyncedModel(network, self.manager.current_step)

    def barrier(self) -> None:
        """Wait for every worker."""
        self.pg.barrier(self._barrier_options).wait()

    def __enter__(self) -> TorchftWorker:
        self.algorithm.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.algorithm.__exit__(*exc)
        if exc[0] is not None:
            return  # the job failed: its peers time out, this process exits
        self.barrier()  # every worker has trained its last step: none needs the lighthouse
        self.manager.shutdown()
        self.barrier()  # every manager server has stopped sending the lighthouse heartbeats
        self.pg.shutdown()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
        del self.store  # (the peers' groups met at it: it lives until every worker is done)


__all__ = [
    "MODES",
    "SyncedModel",
    "TorchftWorker",
    "add_peer_arguments",
    "check_peer_arguments",
    "interface_of",
    "lighthouse_url",
    "split_address",
]
