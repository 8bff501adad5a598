"""A worker's side of checkpoints: its codec state as a checkpoint part, and back.

The client (:meth:`kvstore.KVStore.save_checkpoint` / ``load_checkpoint``) runs the collective
protocol; the format is :mod:`kvstore.checkpoint`. A worker's part holds, per key chunk, its
encoder's state (:meth:`kvstore.codecs.Encoder.state`: the 2-bit residual; CuPy state copied to
the host) and how many pushes of the chunk it sent (for information: that count is matched by
the servers' own and neither is restored). A chunk whose encoder was never made (no push yet)
has no state: it starts from zero, as it would have.

On load the state is not written into encoders at once (their device is known only at the
next push): each chunk's state waits in the key's ``restored`` list until the chunk's encoder
is made, which then loads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvstore import checkpoint
from kvstore.errors import CheckpointError


def _key_id(key: Any) -> tuple[str, Any]:
    return (type(key).__name__, key)


def codec_state(keys: Iterable[Any], rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and metadata of worker ``rank``'s part, from its ``_KeyState`` objects."""
    arrays: dict[str, np.ndarray] = {}
    described = []
    for k, state in enumerate(keys):
        chunks = []
        for chunk in state.chunks:
            encoder = state.encoders[chunk.index] if state.encoders else None
            if encoder is not None:
                saved = encoder.state()
            else:  # not made since init or the last load: the state that waits for it, if any
                saved = state.restored[chunk.index] if state.restored else None
            chunks.append(
                {
                    "index": chunk.index,
                    "start": chunk.start,
                    "numel": chunk.numel,
                    "pushes": state.pushes_sent[chunk.index] if state.pushes_sent else 0,
                    "state": None if saved is None else sorted(saved),
                }
            )
            for name, array in (saved or {}).items():
                arrays[f"{k}.{chunk.index}.{name}"] = array
        described.append({"key": state.key, "chunks": chunks})
    return arrays, {"kind": "worker", "rank": rank, "keys": described}


def plan_restore(
    keys: Mapping[Any, Any], arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], where: str
) -> dict[Any, list[dict[str, np.ndarray] | None]]:
    """Per key, per chunk of this job's plan, the encoder state to load (None: start from
    zero), cut from the saved chunks (see :func:`kvstore.checkpoint.cut`).

    Raises:
        CheckpointError: the part does not cover this worker's keys.
    """
    if meta.get("kind") != "worker":
        raise CheckpointError(f"{where} is not a worker's part")
    saved: dict[tuple[str, Any], tuple[int, dict]] = {}
    try:
        for k, described in enumerate(meta["keys"]):
            saved[_key_id(described["key"])] = (k, described)
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: malformed key table ({exc!r})") from exc
    plan: dict[Any, list[dict[str, np.ndarray] | None]] = {}
    for key, state in keys.items():
        entry = saved.get(_key_id(key))
        if entry is None:
            raise CheckpointError(f"{where} has no state for key {key!r}")
        k, described = entry
        pieces = []
        any_state = False
        try:
            for c in described["chunks"]:
                names = c["state"]
                if names is None:
                    own = None
                else:
                    own = {name: arrays[f"{k}.{c['index']}.{name}"] for name in names}
                    any_state = True
                pieces.append((int(c["start"]), int(c["numel"]), own))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: malformed chunk table of key {key!r}") from exc
        if not any_state:
            plan[key] = [None] * len(state.chunks)
            continue
        # A chunk never pushed has the state a fresh encoder has (made on the host).
        full = [
            (start, numel, own if own is not None else _fresh(state.codec, numel, state.dtype))
            for start, numel, own in pieces
        ]
        plan[key] = [
            checkpoint.cut(full, chunk.start, chunk.stop, f"key {key!r} chunk {chunk.index}")
            for chunk in state.chunks
        ]
    return plan


def _fresh(codec: Any, numel: int, dtype: str) -> dict[str, np.ndarray]:
    return codec.make_encoder(numel, dtype, None).state()


__all__ = ["codec_state", "plan_restore"]
