"""Array-module helpers: numpy on the host, CuPy on a GPU, imported only when needed.

Nothing here imports CuPy at module import time, so servers and CPU-only workers never touch
CUDA. :func:`cupy_or_none` imports it on first use and caches the answer.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

_cupy: Any = None
_cupy_checked = False


def cupy_or_none() -> Any:
    """The ``cupy`` module if it is importable, else None (cached)."""
    global _cupy, _cupy_checked
    if not _cupy_checked:
        _cupy_checked = True
        try:
            import cupy  # noqa: PLC0415  (optional dependency)

            _cupy = cupy
        except Exception:  # ImportError, or a CUDA runtime that fails to load
            _cupy = None
    return _cupy


def is_cupy_array(x: Any) -> bool:
    """True for a ``cupy.ndarray`` (checked without importing CuPy if it is not loaded)."""
    if "cupy" not in sys.modules:
        return False
    cupy = cupy_or_none()
    return cupy is not None and isinstance(x, cupy.ndarray)


def array_module(x: Any) -> Any:
    """``cupy`` for CuPy arrays, else ``numpy`` (like ``cupy.get_array_module``)."""
    return cupy_or_none() if is_cupy_array(x) else np


@dataclass
class TransferClock:
    """Seconds this process spent copying between host and GPU, and bytes copied.

    Attributes:
        d2h_seconds: device-to-host copies of encoded payloads (:func:`device_to_host`), from
            the moment the stream's earlier work (the encode kernel) was done.
        h2d_seconds: host-to-device copies of pulled values (:func:`host_to_device`), the copy
            into the pinned staging buffer included.
        d2h_bytes: bytes copied device to host.
        h2d_bytes: bytes copied host to device.
    """

    d2h_seconds: float = 0.0
    h2d_seconds: float = 0.0
    d2h_bytes: int = 0
    h2d_bytes: int = 0


TRANSFERS = TransferClock()
"""The process's transfer clock; a worker reads differences of it around its own calls."""

_staging = threading.local()


def device_to_host(src: Any, out: np.ndarray) -> np.ndarray:
    """Copy the CuPy array ``src`` into the host array ``out`` (pinned memory, for a DMA copy
    straight into it) on the current stream, and wait for it. Earlier work on the stream is
    waited for first, so :data:`TRANSFERS` counts the copy alone."""
    cupy = cupy_or_none()
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    start = time.perf_counter()
    src.get(out=out, stream=stream)
    TRANSFERS.d2h_seconds += time.perf_counter() - start
    TRANSFERS.d2h_bytes += out.nbytes
    return out


def _pinned_staging(nbytes: int) -> np.ndarray:
    """This thread's pinned staging buffer (uint8), grown to at least ``nbytes``."""
    buffer = getattr(_staging, "buffer", None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = pinned_empty(max(nbytes, 1 << 20), np.uint8)
        _staging.buffer = buffer
    return buffer


def host_to_device(src: Any, out: Any) -> Any:
    """Copy host data ``src`` (any buffer: a received frame, a numpy array) into the flat,
    contiguous CuPy array ``out`` of the same byte size, and wait for it.

    The bytes go through a page-locked staging buffer of this thread: one host memcpy into it,
    then one DMA copy to the device. A copy from pageable memory would make the driver stage it
    through a bounce buffer of its own in small pieces, at a fraction of the bus bandwidth.
    """
    cupy = cupy_or_none()
    start = time.perf_counter()
    host = np.frombuffer(getattr(src, "buffer", src), dtype=np.uint8)
    nbytes = host.nbytes
    if nbytes != out.nbytes:
        raise ValueError(f"host_to_device: {nbytes} bytes for a {out.nbytes}-byte array")
    if nbytes:
        staging = _pinned_staging(nbytes)[:nbytes]
        np.copyto(staging, host)
        stream = cupy.cuda.get_current_stream()
        out.view(cupy.uint8).set(staging, stream=stream)
        stream.synchronize()  # the staging buffer is reused by the next copy
    TRANSFERS.h2d_seconds += time.perf_counter() - start
    TRANSFERS.h2d_bytes += nbytes
    return out


def to_device(src: Any, dtype: Any) -> Any:
    """A new CuPy array holding the host buffer ``src`` viewed as ``dtype`` (through pinned
    staging, see :func:`host_to_device`)."""
    cupy = cupy_or_none()
    host = np.frombuffer(getattr(src, "buffer", src), dtype=dtype)
    return host_to_device(host, cupy.empty(host.size, dtype=host.dtype))


def pinned_empty(numel: int, dtype: Any) -> np.ndarray:
    """A numpy array in page-locked host memory (for fast, asynchronous GPU copies)."""
    cupy = cupy_or_none()
    if cupy is None:
        raise RuntimeError("pinned memory needs CuPy: pip install 'pskv[gpu]'")
    import cupyx  # noqa: PLC0415

    return cupyx.empty_pinned((numel,), dtype=dtype)
