"""A DDP communication hook that averages DDP's gradient buckets through the store.

::

    state = kvt.DDPHookState(kv, compression={"type": "2bit", "threshold": 0.5})
    ddp_model.register_comm_hook(state, kvt.ddp_comm_hook)

DDP hands the hook each gradient bucket as it becomes ready, in bucket order, and waits for the
futures the hook returned once backward is done. The hook pushes each bucket at once (the push
returns once it is encoded, so later buckets' backward goes on while it travels) and returns a
future; the call for DDP's last bucket of the step pulls every bucket of the step in one call,
divides the sums by the number of workers and completes the futures with the means.

Each bucket is one key, ``{prefix}{index}.{numel}``, made (collectively) the first time DDP hands
over a bucket of that index and size: DDP rebuilds its buckets after the first step, in an order
it agrees on across workers, and the new sizes get keys of their own. Any codec works
(``compression``, or the store's); the process group DDP was built with still broadcasts the
initial parameters and agrees on the bucket order, but gradients go through the servers.

The store must be ``dist_sync`` without a server optimizer (the hook pulls sums), and the hook
runs on the thread that runs backward, one step at a time.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with the real dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from kvstore.errors import UsageError

# (torch builds without distributed support have no GradBucket, and no DDP to hook into)
GradBucket: Any = getattr(dist, "GradBucket", Any)

DEFAULT_PREFIX = "kvt.ddp/"


class DDPHookState:
    """The state of :func:`ddp_comm_hook`: the store, the codec and this step's buckets.

    Args:
        kv: the store (``dist_sync`` or ``local``, no server optimizer).
        compression: the codec of the hook's keys; None: the store's.
        prefix: prepended to the bucket indices to make keys; one per DDP model.
    """

    def __init__(
        self, kv: Any, compression: Mapping[str, Any] | None = None, prefix: str = DEFAULT_PREFIX
    ) -> None:
        if kv.type not in ("dist_sync", "local"):
            raise UsageError(f"the DDP hook needs a dist_sync store, not {kv.type}")
        self.kv = kv
        self.compression = None if compression is None else dict(compression)
        self.prefix = prefix
        self._keys: set[str] = set()
        self._pending: list[tuple[str, torch.Tensor, torch.futures.Future[torch.Tensor]]] = []

    def key_for(self, index: int, buffer: torch.Tensor) -> str:
        """The key of DDP's bucket ``index`` holding ``buffer`` (made on first use)."""
        key = f"{self.prefix}{index}.{buffer.numel()}"
        if key not in self._keys:
            if self.kv.optimizer is not None:
                raise UsageError(
                    f"the servers run {self.kv.optimizer!r}, so pulls are weights, not "
                    f"gradient sums: the DDP hook needs a store without a server optimizer"
                )
            # (on the bucket's device: a host's workers sum GPU keys on their GPUs)
            zeros = torch.zeros(buffer.shape, dtype=buffer.dtype, device=buffer.device)
            self.kv.init(key, zeros, compression=self.compression)
            self._keys.add(key)
        return key

    def push(self, key: str, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Push ``buffer`` and return the future of its mean."""
        self.kv.push(key, buffer)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._pending.append((key, buffer, future))
        return future

    def finish_step(self) -> None:
        """Pull every bucket pushed this step and complete their futures with the means."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            self.kv.pull([key for key, _, _ in pending], out=[buffer for _, buffer, _ in pending])
        except BaseException as exc:
            for _, _, future in pending:
                # torch's stub types the argument as the future's result type
                future.set_exception(exc)  # type: ignore[arg-type]
            raise
        workers = self.kv.num_workers
        for _, buffer, future in pending:
            if workers > 1:
                buffer.div_(workers)
            future.set_result(buffer)


def ddp_comm_hook(state: DDPHookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over workers by the servers.

    Register with ``ddp_model.register_comm_hook(DDPHookState(kv, ...), ddp_comm_hook)``.
    """
    buffer = bucket.buffer()
    future = state.push(state.key_for(bucket.index(), buffer), buffer)
    if bucket.is_last():
        state.finish_step()
    return future


__all__ = ["DDPHookState", "ddp_comm_hook"]
