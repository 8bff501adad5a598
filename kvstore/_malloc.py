"""Keep large freed buffers in the process instead of handing them back to the OS (glibc).

ZeroMQ allocates a fresh buffer for every large message it receives, and the payloads here are
megabytes. With glibc's defaults such buffers are ``mmap``-ed and ``munmap``-ed, or trimmed with
``madvise``, on every message, so each one is page-faulted and zeroed again: on loopback that was
most of a worker's CPU time (about 32 ms of system time per 10M-element push+pull step). Raising
the mmap threshold to its maximum (32 MiB) and the trim threshold to 1 GiB lets freed buffers be
reused; the cost is that memory freed by the process is not returned to the OS right away.

``KVSTORE_MALLOC_TUNING=0`` turns this off. It does nothing outside glibc-based Linux.
"""

from __future__ import annotations

import ctypes
import logging
import sys

from kvstore.config import malloc_tuning_from_env

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum on 64-bit
_TRIM_THRESHOLD = 1024 * 1024 * 1024

_applied = False


def tune_malloc() -> bool:
    """Apply the tuning once per process (unless disabled); True when it is in effect."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux") or not malloc_tuning_from_env():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    logger.debug("malloc tuning %s", "applied" if _applied else "refused by libc")
    return _applied
