"""Bucket plans: which parameters share one key (and one push per step).

A plan groups the synchronized parameters, given in *backward order* (the order their gradients
are expected to become ready: the reverse of the registration order, as DDP assumes before its
first step), into buckets: lists of indices into that order. Each bucket is one key and one push
per step, sent as soon as the last of its gradients is ready, so merging the many small tensors
of a model saves a message per tensor per step.

Plans, as :class:`~kvstore.torch.DistributedOptimizer` takes them (``bucket_plan=``):

- ``"none"``: one bucket per parameter;
- ``{"bucket_bytes": B}``: consecutive parameters merged while the bucket stays within ``B``
  bytes (a parameter larger than ``B`` gets a bucket of its own); a change of dtype or device
  also starts a new bucket;
- ``"mgs"``: the merged-gradient-sparsification planner, ``kvstore.torch.mgs.plan_parameters``
  (imported when asked for, and called as a planner: ``plan_parameters(params)``, with its
  stated cost model; ``kvstore.torch.mgs.planner(costs)`` plans with measured ones);
- any callable ``plan(params_in_backward_order) -> list[list[int]]``, the *planner protocol*:
  it receives the parameters (torch tensors) in backward order and returns buckets of indices
  into that list. Every index appears in exactly one bucket, and the parameters of a bucket
  share their dtype and device (a bucket is one flat buffer).

The plan must be the same on every worker (it decides the keys): planners must be deterministic
functions of the parameters' shapes, dtypes and order.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

Planner = Callable[[Sequence[torch.Tensor]], Sequence[Sequence[int]]]
"""A bucket planner: the parameters in backward order -> buckets of indices into them."""

BucketPlanSpec = str | Mapping[str, Any] | Planner
"""What ``bucket_plan=`` accepts: ``"none"``, ``"mgs"``, ``{"bucket_bytes": B}`` or a planner."""

MGS_MODULE = "kvstore.torch.mgs"


def one_per_parameter(params: Sequence[torch.Tensor]) -> list[list[int]]:
    """The ``"none"`` plan: every parameter is a bucket of its own."""
    return [[index] for index in range(len(params))]


def fixed_size(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Consecutive parameters merged into buckets of at most ``bucket_bytes`` bytes.

    A parameter larger than ``bucket_bytes`` is a bucket of its own; a change of dtype or
    device closes the current bucket (its parameters must fit one flat buffer).
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, param in enumerate(params):
        nbytes = param.numel() * param.element_size()
        if current and (size + nbytes > bucket_bytes or not _compatible(params[current[0]], param)):
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _compatible(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device


def mgs_planner() -> Planner:
    """``kvstore.torch.mgs.plan_parameters``, imported now.

    Raises:
        ImportError: the module or the function is missing, saying what ``"mgs"`` needs.
        TypeError: the function does not take the planner protocol's one argument.
    """
    try:
        module = importlib.import_module(MGS_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != MGS_MODULE:  # the module is there, but something it imports is not
            raise
        raise ImportError(
            f"bucket_plan='mgs' needs the merged-gradient-sparsification planner "
            f"{MGS_MODULE}.plan_parameters, which this installation of pskv lacks; use "
            f"bucket_plan='none', {{'bucket_bytes': B}} or a planner function instead"
        ) from exc
    planner = getattr(module, "plan_parameters", None)
    if not callable(planner):
        raise ImportError(f"{MGS_MODULE} has no function plan_parameters (bucket_plan='mgs')")
    try:
        inspect.signature(planner).bind([])
    except TypeError:
        raise TypeError(
            f"{MGS_MODULE}.plan_parameters{inspect.signature(planner)} does not follow the planner "
            f"protocol plan(params_in_backward_order) -> buckets that bucket_plan='mgs' calls; "
            f"pass a function that calls it with its cost model as bucket_plan instead"
        ) from None
    except ValueError:  # no signature to read (a builtin): trust it
        pass
    return planner


def resolve(spec: BucketPlanSpec) -> Planner:
    """The planner that ``bucket_plan=spec`` names.

    Raises:
        ValueError: an unknown plan name or malformed ``{"bucket_bytes": B}``.
        ImportError: ``"mgs"`` without its planner module.
    """
    if isinstance(spec, str):
        if spec == "none":
            return one_per_parameter
        if spec == "mgs":
            return mgs_planner()
        raise ValueError(
            f"unknown bucket_plan {spec!r}; use 'none', 'mgs', {{'bucket_bytes': B}} or a "
            f"planner function"
        )
    if isinstance(spec, Mapping):
        if set(spec) != {"bucket_bytes"}:
            raise ValueError(
                f"a bucket_plan dict takes exactly one entry, 'bucket_bytes'; got {sorted(spec)}"
            )
        bucket_bytes = spec["bucket_bytes"]
        fixed_size([], bucket_bytes)  # checks the value now, not at the first plan

        def plan(params: Sequence[torch.Tensor]) -> list[list[int]]:
            return fixed_size(params, bucket_bytes)

        return plan
    if callable(spec):
        return spec
    raise TypeError(
        f"bucket_plan must be 'none', 'mgs', {{'bucket_bytes': B}} or a planner function, "
        f"got {type(spec).__name__}"
    )


def make_plan(
    spec: BucketPlanSpec, params: Sequence[torch.Tensor], names: Sequence[str]
) -> list[list[int]]:
    """Run the planner of ``spec`` on ``params`` (backward order) and check what it returned.

    Raises:
        ValueError: the plan is not a partition of the indices into non-empty buckets, or a
            bucket mixes dtypes or devices (naming the parameters).
    """
    raw = resolve(spec)(list(params))
    try:
        plan = [[_index(i) for i in bucket] for bucket in raw]
    except TypeError as exc:
        raise ValueError(f"a bucket plan must be a list of lists of indices: {exc}") from exc
    seen: set[int] = set()
    for bucket in plan:
        if not bucket:
            raise ValueError("the bucket plan has an empty bucket")
        for index in bucket:
            if not 0 <= index < len(params):
                raise ValueError(
                    f"the bucket plan names parameter index {index}, but there are "
                    f"{len(params)} parameters"
                )
            if index in seen:
                raise ValueError(f"the bucket plan puts parameter {names[index]!r} twice")
            seen.add(index)
        first = params[bucket[0]]
        for index in bucket[1:]:
            if not _compatible(first, params[index]):
                raise ValueError(
                    f"the bucket plan merges {names[bucket[0]]!r} ({first.dtype}, "
                    f"{first.device}) with {names[index]!r} ({params[index].dtype}, "
                    f"{params[index].device}): a bucket's parameters share dtype and device"
                )
    missing = [names[i] for i in range(len(params)) if i not in seen]
    if missing:
        raise ValueError(f"the bucket plan leaves out parameters {missing[:5]}")
    return plan


def _index(value: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{value!r} is not an index")
    return value.__index__()


__all__ = [
    "BucketPlanSpec",
    "Planner",
    "fixed_size",
    "make_plan",
    "mgs_planner",
    "one_per_parameter",
    "resolve",
]
