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
from kvstore.codecs.registry import built_in_codecs, codec_class, installed_codecs


def parity_codecs() -> list[str]:
    """The codecs the check runs: the built-in ones and those of installed distributions (codecs
    that a program or a test registers at run time are its own business)."""
    return sorted(set(built_in_codecs()) | set(installed_codecs()))


def parity_specs() -> list[dict[str, Any]]:
    """A spec for each of every checked codec's :attr:`~kvstore.codecs.Codec.example_params`."""
    return [
        {"type": name, **params}
        for name in parity_codecs()
        for params in codec_class(name).example_params
    ]


SPECS = parity_specs()
"""Found in the registry: a new codec is checked once it is registered, with its example
parameter sets (its defaults when it declares none)."""

LENGTHS_AND_BOUNDS = [
    (1, [(0, 1)]),
    (17, [(0, 17)]),
    (4099, [(0, 1000), (1000, 4099)]),
    (65_537, [(0, 16_384), (16_384, 32_768), (32_768, 65_537)]),
    (3072, [(0, 1536), (1536, 3072)]),
]

SHAPES = {3072: (48, 64)}
"""The key's shape for a length (1-D otherwise): a matrix, cut into chunks of whole rows, for
codecs that view keys as matrices (PowerSGD)."""

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
        codec = codec_from_spec(spec)
        shape = SHAPES.get(numel, (numel,))
        encoder = codec.make_key_encoder("w", numel, "float32", bounds, device, shape=shape)
        servers = [  # one-worker servers for the later rounds of multi-round codecs
            codec.make_chunk_aggregator(stop - start, "float32", shape=shape, start=start)
            for start, stop in (bounds if codec.round_trips > 1 else [])
        ]
        results = []
        for grad in grads:
            values = to_device(grad)
            encoder.begin(values, finite=True)
            pushes = []
            for index, (start, stop) in enumerate(bounds):
                chunk = encoder.chunks[index]
                frames = [host_bytes(f) for f in chunk.encode(values[start:stop])]
                if chunk.round_trips > 1:
                    frames += play_rounds(chunk, servers[index], frames)
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


def play_rounds(encoder: Any, aggregator: Any, frames: list[bytes]) -> list[bytes]:
    """The rest of a multi-round push whose first round sent ``frames``, against
    ``aggregator`` as a one-worker server; returns the later rounds' payload bytes."""
    sent: list[bytes] = []
    for _ in range(encoder.round_trips - 1):
        aggregator.add(frames, True)
        reply = [host_bytes(f) for f in aggregator.finish()]
        frames = [host_bytes(f) for f in encoder.next_round(reply)]
        sent += frames
    aggregator.add(frames, True)
    assert aggregator.finish() is None
    encoder.end_step([host_bytes(f) for f in aggregator.reply_frames() or []])
    return sent


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
