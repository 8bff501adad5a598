"""pskv: a parameter-server key-value store for data-parallel deep learning.

Public surface::

    import kvstore
    kv = kvstore.create("dist_sync")   # "dist_sync" | "dist_async" | "local"
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init(key, value); kv.push(key, grad); kv.pull(key, out=value)

The worker client is imported lazily, so importing ``kvstore`` (or ``kvstore.server``) never
touches CuPy, torch or the worker's sockets.
"""

from __future__ import annotations

import typing as _typing

from kvstore._version import __version__
from kvstore.api import MODES, create
from kvstore.errors import (
    AuthenticationError,
    CheckpointError,
    CodecError,
    ConfigError,
    ConnectionLostError,
    DuplicateInitError,
    KeyNotInitializedError,
    KVStoreError,
    KVStoreTimeoutError,
    NonFiniteError,
    OptimizerError,
    ProtocolError,
    RemoteError,
    ServerLostError,
    UsageError,
    ValueMismatchError,
    WorkerLostError,
)

if _typing.TYPE_CHECKING:
    from kvstore.worker.client import KVStore
    from kvstore.worker.stats import TrafficStats

__all__ = [
    "MODES",
    "AuthenticationError",
    "CheckpointError",
    "CodecError",
    "ConfigError",
    "ConnectionLostError",
    "DuplicateInitError",
    "KVStore",
    "KVStoreError",
    "KVStoreTimeoutError",
    "KeyNotInitializedError",
    "NonFiniteError",
    "OptimizerError",
    "ProtocolError",
    "RemoteError",
    "ServerLostError",
    "TrafficStats",
    "UsageError",
    "ValueMismatchError",
    "WorkerLostError",
    "__version__",
    "create",
]


_LAZY = {"KVStore": "kvstore.worker.client", "TrafficStats": "kvstore.worker.stats"}
"""Names imported on first use, by the module that defines them."""


def __getattr__(name: str) -> object:
    # The worker client is imported on first use: importing kvstore stays free of sockets,
    # threads, CuPy and torch.
    module = _LAZY.get(name)
    if module is not None:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
