"""PyTorch integration: data-parallel training through the store.

::

    import kvstore, kvstore.torch as kvt

    kv = kvstore.create("dist_sync")
    kvt.broadcast_parameters(model, kv)  # rank 0's parameters and buffers everywhere
    opt = kvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(), kv=kv,
                                   compression={"type": "dgc", "ratio": 0.001})
    loss.backward(); opt.step(); opt.zero_grad()  # pushes start inside backward, step waits

- :class:`DistributedOptimizer` (:mod:`.optimizer`) wraps any torch optimizer; bucket plans
  are in :mod:`.buckets`.
- :func:`broadcast_parameters` and :func:`synchronize_buffers` (:mod:`.broadcast`).
- :func:`ddp_comm_hook` and :class:`DDPHookState` (:mod:`.ddp`) for DDP users.

This package imports torch; ``import kvstore`` alone never does. The user's guide is
docs/torch.md.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (the clear error below, not a deep one later)
except ImportError as exc:
    raise ImportError(f"kvstore.torch needs PyTorch ({exc}): pip install 'pskv[torch]'") from exc

from kvstore.torch.broadcast import broadcast_parameters, synchronize_buffers
from kvstore.torch.buckets import BucketPlanSpec, Planner
from kvstore.torch.ddp import DDPHookState, ddp_comm_hook
from kvstore.torch.diloco import DiLoCo
from kvstore.torch.optimizer import DistributedOptimizer, ServerOptimizerSpec

__all__ = [
    "BucketPlanSpec",
    "DDPHookState",
    "DiLoCo",
    "DistributedOptimizer",
    "Planner",
    "ServerOptimizerSpec",
    "broadcast_parameters",
    "ddp_comm_hook",
    "synchronize_buffers",
]
