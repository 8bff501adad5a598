"""Array-module helpers: numpy on the host, CuPy on a GPU, imported only when needed.

Nothing here imports CuPy at module import time, so servers and CPU-only workers never touch
CUDA. :func:`cupy_or_none` imports it on first use and caches the answer.
"""

from __future__ import annotations

import sys
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


def pinned_empty(numel: int, dtype: Any) -> np.ndarray:
    """A numpy array in page-locked host memory (for fast, asynchronous GPU copies)."""
    cupy = cupy_or_none()
    if cupy is None:
        raise RuntimeError("pinned memory needs CuPy: pip install 'pskv[gpu]'")
    import cupyx  # noqa: PLC0415

    return cupyx.empty_pinned((numel,), dtype=dtype)
