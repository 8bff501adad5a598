"""Where a shard server's work runs: on the loop thread or its thread pool, in Tasks or inline.

Decoding, aggregation and optimizer updates of chunks longer than :data:`INLINE_ELEMS` elements
run on a thread pool (the compiled kernels release the GIL), several at once; shorter chunks,
which includes every fp32 chunk of the default partition size, run on the loop thread, where
that costs less CPU than a thread hand-off (:meth:`WorkRunner.run`). A push's work starts after
the drain that received it, without a Task of its own unless it has to wait (for the pool or
its chunk's turn): :meth:`WorkRunner.submit`, see :mod:`kvstore.server.inline`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore.server.chunk import ChunkState
from kvstore.server.inline import InlineRunner

logger = logging.getLogger(__name__)

INLINE_ELEMS = 1 << 20
"""Chunks up to this many elements (one default partition of fp32) are decoded, summed and updated
on the loop thread; longer ones go to the thread pool.

A hand-off to the pool wakes a pool thread and then the loop again; on a host whose cores are
busy that costs more CPU than summing a chunk of this size (about 0.4 ms: ``a += b`` over 2^20
fp32, from ``benchmarks/bench_codecs.py``), and the loop thread would only wait for the result.
So the threshold is one default partition: with it, the loaded cluster benchmarks
(``benchmarks/bench_cluster.py``) run faster than with a lower one, and cells with idle CPU do
not change. Longer chunks (a larger ``KVSTORE_PARTITION_BYTES``, for fast links) still run on
several threads at once."""


class WorkRunner:
    """The server's thread pool and background Tasks.

    Args:
        threads: the thread pool's size.
        name: the pool threads' name prefix.
        inline: run work on the loop thread where it costs less than a hand-off (a push's
            coroutine until it suspends, chunks up to :data:`INLINE_ELEMS`); False
            (``KVSTORE_INLINE_WORK=0``): a Task per push and the pool for every chunk.
    """

    def __init__(self, threads: int, name: str, *, inline: bool = True) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._inline = InlineRunner(self.spawn) if inline else None
        self._inline_elems = INLINE_ELEMS if inline else -1

    @property
    def tasks(self) -> int:
        """How many Tasks are running."""
        return len(self._tasks)

    def submit(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a chunk's work soon: after the current callback, inline until it suspends."""
        if self._inline is None:
            self.spawn(coro)
        else:
            self._inline.submit(coro)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
        """Run ``coro`` in a Task that :meth:`cancel` cancels; a failure is logged."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("server task failed", exc_info=task.exception())

    async def run(self, chunk: ChunkState, fn: Callable[..., Any], *args: Any) -> Any:
        """Run chunk work: inline for small chunks, on the thread pool for big ones."""
        if chunk.spec.numel <= self._inline_elems:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the thread pool (file I/O of checkpoints)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def cancel(self) -> None:
        """Drop work not started and cancel the Tasks; returns once they ended."""
        if self._inline is not None:
            self._inline.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def shutdown(self) -> None:
        """Stop the thread pool (after :meth:`cancel`)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["INLINE_ELEMS", "WorkRunner"]
