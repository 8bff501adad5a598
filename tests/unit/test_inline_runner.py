"""The server's inline runner: Task timing and order without a Task, and a Task when needed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvstore.server.inline import InlineRunner


def _runner(tasks: list[asyncio.Task]) -> InlineRunner:
    def spawn(coro):
        tasks.append(asyncio.get_running_loop().create_task(coro))
        return tasks[-1]

    return InlineRunner(spawn)


def test_work_runs_after_the_current_callback_in_submission_order():
    events: list[str] = []

    async def work(name: str) -> None:
        events.append(name)

    async def main() -> None:
        tasks: list[asyncio.Task] = []
        runner = _runner(tasks)
        runner.submit(work("a"))
        runner.submit(work("b"))
        events.append("submitted")  # nothing ran yet: the work waits for the next turn
        await asyncio.sleep(0)
        assert events == ["submitted", "a", "b"]
        assert tasks == []  # work that never suspends needs no Task

    asyncio.run(main())


def test_work_submitted_by_work_joins_the_same_batch():
    events: list[str] = []

    async def main() -> None:
        runner = _runner([])

        async def outer() -> None:
            events.append("outer")
            runner.submit(inner())

        async def inner() -> None:
            events.append("inner")

        runner.submit(outer())
        await asyncio.sleep(0)
        assert events == ["outer", "inner"]

    asyncio.run(main())


def test_work_that_suspends_finishes_in_a_task_with_its_results():
    events: list[object] = []

    async def main() -> None:
        tasks: list[asyncio.Task] = []
        runner = _runner(tasks)
        lock = asyncio.Lock()
        await lock.acquire()  # held: the work below must wait for it
        pool_result: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        failing: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def work() -> str:
            async with lock:
                events.append("locked")
            events.append(await pool_result)
            try:
                await failing
            except ValueError as exc:
                events.append(str(exc))
            return "done"

        runner.submit(work())
        await asyncio.sleep(0)
        assert events == [] and len(tasks) == 1  # suspended on the lock: handed to a Task
        lock.release()
        await asyncio.sleep(0)
        pool_result.set_result(7)
        failing.set_exception(ValueError("thrown in"))
        assert await tasks[0] == "done"
        assert events == ["locked", 7, "thrown in"]

    asyncio.run(main())


def test_a_suspended_work_can_be_cancelled():
    async def main() -> None:
        tasks: list[asyncio.Task] = []
        runner = _runner(tasks)
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cleaned: list[bool] = []

        async def work() -> None:
            try:
                await never
            finally:
                cleaned.append(True)

        runner.submit(work())
        await asyncio.sleep(0)
        tasks[0].cancel()  # before the Task's first step
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        assert cleaned == [True]

        runner.submit(work())
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the Task took its first step and waits on `never`
        tasks[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        assert cleaned == [True, True]

    asyncio.run(main())


def test_a_failing_work_is_logged_and_the_batch_goes_on(caplog):
    events: list[str] = []

    async def broken() -> None:
        raise RuntimeError("boom")

    async def fine() -> None:
        events.append("fine")

    async def main() -> None:
        runner = _runner([])
        runner.submit(broken())
        runner.submit(fine())
        await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="kvstore.server.inline"):
        asyncio.run(main())
    assert events == ["fine"]
    assert "server work failed" in caplog.text and "boom" in caplog.text


def test_close_drops_work_not_started_without_warnings(recwarn):
    events: list[str] = []

    async def work() -> None:
        events.append("ran")

    async def main() -> None:
        runner = _runner([])
        runner.submit(work())
        runner.close()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert events == []
    assert not [w for w in recwarn if "never awaited" in str(w.message)]
