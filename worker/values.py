"""Adapters between user values (numpy arrays, torch tensors, CuPy arrays) and flat buffers.

The client works on flat, contiguous 1-D arrays: numpy for host memory, CuPy for GPU memory.
This module turns a user value into such an array without copying when it can (a contiguous
numpy array or CPU tensor is viewed, a CUDA tensor is wrapped by CuPy through DLPack), and
writes results back into ``out`` in place, keeping its type and device. Pulled values bound for
GPU memory land through a page-locked staging buffer (:func:`kvstore.codecs.xp.host_to_device`).

torch and CuPy are imported only when a value of theirs shows up.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.codecs.xp import cupy_or_none, host_to_device, is_cupy_array
from kvstore.wire import DTYPES

logger = logging.getLogger(__name__)

_warned_cuda_fallback = False


@dataclass(frozen=True)
class ValueInfo:
    """Shape, dtype and placement of a user value.

    Attributes:
        shape: the value's shape.
        dtype: numpy-style dtype name (``"float32"``).
        on_gpu: True for CuPy arrays and CUDA tensors.
    """

    shape: tuple[int, ...]
    dtype: str
    on_gpu: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _is_torch_tensor(value: Any) -> bool:
    if "torch" not in sys.modules:
        return False
    import torch  # noqa: PLC0415

    return isinstance(value, torch.Tensor)


def _torch_dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def describe(value: Any, name: str = "value") -> ValueInfo:
    """Shape, dtype and placement of ``value``.

    Raises:
        TypeError: ``value`` is not a numpy array, torch tensor or CuPy array, or its dtype is
            not supported.
    """
    if isinstance(value, np.ndarray):
        info = ValueInfo(tuple(value.shape), value.dtype.name, False)
    elif _is_torch_tensor(value):
        info = ValueInfo(tuple(value.shape), _torch_dtype_name(value), value.device.type != "cpu")
    elif is_cupy_array(value):
        info = ValueInfo(tuple(value.shape), value.dtype.name, True)
    else:
        raise TypeError(
            f"expected a numpy array, torch tensor or CuPy array for `{name}`, "
            f"got {type(value).__name__}"
        )
    if info.dtype not in DTYPES:
        raise TypeError(
            f"`{name}` has dtype {info.dtype}, which kvstore does not support; "
            f"supported: {', '.join(sorted(DTYPES))}"
        )
    return info


def _cuda_tensor_to_cupy(tensor: Any) -> Any:
    """A CuPy array sharing the CUDA tensor's memory (DLPack: zero-copy, and ordered after the
    work torch queued on its current stream), or None without CuPy."""
    cupy = cupy_or_none()
    if cupy is None:
        return None
    return cupy.from_dlpack(tensor.detach())


def _warn_cuda_fallback() -> None:
    global _warned_cuda_fallback
    if not _warned_cuda_fallback:
        _warned_cuda_fallback = True
        logger.warning(
            "CUDA tensors are encoded on the CPU because CuPy is not installed "
            "(pip install 'pskv[gpu]' encodes them on the GPU)"
        )


def flat_source(value: Any) -> Any:
    """A flat, contiguous array with the data of ``value`` (a view when possible).

    Host values give numpy arrays; GPU values give CuPy arrays (or, without CuPy, a host copy).
    A numpy array in non-native byte order (``np.array(x, ">f4")`` on a little-endian host)
    is converted, into a copy: payloads travel in native order and the kernels read it.
    """
    if isinstance(value, np.ndarray):
        if not value.dtype.isnative:
            return value.astype(value.dtype.newbyteorder("="), order="C").reshape(-1)
        return np.ascontiguousarray(value).reshape(-1)
    if _is_torch_tensor(value):
        tensor = value.detach()
        if tensor.device.type == "cpu":
            return tensor.contiguous().numpy().reshape(-1)
        wrapped = _cuda_tensor_to_cupy(tensor.contiguous())
        if wrapped is None:
            _warn_cuda_fallback()
            return tensor.contiguous().cpu().numpy().reshape(-1)
        return wrapped.reshape(-1)
    cupy = cupy_or_none()
    return cupy.ascontiguousarray(value).reshape(-1)


def host_copy(flat: Any) -> np.ndarray:
    """``flat`` as a numpy array (copied from the GPU if needed)."""
    if isinstance(flat, np.ndarray):
        return flat
    return flat.get()


class FlatTarget:
    """Writes pulled chunks into ``out`` in place.

    For a contiguous host ``out`` the chunks go straight into its memory; otherwise (also for
    an ``out`` in non-native byte order) they go into a staging array that :meth:`finish`
    copies into ``out``.
    """

    def __init__(self, out: Any) -> None:
        self._out = out
        self._finish: Callable[[], None] | None = None
        self.on_gpu = False
        self.flat: Any  # the flat array the chunks are written into (numpy or CuPy)
        if isinstance(out, np.ndarray):
            self._init_numpy(out)
        elif _is_torch_tensor(out):
            self._init_torch(out)
        else:  # CuPy
            self.on_gpu = True
            if out.flags.c_contiguous:
                self.flat = out.reshape(-1)
            else:
                staging = cupy_or_none().empty(out.size, dtype=out.dtype)
                self.flat = staging

                def finish() -> None:
                    out[...] = staging.reshape(out.shape)

                self._finish = finish

    def _init_numpy(self, out: np.ndarray) -> None:
        if not out.flags.writeable:
            raise ValueError("`out` is read-only")
        if out.flags.c_contiguous and out.dtype.isnative:
            self.flat = out.reshape(-1)
        else:  # (np.copyto below converts the byte order where out's is not native)
            staging = np.empty(out.size, dtype=out.dtype.newbyteorder("="))
            self.flat = staging

            def finish() -> None:
                np.copyto(out, staging.reshape(out.shape))

            self._finish = finish

    def _init_torch(self, out: Any) -> None:
        tensor = out.detach()
        if tensor.device.type == "cpu":
            if tensor.is_contiguous():
                self.flat = tensor.numpy().reshape(-1)
            else:
                staging = np.empty(tensor.numel(), dtype=_torch_dtype_name(tensor))
                self.flat = staging

                def finish() -> None:
                    import torch  # noqa: PLC0415

                    tensor.copy_(torch.from_numpy(staging).view(tensor.shape))

                self._finish = finish
            return
        wrapped = _cuda_tensor_to_cupy(tensor) if tensor.is_contiguous() else None
        if wrapped is not None:
            self.on_gpu = True
            self.flat = wrapped.reshape(-1)
            return
        host_staging = np.empty(tensor.numel(), dtype=_torch_dtype_name(tensor))
        self.flat = host_staging

        def copy_to_device() -> None:
            import torch  # noqa: PLC0415

            tensor.copy_(torch.from_numpy(host_staging).view(tensor.shape), non_blocking=False)

        self._finish = copy_to_device

    def write(self, start: int, stop: int, data: np.ndarray) -> None:
        """Copy host ``data`` into elements ``[start, stop)``."""
        if self.on_gpu:
            host_to_device(data, self.flat[start:stop])
        else:
            np.copyto(self.flat[start:stop], data, casting="no")

    def region(self, chunk: Any) -> Any:
        """The flat array (numpy or CuPy) of ``chunk``'s elements, to write in place."""
        return self.flat[chunk.start : chunk.stop]

    def finish(self) -> None:
        """Complete the write (copy staging into ``out`` when one was needed)."""
        if self._finish is not None:
            self._finish()


@contextlib.contextmanager
def device_stream(value: Any) -> Iterator[None]:
    """Run GPU work for a GPU value on its device: a CUDA tensor's on torch's current stream, a
    CuPy array's on CuPy's current stream of its device (a no-op for host values).

    CuPy then orders its kernels after the work that produced the tensor (backward) without a
    device-wide synchronization, and works on the array's device whichever is current.
    """
    if is_cupy_array(value):
        with value.device:
            yield
        return
    if not (_is_torch_tensor(value) and value.device.type == "cuda"):
        yield
        return
    cupy = cupy_or_none()
    if cupy is None:
        yield
        return
    import torch  # noqa: PLC0415

    with cupy.cuda.Device(value.device.index or 0):
        with _cupy_stream(cupy, torch.cuda.current_stream(value.device)):
            yield


def _cupy_stream(cupy: Any, torch_stream: Any) -> Any:
    """CuPy's handle of a torch CUDA stream (through the CUDA stream protocol where both sides
    speak it; CuPy versions before 14 only take the raw pointer)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
        return from_external(torch_stream)
    return cupy.cuda.ExternalStream(torch_stream.cuda_stream)


def cuda_device_index(value: Any) -> int | None:
    """The CUDA device of a GPU value that CuPy can work on (a CuPy array, or a CUDA tensor
    with CuPy installed); None for host values."""
    if is_cupy_array(value):
        return int(value.device.id)
    if _is_torch_tensor(value) and value.device.type == "cuda" and cupy_or_none() is not None:
        return int(value.get_device())
    return None


def gpu_device_of(flat: Any) -> Any:
    """The CuPy device of a CuPy array, or None for host arrays."""
    return flat.device if is_cupy_array(flat) else None
