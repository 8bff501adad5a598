"""The registry-wide parity check shared by tests/unit (numpy vs numba) and tests/gpu (CuPy).

Every registered codec is run through whole-key encoders, over several pushes of random
gradients into a key split in chunks, by two implementations; their payload bytes and their
per-chunk state (``Encoder.state()``) must be identical after every push.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.codecs import codec_from_spec

SPECS: dict[str, dict[str, Any]] = {
    "none": {"type": "none"},
    "2bit": {"type": "2bit", "threshold": 0.5},
    "threshold": {"type": "threshold", "threshold": 1.5},
    "topk": {"type": "topk", "ratio": 0.01},
    "randomk": {"type": "randomk", "ratio": 0.02, "seed": 3},
    "dgc": {"type": "dgc", "ratio": 0.01, "warmup_steps": 4},
    "fp16": {"type": "fp16"},
    "bf16": {"type": "bf16", "error_feedback": True},
    "1bit": {"type": "1bit"},
    "efsign": {"type": "efsign"},
    "terngrad": {"type": "terngrad", "seed": 7},
    "qsgd": {"type": "qsgd", "seed": 7},
}
"""A spec of every registered codec (a new codec adds its line; a test checks they match)."""

EXTRA_SPECS = [
    {"type": "2bit", "threshold": 0.25, "residual_clip": 1},
    {"type": "topk", "ratio": 0.05, "sample": 0},
    {"type": "dgc", "ratio": 0.02, "nesterov": True, "clip_norm": 30.0},
    {"type": "fp16", "error_feedback": True},
    {"type": "bf16"},
    {"type": "terngrad", "clip": 0},
    {"type": "qsgd", "levels": 1, "bucket": 100},
    {"type": "qsgd", "levels": 127, "bucket": 5000, "seed": 2},
]
"""Variants worth their own run."""

LENGTHS_AND_BOUNDS = [
    (1, [(0, 1)]),
    (17, [(0, 17)]),
    (4099, [(0, 1000), (1000, 4099)]),
    (65_537, [(0, 16_384), (16_384, 32_768), (32_768, 65_537)]),
]

Encode = Callable[[Any, list[np.ndarray]], list[tuple[list[bytes], dict[str, np.ndarray]]]]


def host_bytes(frame: Any) -> bytes:
    return bytes(memoryview(getattr(frame, "buffer", frame)).cast("B"))


def run_pushes(
    spec: dict[str, Any],
    numel: int,
    bounds: list[tuple[int, int]],
    grads: list[np.ndarray],
    device: Any = None,
    kernels: str = "numba",
    to_device: Callable[[np.ndarray], Any] = lambda g: g,
) -> list[list[tuple[bytes, ...]]]:
    """Each push's per-chunk (payload bytes..., state bytes...) from one implementation."""
    previous = os.environ.get("KVSTORE_CPU_KERNELS")
    os.environ["KVSTORE_CPU_KERNELS"] = kernels
    try:
        encoder = codec_from_spec(spec).make_key_encoder("w", numel, "float32", bounds, device)
        results = []
        for grad in grads:
            values = to_device(grad)
            encoder.begin(values, finite=True)
            pushes = []
            for chunk, (start, stop) in zip(encoder.chunks, bounds, strict=True):
                frames = [host_bytes(f) for f in chunk.encode(values[start:stop])]
                state = chunk.state()
                pushes.append(
                    (*frames, *(np.ascontiguousarray(state[k]).tobytes() for k in sorted(state)))
                )
            results.append(pushes)
        return results
    finally:
        if previous is None:
            del os.environ["KVSTORE_CPU_KERNELS"]
        else:
            os.environ["KVSTORE_CPU_KERNELS"] = previous


def gradients(numel: int, steps: int, seed: int) -> list[np.ndarray]:
    """Random gradients with ties, zeros and a spike, so selections and residuals carry."""
    rng = np.random.default_rng(seed)
    grads = []
    for step in range(steps):
        g = rng.standard_normal(numel).astype(np.float32)
        if step % 3 == 1:
            g[rng.integers(0, numel, max(1, numel // 10))] = 0.75  # ties
        if step % 3 == 2:
            g[: numel // 2] = 0  # a zero half
        grads.append(g)
    return grads
