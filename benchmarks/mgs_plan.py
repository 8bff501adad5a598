"""Bucket plans for ResNet-50's 161 gradients under the MGS cost model (``kvstore.torch.mgs``).

Prints one JSON line per (link, pull, plan): the keys a step pushes, the chunks (requests) the
client sends for them, and the iteration's back-propagation-plus-communication time that
:func:`kvstore.torch.mgs.simulate` predicts. The plans: one key per tensor (``none``), fixed
buckets of 4 MiB and 25 MiB (closed once full, like DDP's), the paper's greedy rule alone
(``mgs-greedy``) and the planner (``mgs``: the greedy plan unless no merging or a single
bucket is predicted faster).

The cost model, stated (the constants are flags):

* **Backward times**: ``--backward-ms`` (60 ms: ResNet-50 at batch 32 on a V100-class GPU, about
  2/3 of its forward+backward) split over the tensors in proportion to their elements.
* **Sparsification**: ``t_s(n) = a_s + b_s n``, fitted by least squares on this machine from
  the median time of ``kvstore``'s ``topk`` encode (numba, sampled selection, ratio
  ``--ratio``) of keys of a few sizes: the key encoder's ``begin`` and the chunk's payload.
* **Communication**: ``t_c = alpha + beta * bytes`` per key, one key at a time, on the worker's
  link at 1 Gbit/s and 10 Gbit/s (``beta = 8 / rate``). ``alpha`` is the CPU a chunk's
  push-and-pull costs on loopback (0.25 ms on the worker plus 0.17 ms on the server, as
  ``docs/performance.md``, cost of a chunk, and ``kvstore/topology.py`` record) plus a round
  trip of 0.1 ms (1 Gbit/s) or 0.05 ms (10 Gbit/s). Bytes per element: a sparse pull of the
  union of the ``--workers`` workers' pairs (``8 * ratio * workers``, the paper's all-gather
  model, as top-k pulls send) or a dense float32 pull (4); the
  push (``8 * ratio``) travels the other direction, concurrently.

    python -m benchmarks.mgs_plan --preset smoke
    python -m benchmarks.mgs_plan --preset full
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import numpy as np

from benchmarks.common import RESNET50_SHAPES, emit, machine, median_seconds
from kvstore.config import DEFAULT_BIGARRAY_BOUND, DEFAULT_PARTITION_BYTES
from kvstore.topology import partition_elems_for, plan_chunks
from kvstore.torch.mgs import (
    CommCost,
    Layer,
    SparsifyCost,
    fixed_buckets,
    greedy_merge,
    no_buckets,
    plan_buckets,
    timeline,
)

PRESETS = {
    "smoke": {"sizes": [1 << 10, 1 << 14, 1 << 18], "repeats": 3},
    "full": {"sizes": [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22],
             "repeats": 15},
}  # fmt: skip

CHUNK_CPU_SECONDS = 0.25e-3 + 0.17e-3
"""CPU per chunk of a push and pull, worker plus server, on loopback (``docs/performance.md``,
cost of a chunk)."""

LINKS = {"1 Gbit/s": (1e9, 0.1e-3), "10 Gbit/s": (1e10, 0.05e-3)}
"""Link name -> (bits per second, round-trip seconds)."""

FIXED_BUCKETS = {"fixed 4 MiB": 4 << 20, "fixed 25 MiB": 25 << 20}


def resnet50_layers(backward_seconds: float) -> list[Layer]:
    """ResNet-50's tensors in backward order, ``backward_seconds`` split by elements."""
    tensors = json.loads(RESNET50_SHAPES.read_text())["tensors"]
    numels = [math.prod(t["shape"]) for t in reversed(tensors)]
    total = sum(numels)
    return [Layer(n, backward_seconds * n / total) for n in numels]


def time_topk_encode(sizes: list[int], ratio: float, repeats: int) -> list[tuple[int, float]]:
    """Median seconds of one ``topk`` push's encode of a key of each size (numba kernels)."""
    from kvstore.codecs import codec_from_spec

    codec = codec_from_spec({"type": "topk", "ratio": ratio})
    rng = np.random.default_rng(0)
    samples = []
    for n in sizes:
        encoder = codec.make_key_encoder("mgs", n, "float32", [(0, n)])
        grads = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        pushes = iter(range(1 << 62))

        def encode(encoder: Any = encoder, grads: Any = grads, pushes: Any = pushes) -> None:
            encoder.begin(grads[next(pushes) % 2], finite=True)  # the client checked them
            encoder.chunks[0].encode(None)

        samples.append((n, median_seconds(encode, repeats, warmup=2)))
    return samples


def count_chunks(layers: list[Layer], groups: list[list[int]], servers: int, ratio: float) -> int:
    """Chunks (one push-and-pull request each) the client makes of these buckets' keys."""
    partition = partition_elems_for(DEFAULT_PARTITION_BYTES, 4)
    total = 0
    for j, group in enumerate(groups):
        numel = sum(layers[i].numel for i in group)
        chunks = plan_chunks(
            f"bucket{j}",
            numel,
            servers,
            bigarray_bound=DEFAULT_BIGARRAY_BOUND,
            partition_elems=partition,
            wire_fraction=min(1.0, 2 * ratio),
        )
        total += len(chunks)
    return total


def compare_plans(
    layers: list[Layer],
    comm: CommCost,
    sparsify: SparsifyCost,
    servers: int = 1,
    ratio: float = 0.001,
) -> list[dict[str, Any]]:
    """One row per plan: its keys, chunks and predicted times (milliseconds)."""
    plans = {"none": no_buckets(layers)}
    for name, cap in FIXED_BUCKETS.items():
        plans[name] = fixed_buckets(layers, cap)
    plans["mgs-greedy"] = greedy_merge(layers, comm, sparsify)
    plans["mgs"] = plan_buckets(layers, comm, sparsify)
    rows = []
    base = timeline(layers, plans["none"], comm, sparsify).finish
    for name, groups in plans.items():
        t = timeline(layers, groups, comm, sparsify)
        rows.append({
            "plan": name,
            "keys": len(groups),
            "chunks": count_chunks(layers, groups, servers, ratio),
            "simulated_ms": round(t.finish * 1e3, 3),
            "exposed_comm_ms": round(t.exposed_comm * 1e3, 3),
            "speedup_vs_none": round(base / t.finish, 3),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--ratio", type=float, default=0.001, help="top-k density")
    parser.add_argument("--workers", type=int, default=8, help="workers whose pairs are pulled")
    parser.add_argument("--servers", type=int, default=1, help="servers (for the chunk count)")
    parser.add_argument("--backward-ms", type=float, default=60.0, help="backward pass time")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    started = time.time()

    samples = time_topk_encode(preset["sizes"], args.ratio, preset["repeats"])
    sparsify = SparsifyCost.fit(samples)
    emit({"bench": "mgs_plan", "ratio": args.ratio,
          "sparsify_fit": {"a_s": sparsify.a_s, "b_s": sparsify.b_s},
          "topk_encode_seconds": [[n, round(s, 7)] for n, s in samples]})  # fmt: skip

    layers = resnet50_layers(args.backward_ms / 1e3)
    pulls = {"sparse": 8 * args.ratio * args.workers, "dense": 4.0}
    for link, (rate, rtt) in LINKS.items():
        for pull, bytes_per_element in pulls.items():
            comm = CommCost.for_link(rate, CHUNK_CPU_SECONDS + rtt, bytes_per_element)
            for row in compare_plans(layers, comm, sparsify, args.servers, args.ratio):
                emit({"bench": "mgs_plan", "model": "resnet50", "link": link, "pull": pull,
                      "alpha_ms": round(comm.alpha * 1e3, 3),
                      "bytes_per_element": bytes_per_element, "workers": args.workers,
                      "backward_ms": args.backward_ms, **row})  # fmt: skip
    emit({"bench": "mgs_plan", "preset": args.preset, "machine": machine(),
          "wall_seconds": round(time.time() - started, 1)})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
