"""The shard server: receives pushes, decodes and aggregates them, runs the optimizer, replies.

Never imports CuPy. Start one with ``kvstore-server`` (or ``python -m kvstore.server``), or
in-process with :class:`ShardServer`.
"""

from kvstore.server.server import ShardServer

__all__ = ["ShardServer"]
