"""The worker-side client: :class:`KVStore`, its transport, and value adapters."""

from kvstore.worker.client import KVStore
from kvstore.worker.stats import TrafficStats

__all__ = ["KVStore", "TrafficStats"]
