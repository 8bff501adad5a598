"""The ``local`` mode: one worker and an in-process server thread over ``inproc://``.

The server is the real :class:`~kvstore.server.ShardServer` (same decode, aggregation, optimizer
and validation code as a distributed job) running on its own event loop in a daemon thread, and
the client talks to it through ZeroMQ's in-process transport, which passes frames by reference.
So ``local`` gives exactly the results of a one-worker ``dist_sync`` job, in one process.
It uses no CURVE keys (:mod:`kvstore.auth`): an in-process connection has no handshake and
nothing outside the process can reach it, so keys in the environment are ignored here.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading

import zmq

from kvstore.config import ServerConfig

_counter = itertools.count()


class LocalServerThread:
    """Runs a ShardServer for one worker on a background event loop."""

    def __init__(self, context: zmq.Context, threads: int | None = None) -> None:
        from kvstore.server import ShardServer  # noqa: PLC0415  (only the local mode needs it)

        self.address = f"inproc://kvstore-local-{os.getpid()}-{next(_counter)}"
        config = ServerConfig(num_workers=1, bind=self.address, threads=threads or 2)
        self._server = ShardServer(config, context=context)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvstore-local-server", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._server.start())
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._server.stop())
        self._loop.close()

    def stop(self) -> None:
        """Stop the server and its thread."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
