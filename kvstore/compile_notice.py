"""Whether a job's first steps will compile numba kernels, so that a program can say so once.

Every CPU kernel is a numba function with ``cache=True``: numba compiles it the first time it is
called with new argument types and writes the machine code to its on-disk cache (a
``__pycache__`` folder beside the module, ``NUMBA_CACHE_DIR`` where that is set, or a folder in
the user's home where the package's folder is read-only), from which every later process loads
it in milliseconds. A fresh install has no cache: the first job compiles its codec's and its
optimizer's kernels, in each process that calls them, which adds seconds to its first steps.

:func:`compile_notice` reads numba's cache index files, before anything runs, to tell which of
a job's kernel modules have no compiled code for this machine yet, and words the one line a
program can print about it. It costs a few small file reads and the imports of the kernel
modules (numba's start-up, which the job's first push pays anyway), so it belongs in a
program's start-up, never in the library's per-step path. It reads numba's index format,
which numba does not publish: where that format is not what it expects, it says nothing
rather than something wrong.

A codec's kernels are found by this package's layout: the ``numba_kernels`` module of the
codec class's package (``kvstore.codecs.sign.onebit.OneBitCodec`` ->
``kvstore.codecs.sign.numba_kernels``), or of a package above it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

KERNEL_MODULE = "numba_kernels"
"""Name of the module that holds a codec family's numba kernels, inside its package."""

FINITE_CHECK = "kvstore.codecs._finite_numba"
"""The NaN and infinity check every CPU push makes before it encodes."""

OPTIMIZERS = "kvstore.server.optimizers"
"""The servers' optimizer kernels (``sgd``, ``nag``, delayed Nesterov, ``adam``, ``dcasgd``)."""


@dataclass(frozen=True)
class KernelModule:
    """A module of numba kernels, and what a user knows its kernels as."""

    label: str
    """e.g. ``"the 2bit codec"``, ``"the sgd optimizer"``."""

    module: str
    """Import name of the module that defines the kernels."""


def codec_kernel_module(spec: Mapping[str, Any]) -> str | None:
    """The module of numba kernels of a compression spec's codec; None when it has none
    (``none``, or a codec whose package holds no ``numba_kernels`` module).

    Raises:
        CodecError: the spec names no registered codec, or is invalid.
    """
    from kvstore.codecs import codec_from_spec  # noqa: PLC0415  (the registry, on first use)

    package = type(codec_from_spec(dict(spec))).__module__
    while "." in package:
        name = f"{package}.{KERNEL_MODULE}"
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # ``package`` is a module, not a package
            found = None
        if found is not None:
            return name
        package = package.rpartition(".")[0]
    return None


def job_kernel_modules(
    codecs: Iterable[Mapping[str, Any]], optimizer: str | None = None
) -> list[KernelModule]:
    """The kernel modules a job's processes on this host call: the push check's, each codec's
    (push and pull compression specs; ``none`` has none) and, with ``optimizer`` (a server
    optimizer's name), the servers' optimizer kernels. Empty with
    ``KVSTORE_CPU_KERNELS=numpy``, which compiles nothing."""
    from kvstore.config import cpu_kernels_from_env  # noqa: PLC0415

    if cpu_kernels_from_env() != "numba":
        return []
    found = [KernelModule("the pushes' NaN check", FINITE_CHECK)]
    for spec in codecs:
        module = codec_kernel_module(spec)
        if module is not None:
            found.append(KernelModule(f"the {spec['type']} codec", module))
    if optimizer is not None:
        found.append(KernelModule(f"the {optimizer} optimizer", OPTIMIZERS))
    unique: dict[str, KernelModule] = {}
    for kernels in found:  # two codecs of one family share a module: named by the first
        unique.setdefault(kernels.module, kernels)
    return list(unique.values())


def _dispatchers(module: ModuleType) -> list[Any]:
    """The module's own numba functions that cache their compiled code on disk."""
    return [
        value
        for value in vars(module).values()
        if getattr(getattr(value, "py_func", None), "__module__", None) == module.__name__
        and hasattr(getattr(value, "_cache", None), "cache_path")
    ]


def _cached_here(dispatcher: Any) -> bool:
    """Whether numba's cache holds code of ``dispatcher`` compiled for this machine (this CPU,
    this numba, this source file): its index maps (signature, the target's magic tuple, code
    hashes) to data files, and is empty when the file's stamp or numba's version differ."""
    index = dispatcher._cache._cache_file._load_index()
    machine = dispatcher.targetctx.codegen().magic_tuple()
    return any(key[1] == machine for key in index)


def uncompiled(modules: Iterable[KernelModule]) -> tuple[list[KernelModule], list[str]]:
    """The modules none of whose kernels numba's cache holds for this machine (a first run
    compiles them), and the folders their cache files will be written to.

    A module is cold when not one of its kernels was compiled here before: kernels that only
    other codecs of its family call may never be, so "every kernel cached" would call it cold
    for ever. Where numba's cache cannot be read as expected the module counts as compiled.
    """
    cold: list[KernelModule] = []
    folders: list[str] = []
    for kernels in modules:
        try:
            dispatchers = _dispatchers(importlib.import_module(kernels.module))
            if dispatchers and not any(_cached_here(d) for d in dispatchers):
                cold.append(kernels)
                folders.extend(str(d._cache.cache_path) for d in dispatchers)
        except (ImportError, AttributeError, TypeError, IndexError, OSError, ValueError):
            continue  # not a numba module as expected: say nothing about it
    return cold, sorted(set(folders))


def _where(folders: list[str]) -> str:
    """Where the cache files go, in a few words."""
    root = os.path.commonpath(folders)
    if all(os.path.basename(folder) == "__pycache__" for folder in folders):
        return f"the __pycache__ folders under {root}" if len(folders) > 1 else root
    return root


def _join(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} and {labels[-1]}"


def compile_notice(codecs: Iterable[Mapping[str, Any]], optimizer: str | None = None) -> str | None:
    """One line saying that this run compiles the kernels of :func:`job_kernel_modules`
    (``codecs``, ``optimizer``) that numba's cache does not hold yet, and where it keeps them;
    None when it holds code of every one (or compiles nothing)."""
    cold, folders = uncompiled(job_kernel_modules(codecs, optimizer))
    if not cold:
        return None
    return (
        f"compiling the numba kernels of {_join([k.label for k in cold])} for this machine, "
        f"once: the first steps take a few seconds longer, and later runs load them from "
        f"{_where(folders)}"
    )
