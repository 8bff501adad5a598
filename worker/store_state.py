"""What the parts of one :class:`~kvstore.KVStore` share: :class:`StoreState`.

The store checks each call's arguments and hands the work to its parts (the pushes, the pulls,
the checkpoint protocol); they all read and change the same job settings, keys, counters and
connection, held here, instead of reaching into the store or into each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config import WorkerOptions
from kvstore.errors import KeyNotInitializedError
from kvstore.metrics import WorkerMetrics
from kvstore.optimizer_spec import OptimizerSpec
from kvstore.topology import Key
from kvstore.worker.keys import KeyState
from kvstore.worker.request import Deadline
from kvstore.worker.stats import TrafficStats
from kvstore.worker.transport import Transport


@dataclass
class StoreState:
    """The job, the settings, the connection, the keys and the counters of one store.

    Attributes:
        mode: ``"dist_sync"``, ``"dist_async"`` or ``"local"``.
        rank: this worker's rank.
        num_workers: the number of workers N.
        num_servers: the number of servers S.
        options: the worker's settings, with the job-size defaults filled in.
        transport: the connection to the servers.
        stats: the traffic counters the parts add to.
        keys: the initialised keys.
        metrics: the Prometheus metrics until the store closes (None: none).
        optimizer: the servers' optimizer, as set or restored (None: none).
        workers_per_push: how many workers of this worker's host share each push of a chunk
            (k with hierarchical aggregation, :mod:`kvstore.worker.host_group`; else 1).
    """

    mode: str
    rank: int
    num_workers: int
    num_servers: int
    options: WorkerOptions
    transport: Transport
    stats: TrafficStats
    keys: dict[Key, KeyState]
    metrics: WorkerMetrics | None = None
    optimizer: OptimizerSpec | None = None
    workers_per_push: int = 1

    def deadline(self) -> Deadline:
        """The deadline of a blocking call starting now: ``KVSTORE_TIMEOUT`` bounds each call
        as a whole, however many keys, chunks and requests it waits for."""
        return Deadline(self.options.timeout)

    def key_state(self, key: Key) -> KeyState:
        """The state of an initialised ``key``."""
        state = self.keys.get(key)
        if state is None:
            raise KeyNotInitializedError(
                f"key {key!r} is not initialised; call kv.init({key!r}, value) on every worker "
                f"first"
            )
        return state
