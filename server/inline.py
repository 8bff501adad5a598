"""Run short coroutines in batches on the event loop thread, without an ``asyncio.Task`` each.

The server's per-chunk work (sum a push, finish a round, answer) is a coroutine because chunks
longer than :data:`kvstore.server.work.INLINE_ELEMS` await the thread pool. Shorter chunks,
every fp32 chunk of the default partition size, never suspend: their work runs inline and
their chunk's lock is never contended, since nothing that holds it waits. Wrapping each in a
Task still cost the server a fifth of its loop thread in a loopback profile with many small
chunks (``create_task``, the loop's scheduling of the first step, the done callback), once
per push.

:class:`InlineRunner` keeps the Task's timing (the work runs after the current callback, in
submission order, so a drain's batch of messages is handled before its pushes are summed and
the replies go out together) but drives each coroutine itself, from one loop callback per batch.
A coroutine that suspends (a long chunk's, on the thread pool or on its chunk's lock) is
handed to a Task at that point and finishes there, so one runner serves every chunk and
correctness never depends on the work being short.

What it saves is the server's CPU per step when it handles many small chunks (on loopback,
with small partitions); where a server handles few chunks per step it makes no measurable
difference.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import types
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any

logger = logging.getLogger(__name__)


@types.coroutine
def _continue(coro: Coroutine[Any, Any, Any], awaiting: Any) -> Generator[Any, Any, Any]:
    """Resume ``coro``, which suspended on ``awaiting``, inside the Task that awaits this.

    The Task sees ``awaiting`` (the future ``coro`` yielded) as if ``coro`` itself had yielded
    it, and passes results and exceptions (cancellation included) through to ``coro``.
    """
    if awaiting is not None:
        awaiting._asyncio_future_blocking = True  # taken back from the runner: the Task's now
    while True:
        try:
            sent = yield awaiting
        except BaseException as exc:  # thrown in by the Task (cancellation too): passed on
            try:
                awaiting = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                awaiting = coro.send(sent)
            except StopIteration as stop:
                return stop.value


def _close(coro: Coroutine[Any, Any, Any], _task: asyncio.Task[Any]) -> None:
    """Close ``coro`` once the Task that was to finish it is done (a no-op if it finished)."""
    coro.close()


async def _finish(coro: Coroutine[Any, Any, Any], awaiting: Any) -> Any:
    """The rest of ``coro``, as a coroutine a Task can run."""
    return await _continue(coro, awaiting)


class InlineRunner:
    """Runs submitted coroutines on the loop thread after the current callback, in order.

    Args:
        spawn: makes the Task that finishes a coroutine that suspended (the server's task
            bookkeeping, so ``stop`` cancels it) and returns it.
    """

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]) -> None:
        self._spawn = spawn
        self._queue: deque[Coroutine[Any, Any, Any]] = deque()
        self._scheduled = False

    def submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` soon: after the current callback, before the loop polls again."""
        self._queue.append(coro)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        # Work submitted while this runs (a round's deferred pushes) joins this batch: the flag
        # stays set until the queue is empty, so it schedules no second callback.
        queue = self._queue
        try:
            while queue:
                coro = queue.popleft()
                try:
                    awaiting = coro.send(None)
                except StopIteration:
                    continue
                except Exception:  # the same as a failed Task: logged, the loop goes on
                    logger.error("server work failed", exc_info=True)
                    continue
                if awaiting is not None:
                    # Taken, as a Task takes what its coroutine yields: a future left marked
                    # "blocking" would fail its next await if the Task never took its first step.
                    awaiting._asyncio_future_blocking = False
                task = self._spawn(_finish(coro, awaiting))
                # A Task cancelled before its first step never runs `_finish`: close the work
                # then, so its cleanup (``finally``, ``async with``) runs at once (a no-op once
                # it finished).
                task.add_done_callback(functools.partial(_close, coro))
        finally:
            self._scheduled = False

    def close(self) -> None:
        """Drop work not started (the server is stopping)."""
        while self._queue:
            self._queue.popleft().close()


__all__ = ["InlineRunner"]
