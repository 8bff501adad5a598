"""The CUDA C of the codecs' CuPy kernels: ``.cu`` files shipped in the codec packages, read once
per process and put together in the order a kernel module names them.

A kernel module's source is a sequence of parts (:func:`assemble`): the shared helpers it
builds on, then its own ``.cu`` file, with ``#define`` lines (:func:`defines`) where a kernel
takes a constant from Python. Every part is a plain file under its package
(:func:`read_cu`), so an editor, a linter or ``nvcc`` can read it; what CuPy compiles is their
concatenation. The files need no CuPy to read: every kernel module's ``cuda_source()`` can be
built and checked on a machine without a GPU.

**IEEE helpers** (:func:`ieee_ops`, ``ieee_ops.cu``): float32 arithmetic exactly as numpy does
it. CuPy compiles every kernel with ``-ftz=true``, under which the C operators flush subnormal
inputs and results to zero (numpy and numba keep them), and NVRTC contracts ``a*b + c`` into a
fused multiply-add. These helpers issue the PTX instructions themselves (round to nearest, no
``.ftz``, never fused), so a kernel built on them gives numpy's bits. A kernel source that uses
them starts with them.
"""

from __future__ import annotations

import functools
from importlib import resources

from kvstore.errors import CodecError


@functools.cache
def read_cu(package: str, name: str) -> str:
    """The text of the CUDA file ``name`` in ``package`` (e.g. ``"kvstore.codecs.twobit"``).

    Raises:
        CodecError: the file is missing or empty (an incomplete installation: the ``.cu`` files
            are package data).
    """
    try:
        text = resources.files(package).joinpath(name).read_text(encoding="utf-8")
    except (OSError, ModuleNotFoundError) as exc:
        raise CodecError(f"the CUDA source {name} of {package} cannot be read: {exc}") from exc
    if not text.strip():
        raise CodecError(f"the CUDA source {name} of {package} is empty")
    return text


def assemble(*parts: str) -> str:
    """One kernel source from its parts, in order, each after a newline (so that the files'
    texts stay apart by a blank line)."""
    return "".join("\n" + part for part in parts)


def defines(**values: int) -> str:
    """``#define NAME value`` lines, one per keyword, in order: the constants a kernel source
    takes from Python (block sizes the host code also uses)."""
    return "".join(f"#define {name} {value}\n" for name, value in values.items())


def ieee_ops() -> str:
    """The IEEE float32 helpers (module docstring): ``ieee_add``, ``ieee_sub``, ``ieee_mul``,
    ``ieee_widen`` and ``magnitude_key``."""
    return read_cu("kvstore.codecs", "ieee_ops.cu")
