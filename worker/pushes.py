"""The push path: a key's value encoded chunk by chunk and sent to the chunks' servers.

``push`` encodes each chunk on the caller's thread and queues it; it returns when the caller's
value is no longer needed, without waiting for the network. A chunk is re-encoded only after
its previous push was answered (its buffers are reused), so :meth:`Pushes.send` first waits for
it. Errors of a push are raised by the next call that waits on it: a later push or pull of the
same key, ``barrier`` or ``close`` (:meth:`Pushes.wait`).

A key's encoder is made at its first push, on the device of the values (GPU values are encoded
on the GPU); with metrics, one push of a key in ``KVSTORE_METRICS_EVERY`` also measures the
residual norm and the density sent (:meth:`~kvstore.codecs.Encoder.quality`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvstore.codecs.base import KeyEncoder, PushQuality
from kvstore.codecs.finite import count_nonfinite
from kvstore.errors import KVStoreError, NonFiniteError
from kvstore.wire import Op, PushFields, PushPullFields
from kvstore.worker import values as vals
from kvstore.worker.keys import KeyState
from kvstore.worker.landing import Landing
from kvstore.worker.request import Deadline, Request
from kvstore.worker.round_trips import RoundTrips
from kvstore.worker.stats import EncodeClock
from kvstore.worker.store_state import StoreState

logger = logging.getLogger(__name__)


class Pushes:
    """Encodes and sends the pushes of a store's keys, and waits for them.

    Args:
        store: the state the store's parts share.
    """

    def __init__(self, store: StoreState) -> None:
        self._store = store

    def refuse_nonfinite(self, work: Sequence[tuple[KeyState, Any]]) -> None:
        """Refuse pushed float values that hold NaN or an infinity, before anything of the call
        is encoded or sent (``KVSTORE_ALLOW_NONFINITE=1`` skips the check).

        One read of each value (:mod:`kvstore.codecs.finite`): a NaN would otherwise reach the
        servers' sums or stay in a 2-bit residual for good, where it sends nothing again.
        """
        if self._store.options.allow_nonfinite:
            return
        for state, value in work:
            if not state.dtype.startswith("float"):
                continue
            with vals.device_stream(value):
                bad = count_nonfinite(vals.flat_source(value))
            if bad:
                raise NonFiniteError(
                    f"the value pushed for {state.describe()} holds {bad} NaN or infinite "
                    f"element(s) of {state.numel}; nothing of this call was pushed and no "
                    f"residual changed (KVSTORE_ALLOW_NONFINITE=1 pushes them as they are)"
                )

    def send(
        self,
        state: KeyState,
        value: Any,
        op: Op,
        priority: int,
        landing: Landing | None = None,
        borrow: bool = False,
        deadline: Deadline | None = None,
    ) -> list[Request]:
        """Encode and send every chunk of ``value`` (in the key's send order); returns the
        requests in chunk order.

        ``op`` is PUSH, or PUSHPULL to ask for the round's value too (its replies land in
        ``landing`` when given). With ``borrow``, chunks whose codec can send the values as
        they are (dense host values) are sent from ``value``'s memory, not copied. A chunk's
        previous push is waited for within ``deadline`` (None: one from now).
        """
        store = self._store
        stats = store.stats
        if deadline is None:
            deadline = store.deadline()
        source = vals.flat_source(value)
        requests: list[Any] = [None] * len(state.chunks)  # every slot filled below
        metrics = store.metrics
        replicated = store.options.replicas > 1
        measured: list[PushQuality | None] | None = None
        if metrics is not None and metrics.measure(state.pushes_sent[0]):
            measured = []
        with vals.device_stream(value):
            key_encoder = self._key_encoder(state, source)
            if key_encoder.whole_key:  # begin() rewrites every chunk's payload buffers
                for chunk in state.send_order:
                    self.wait(state, chunk.index, deadline)
            # (values that reach an encoder were checked for NaN and infinities, unless the
            # job allows them)
            clock = EncodeClock(stats)
            key_encoder.begin(source, finite=not store.options.allow_nonfinite)
            clock.lap()
            for chunk in state.send_order:
                self.wait(state, chunk.index, deadline)
                encoder = key_encoder.chunks[chunk.index]
                values = source[chunk.start : chunk.stop]
                payloads = encoder.borrow(values) if borrow else None
                clock.start()
                if payloads is None:
                    payloads = encoder.encode(values)
                clock.lap()
                if measured is not None:
                    measured.append(encoder.quality(values))
                what = f"{op.name} of key {state.key!r} chunk {chunk.index}"
                rounds = encoder.round_trips
                # With replication each push says which of this worker's pushes of the chunk
                # it is, so that a replica it is sent to again after a failover knows it.
                sequence = state.pushes_sent[chunk.index] + 1 if replicated else None
                if rounds > 1:  # (PUSH only: see KVStore.pushpull and prefetch.asks_for_values)
                    assert op is Op.PUSH and landing is None
                    request = RoundTrips(
                        store.transport, stats, encoder, chunk.server,
                        PushFields(state.key, chunk.index, chunk.numel, sequence),
                        priority, (state.key, chunk.index), what,
                    ).start(payloads)  # fmt: skip
                else:
                    body: PushFields | PushPullFields
                    if op is Op.PUSHPULL:
                        body = PushPullFields(
                            state.key,
                            chunk.index,
                            chunk.numel,
                            *state.pull_offer(chunk),
                            sequence=sequence,
                        )
                    else:
                        body = PushFields(state.key, chunk.index, chunk.numel, sequence)
                    request = store.transport.submit(
                        chunk.server,
                        body,
                        payloads,
                        priority=priority,
                        order_key=(state.key, chunk.index),
                        what=what,
                        on_done=landing.callback(chunk) if landing is not None else None,
                    )
                if request.failed():  # refused before sending (the server is gone)
                    request.wait()
                state.last_push[chunk.index] = request
                state.pushes_sent[chunk.index] += rounds
                requests[chunk.index] = request
                stats.pushed_bytes += request.nbytes
                stats.pushed_raw_bytes += chunk.numel * np.dtype(state.dtype).itemsize
                stats.push_messages += 1
        if measured and metrics is not None:
            qualities = [q for q in measured if q is not None]
            if len(qualities) == len(measured):
                metrics.key_quality(
                    state.key,
                    sum(q.gradient_sq for q in qualities),
                    sum(q.residual_sq for q in qualities),
                    sum(q.sent_nonzero for q in qualities),
                    state.numel,
                )
        return requests

    def wait(self, state: KeyState, index: int, deadline: Deadline | None = None) -> None:
        """Wait for the last push of ``state``'s chunk ``index`` (within the call's
        ``deadline``; None: a call of its own) and raise its error."""
        previous = state.last_push[index]
        if previous is None:
            return
        state.last_push[index] = None
        try:
            previous.wait(deadline if deadline is not None else self._store.deadline())
        except KVStoreError as exc:
            raise _reworded(exc, f"an earlier push of {state.describe()} failed: {exc}") from exc

    def wait_all(
        self, keys: Iterable[KeyState] | None = None, deadline: Deadline | None = None
    ) -> None:
        """Wait for this worker's pushes (of ``keys``, or of all keys) within ``deadline``
        (None: a call of its own); raise the first error after all ended."""
        if deadline is None:
            deadline = self._store.deadline()
        first_error: BaseException | None = None
        for state in keys if keys is not None else list(self._store.keys.values()):
            for index in range(len(state.chunks)):
                try:
                    self.wait(state, index, deadline)
                except KVStoreError as exc:
                    first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def _key_encoder(self, state: KeyState, source: Any) -> KeyEncoder:
        """The key's encoder for values on ``source``'s device (made on first use, with the
        state a checkpoint load left waiting for it)."""
        device = vals.gpu_device_of(source)
        key_encoder = state.key_encoder
        if key_encoder is None or state.encoder_device != device:
            if key_encoder is not None:
                # The residuals live where the values live; moving devices starts them over.
                logger.warning("%s moved between host and GPU; residuals reset", state.describe())
                state.restored = None
            state.encoder_device = device
            key_encoder = state.new_key_encoder(device, self._store.rank)
            for encoder in key_encoder.chunks:  # named in the encoders' warnings
                encoder.label = state.describe()
            if state.restored is not None:  # from load_checkpoint
                for encoder, saved in zip(key_encoder.chunks, state.restored, strict=True):
                    if saved is not None:
                        encoder.load_state(saved)
                state.restored = None
            state.key_encoder = key_encoder
            state.encoders = list(key_encoder.chunks)
        return key_encoder


def _reworded(exc: BaseException, message: str) -> BaseException:
    """A copy of ``exc`` that says ``message`` and keeps its attributes (a lost worker's rank,
    a server's error code)."""
    copy = type(exc).__new__(type(exc), message)
    copy.__dict__.update(exc.__dict__)
    copy.args = (message,)
    return copy
