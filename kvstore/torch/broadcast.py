"""Rank 0's parameters and buffers on every worker, and buffer synchronization.

``broadcast_parameters(model, kv)`` makes every worker's parameters and buffers bit-identical to
rank 0's, so a job whose workers seeded their models differently (or not at all) still starts
from one model. It goes through ``kv.init``, which is collective and keeps rank 0's value: every
worker declares the key (shape, dtype), only rank 0's value is sent, and each worker's ``init``
returns once the servers hold it, so the pull that follows returns rank 0's value whatever the
other workers' tensors held. Rank 0 pulls too, and gets its own tensors back unchanged (a
pull is collective on a host whose workers aggregate there). ``init`` sends values as
they are (no codec encodes them, and NaN or infinities pass), and the keys are made without
compression, so every dtype travels exactly: float32/64/16 and int32/64 as they are,
bfloat16 through float32, bool and 8/16-bit integers through int32.

Each such call makes fresh keys (a store keeps a key for good, and a second ``init`` of a key
is refused): the servers keep one copy of the tensors per call. That is nothing for the usual
once-per-job broadcast; for buffers synchronized often, prefer ``mode="average"``, whose keys
are made once and reused.

``synchronize_buffers(model, kv, mode=...)`` evens out the buffers that each worker updates on
its own (BatchNorm's running statistics):

- ``"rank0"``: rank 0's buffers everywhere (as ``broadcast_parameters``, for buffers only);
- ``"average"``: floating-point buffers become their mean over workers (a round of pushes and a
  pull, through keys made once per store); integer and bool buffers (``num_batches_tracked``,
  the same on every worker that ran the same steps) take rank 0's value. It needs a
  ``dist_sync`` store without a server optimizer (which would update these keys too), and
  finite values (a push refuses NaN and infinities).

Every worker must make the same calls in the same order (they are collective), with tensors of
the same names, shapes and dtypes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.errors import UsageError

EXACT = {"type": "none"}
"""The compression of these keys: values must arrive as they were sent."""

DEFAULT_PREFIX = "kvt.state/"

# How each dtype travels: the store carries float16/32/64 and int32/64.
_CARRIERS: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.float32,
    torch.float64: torch.float64,
    torch.float16: torch.float16,
    torch.int32: torch.int32,
    torch.int64: torch.int64,
    torch.bfloat16: torch.float32,
    torch.bool: torch.int32,
    torch.uint8: torch.int32,
    torch.int8: torch.int32,
    torch.int16: torch.int32,
}

NamedTensors = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""A module (its parameters and buffers), a mapping such as a state dict, or (name, tensor)
pairs."""


@dataclass
class _StoreRecord:
    """What this module made in one store: rank-0 calls so far, average keys made."""

    broadcasts: int = 0
    average_keys: set[str] = field(default_factory=set)


_RECORDS: weakref.WeakKeyDictionary[Any, _StoreRecord] = weakref.WeakKeyDictionary()


def _record(kv: Any) -> _StoreRecord:
    record = _RECORDS.get(kv)
    if record is None:
        record = _RECORDS[kv] = _StoreRecord()
    return record


def _named(tensors: NamedTensors, *, buffers_only: bool = False) -> list[tuple[str, torch.Tensor]]:
    if isinstance(tensors, torch.nn.Module):
        buffers = list(tensors.named_buffers())
        return buffers if buffers_only else [*tensors.named_parameters(), *buffers]
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    named = []
    for item in items:
        if not (
            isinstance(item, tuple | list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise TypeError(
                f"expected a module, a mapping of names to tensors or (name, tensor) pairs; "
                f"got an item of type {type(item).__name__}"
            )
        named.append((item[0], item[1]))
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("two tensors have the same name; the names make the keys")
    return named


def _carrier(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the host in the dtype it travels in (a copy: the caller's tensor is only
    written once the pulled value is complete)."""
    carrier = _CARRIERS.get(tensor.dtype)
    if carrier is None:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in _CARRIERS))
        raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}; supported: {supported}")
    if tensor.layout != torch.strided:
        raise TypeError(f"tensor {name!r} is {tensor.layout}; only dense tensors are supported")
    return tensor.detach().to(device="cpu", dtype=carrier, copy=True).contiguous()


def _write_back(tensor: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.copy_(value.to(dtype=tensor.dtype))


def _share_from_rank0(kv: Any, named: list[tuple[str, torch.Tensor]], prefix: str) -> None:
    """Every tensor of ``named`` becomes rank 0's (fresh keys of this call: see the module
    docstring)."""
    if not named:
        return
    record = _record(kv)
    call = record.broadcasts
    record.broadcasts += 1
    keys = [f"{prefix}{call}/{name}" for name, _ in named]
    values = [_carrier(name, tensor) for name, tensor in named]
    kv.init(keys, values, compression=EXACT)
    # rank 0 pulls its own values back too (unchanged: they travel exactly), as every worker
    # of a host whose workers aggregate there must make the same calls
    kv.pull(keys, out=values)
    for (_, tensor), value in zip(named, values, strict=True):
        _write_back(tensor, value)


def _average(kv: Any, named: list[tuple[str, torch.Tensor]], prefix: str) -> None:
    """Floating-point tensors become their mean over workers, the others rank 0's."""
    if not named:
        return
    if kv.type != "local" and kv.type != "dist_sync":
        raise UsageError(f"mode='average' needs a dist_sync store, not {kv.type}")
    if kv.optimizer is not None:
        raise UsageError(
            f"mode='average' pushes the buffers, and the servers run {kv.optimizer!r}, which "
            f"would update them; use mode='rank0' with a server optimizer"
        )
    record = _record(kv)
    keys = [f"{prefix}avg/{name}" for name, _ in named]
    values = [_carrier(name, tensor) for name, tensor in named]
    fresh = [(k, v) for k, v in zip(keys, values, strict=True) if k not in record.average_keys]
    if fresh:
        kv.init([k for k, _ in fresh], [torch.zeros_like(v) for _, v in fresh], compression=EXACT)
        record.average_keys.update(k for k, _ in fresh)
    averaged = [value.is_floating_point() for value in values]
    pushed = [
        value if mean or kv.rank == 0 else torch.zeros_like(value)
        for value, mean in zip(values, averaged, strict=True)
    ]
    kv.push(keys, pushed)
    kv.pull(keys, out=values)
    for (_, tensor), value, mean in zip(named, values, averaged, strict=True):
        if mean and kv.num_workers > 1:
            value.div_(kv.num_workers)
        _write_back(tensor, value)


def broadcast_parameters(tensors: NamedTensors, kv: Any, *, prefix: str = DEFAULT_PREFIX) -> None:
    """Make every worker's parameters and buffers equal to rank 0's (collective).

    Args:
        tensors: a module (its parameters and buffers), a state-dict-like mapping, or
            (name, tensor) pairs; written in place.
        kv: the store.
        prefix: prepended to the names to make keys.

    Raises:
        TypeError: a tensor of a dtype the store cannot carry (complex, float8, ...).
        ValueMismatchError: the workers' tensors differ in shape or dtype (from the store).
    """
    _share_from_rank0(kv, _named(tensors), prefix)


def synchronize_buffers(
    module: NamedTensors, kv: Any, *, mode: str = "average", prefix: str = DEFAULT_PREFIX
) -> None:
    """Synchronize buffers across workers (collective): ``"average"`` or ``"rank0"``, as the
    module docstring says.

    Args:
        module: a module (its buffers), or named tensors as for :func:`broadcast_parameters`.
        kv: the store.
        mode: ``"average"`` (floating-point buffers) or ``"rank0"``.
        prefix: prepended to the names to make keys.

    Raises:
        ValueError: an unknown mode.
        UsageError: ``"average"`` with a server optimizer or outside ``dist_sync``.
    """
    named = _named(module, buffers_only=True)
    if mode == "rank0":
        _share_from_rank0(kv, named, prefix)
    elif mode == "average":
        _average(kv, named, prefix)
    else:
        raise ValueError(f"unknown mode {mode!r}; use 'average' or 'rank0'")


__all__ = ["NamedTensors", "broadcast_parameters", "synchronize_buffers"]
