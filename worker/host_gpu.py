"""A key's host table in GPU memory, shared by the host's workers through CUDA IPC.

Where a host's workers push GPU values, summing them in host shared memory would copy every
value to the host and the host's sum back to a GPU. Instead local worker 0 allocates the key's
table (a slot per local worker and the host's sum, laid out as :mod:`kvstore.worker.host_group`
lays out host memory) with ``cudaMalloc`` on its GPU and exports an IPC handle; every other
worker of the host opens that handle on its own GPU (where the GPUs differ, CUDA enables peer
access as it opens it). Each worker then copies its value into its slot device to device, sums
its 1/k slice of the slots into the sum, and encodes its chunks from the sum: the values never
leave GPU memory before they are encoded.

Opening fails where CUDA cannot map the other process's memory (GPUs without peer access, the
handle's own process, a driver without IPC): the host then keeps the key in host memory
(:meth:`HostGroup.add_key <kvstore.worker.host_group.HostGroup.add_key>` agrees on it), which is
always correct, only slower.

The table's memory is ``cudaMalloc``'s own, never a memory pool's (a pool's block may be part of
a larger allocation, whose handle would name the whole of it).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np

from kvstore.codecs.xp import cupy_or_none
from kvstore.worker import values as vals

logger = logging.getLogger(__name__)


class DeviceTableError(RuntimeError):
    """A key's GPU table could not be made or opened (the host keeps it in host memory)."""


def _cupy() -> Any:
    cupy = cupy_or_none()
    if cupy is None:
        raise DeviceTableError("CuPy is not installed")
    return cupy


class DeviceTable:
    """``rows`` slots of ``numel`` elements in GPU memory that the host's workers share: rows
    ``0..k-1`` are the local workers' pushes, row ``k`` the host's sum.

    Make one with :meth:`allocate` (local worker 0) or :meth:`open` (the others, with the
    :attr:`handle` of worker 0's).

    Attributes:
        device_id: the CUDA device this process works on the table from.
        slots: the local workers' pushes, ``(rows - 1, numel)`` (CuPy).
        sum: the host's sum (CuPy).
        handle: the IPC handle of the allocation (its maker's only; None for an opened one).
    """

    def __init__(
        self,
        rows: int,
        numel: int,
        dtype: str,
        device_id: int,
        memory: Any,
        opened_pointer: int | None = None,
    ) -> None:
        cupy = _cupy()
        self.device_id = device_id
        self._memory = memory  # (the maker's allocation; freed when the table goes)
        self._opened_pointer = opened_pointer
        self.handle: bytes | None = None
        if opened_pointer is None:
            pointer = cupy.cuda.MemoryPointer(memory, 0)
            self.handle = cupy.cuda.runtime.ipcGetMemHandle(memory.ptr)
        else:
            nbytes = rows * numel * np.dtype(dtype).itemsize
            unowned = cupy.cuda.UnownedMemory(opened_pointer, nbytes, None, device_id)
            pointer = cupy.cuda.MemoryPointer(unowned, 0)
        table = cupy.ndarray((rows, numel), dtype=dtype, memptr=pointer)
        self.slots = table[:-1]
        self.sum = table[-1]
        self._closed = False

    @classmethod
    def allocate(cls, rows: int, numel: int, dtype: str, device_id: int) -> DeviceTable:
        """A new table on device ``device_id``, exported for the host's other workers.

        Raises:
            DeviceTableError: CUDA could not allocate or export it (saying why).
        """
        try:
            cupy = _cupy()
            with cupy.cuda.Device(device_id):
                memory = cupy.cuda.memory.Memory(rows * numel * np.dtype(dtype).itemsize)
                return cls(rows, numel, dtype, device_id, memory)
        except DeviceTableError:
            raise
        except Exception as exc:  # CUDARuntimeError, an out-of-memory, a dtype CuPy lacks
            raise DeviceTableError(f"{type(exc).__name__}: {exc}") from exc

    @classmethod
    def open(cls, handle: bytes, rows: int, numel: int, dtype: str, device_id: int) -> DeviceTable:
        """Worker 0's table (its :attr:`handle`), mapped into this process on ``device_id``.

        Raises:
            DeviceTableError: CUDA could not map it (saying why).
        """
        try:
            cupy = _cupy()
            runtime = cupy.cuda.runtime
            with cupy.cuda.Device(device_id):
                pointer = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
            try:
                return cls(rows, numel, dtype, device_id, None, pointer)
            except BaseException:
                with cupy.cuda.Device(device_id):
                    runtime.ipcCloseMemHandle(pointer)
                raise
        except DeviceTableError:
            raise
        except Exception as exc:
            raise DeviceTableError(f"{type(exc).__name__}: {exc}") from exc

    def write(self, row: int, value: Any) -> None:
        """Copy ``value`` (a user value: CuPy, a CUDA tensor, or host memory) into slot
        ``row``, ordered after the work that made it (a CUDA tensor's on torch's current
        stream). Asynchronous: :func:`synchronize_all` before another process reads it."""
        cupy = _cupy()
        with vals.device_stream(value):
            source = vals.flat_source(value)
            with cupy.cuda.Device(self.device_id):
                slot = self.slots[row]
                if isinstance(source, np.ndarray):
                    slot.set(source)
                else:
                    slot[...] = source

    def reduce(self, start: int, stop: int) -> None:
        """Sum elements ``[start, stop)`` of every slot into the sum, in slot order (the adds
        of :func:`~kvstore.worker.host_group.sum_slots`, so that both give the same bits).
        Asynchronous."""
        cupy = _cupy()
        if start >= stop:
            return
        with cupy.cuda.Device(self.device_id):
            region = self.sum[start:stop]
            if len(self.slots) == 1:
                region[...] = self.slots[0, start:stop]
                return
            cupy.add(self.slots[0, start:stop], self.slots[1, start:stop], out=region)
            for slot in self.slots[2:]:
                cupy.add(region, slot[start:stop], out=region)

    def close(self) -> None:
        """Unmap an opened table, or free a made one (idempotent)."""
        if self._closed:
            return
        self._closed = True
        del self.slots, self.sum
        if self._opened_pointer is not None:
            cupy = _cupy()
            with contextlib.suppress(Exception), cupy.cuda.Device(self.device_id):
                # (a table whose maker freed it first, as a job ends, is gone already)
                cupy.cuda.runtime.ipcCloseMemHandle(self._opened_pointer)
        self._memory = None


def synchronize_all(tables: list[DeviceTable]) -> None:
    """Wait for the queued work of every device the ``tables`` are on (once per device)."""
    for device_id in sorted({table.device_id for table in tables}):
        _cupy().cuda.Device(device_id).synchronize()


__all__ = ["DeviceTable", "DeviceTableError", "synchronize_all"]
