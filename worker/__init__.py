"""The worker-side client: :class:`KVStore`, its transport, and value adapters."""

from kvstore.worker.client import KVStore, TrafficStats

__all__ = ["KVStore", "TrafficStats"]
