"""The pull path: a request for each chunk's value, and the wait until every value landed.

A pull request carries how many pushes of the chunk this worker sent so far (``af``), and each
server answers it only after that many were applied (in ``dist_sync``: after the whole round),
so ``push`` followed by ``pull`` returns the round's result even though pulls travel on a
connection of their own. Where the key's last push already asked for the values
(:mod:`kvstore.worker.prefetch`), the pull takes its replies instead of asking again. Replies
land in ``out`` through a :class:`~kvstore.worker.landing.Landing`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvstore.codecs import xp
from kvstore.errors import KVStoreError, KVStoreTimeoutError
from kvstore.wire import PullFields
from kvstore.worker import prefetch
from kvstore.worker.keys import KeyState
from kvstore.worker.landing import Landing
from kvstore.worker.pushes import Pushes
from kvstore.worker.request import Deadline, Request
from kvstore.worker.store_state import StoreState


class Pulls:
    """Asks for a store's values and waits until they landed.

    Args:
        store: the state the store's parts share.
        pushes: the store's pushes (a pull reports a failed push of its key).
    """

    def __init__(self, store: StoreState, pushes: Pushes) -> None:
        self._store = store
        self._pushes = pushes

    def requests(self, state: KeyState, landing: Landing, priority: int) -> list[Request]:
        """One request per chunk whose reply fills ``landing``: the last push's own, where it
        asked for the values, else a new pull."""
        prefetched = prefetch.take(state)
        if prefetched is not None:
            for chunk, request in zip(state.chunks, prefetched, strict=True):
                callback = landing.callback(chunk)
                if callback is not None:  # (None: the caller lands GPU targets itself)
                    request.add_done_callback(callback)
            return prefetched
        return self.submit(state, landing, priority)

    def submit(self, state: KeyState, landing: Landing, priority: int) -> list[Request]:
        """A pull of every chunk of ``state`` this worker exchanges (:attr:`KeyState.own_chunks`),
        following every push sent so far."""
        return [
            self._store.transport.submit(
                chunk.server,
                PullFields(
                    state.key, chunk.index, state.pushes_sent[chunk.index], *state.pull_offer(chunk)
                ),
                priority=priority,
                what=f"pull of key {state.key!r} chunk {chunk.index}",
                on_done=landing.callback(chunk),
            )
            for chunk in state.own_chunks
        ]

    def receive(self, pending: Iterable[tuple[Landing, list[Request]]], deadline: Deadline) -> None:
        """Wait for the values of every key of one call, all within the call's ``deadline``.

        Host targets were filled on the I/O thread as their replies came; GPU targets are
        filled here, chunk by chunk. A failed push of a key is raised here too, once its
        values are in.
        """
        stats = self._store.stats
        first_error: BaseException | None = None
        for landing, requests in pending:
            state = landing.state
            if landing.on_io_thread:
                waited = time.perf_counter()
                arrived = landing.all_arrived.wait(deadline.remaining())
                stats.wire_seconds += time.perf_counter() - waited
                if not arrived:
                    waiting = next(r for r in requests if not r.done())
                    first_error = first_error or KVStoreTimeoutError(
                        f"{waiting.what} to server {waiting.server} got no reply within "
                        f"{deadline.timeout} s (KVSTORE_TIMEOUT, for the whole call); is another "
                        f"worker stuck?"
                    )
                for error in landing.errors:
                    first_error = first_error or error
            else:
                for chunk, request in zip(state.own_chunks, requests, strict=True):
                    try:
                        waited = time.perf_counter()
                        reply = request.wait(deadline)
                        copies = xp.TRANSFERS.h2d_seconds
                        landed = time.perf_counter()
                        stats.wire_seconds += landed - waited
                        landing.write(chunk, reply)
                        # a relayed reply is also decoded here: that is encode time
                        h2d = xp.TRANSFERS.h2d_seconds - copies
                        stats.h2d_seconds += h2d
                        stats.encode_seconds += time.perf_counter() - landed - h2d
                        request.release_payloads()
                    except KVStoreError as exc:
                        first_error = first_error or exc
            if first_error is None:
                landing.target.finish()
            for index, push in enumerate(state.last_push):
                if push is not None and push.failed() and first_error is None:
                    try:
                        self._pushes.wait(state, index, deadline)
                    except KVStoreError as exc:
                        first_error = exc
        if first_error is not None:
            raise first_error
