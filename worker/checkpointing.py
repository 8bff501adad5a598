"""A worker's side of checkpoints: its codec state as a checkpoint part, and back.

:mod:`kvstore.worker.checkpoint_protocol` runs the collective protocol
(:meth:`kvstore.KVStore.save_checkpoint` / ``load_checkpoint``); the format is
:mod:`kvstore.checkpoint`. A worker's part holds, per key chunk, its
encoder's state (:meth:`kvstore.codecs.Encoder.state`: the 2-bit residual; CuPy state copied to
the host) and how many pushes of the chunk it sent (for information: that count is matched by
the servers' own and neither is restored). A chunk whose encoder was never made (no push yet)
has no state: it starts from zero, as it would have.

On load the state is not written into encoders at once (their device is known only at the
next push): each chunk's state waits in the key's ``restored`` list until the chunk's encoder
is made, which then loads it.

The same state travels in memory too (:meth:`kvstore.KVStore.codec_state` /
``load_codec_state``, for the torch wrapper's ``state_dict``): :func:`codec_state_dict` and
:func:`plan_codec_state`, per worker and without the servers, for the chunk plan it was saved
with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvstore import checkpoint
from kvstore.errors import CheckpointError, CodecError


def _key_id(key: Any) -> tuple[str, Any]:
    return (type(key).__name__, key)


def codec_state(keys: Iterable[Any], rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and metadata of worker ``rank``'s part, from its ``KeyState`` objects: the
    chunks of :func:`codec_state_dict`, their arrays stored apart under ``key.chunk.name``."""
    arrays: dict[str, np.ndarray] = {}
    described = []
    for k, key in enumerate(codec_state_dict(keys, rank)["keys"]):
        chunks = []
        for chunk in key["chunks"]:
            saved = chunk["state"]
            chunks.append({**chunk, "state": None if saved is None else sorted(saved)})
            for name, array in (saved or {}).items():
                arrays[f"{k}.{chunk['index']}.{name}"] = array
        described.append({"key": key["key"], "chunks": chunks})
    return arrays, {"kind": "worker", "rank": rank, "keys": described}


def _chunk_state(state: Any, index: int) -> dict[str, np.ndarray] | None:
    """Chunk ``index``'s encoder state (host copies the caller owns), or None where no
    encoder was made."""
    encoder = state.encoders[index] if state.encoders else None
    if encoder is not None:
        return encoder.state()
    # Not made since init or the last load: the state that waits for it, if any.
    waiting = state.restored[index] if state.restored else None
    if waiting is None:
        return None
    return {name: np.array(array, copy=True) for name, array in waiting.items()}


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


# in memory: kv.codec_state / kv.load_codec_state -------------------------------------------------

STATE_FORMAT = "pskv-codec-state"
"""The ``format`` field of :func:`codec_state_dict`'s result."""

STATE_VERSION = 1
"""The version :func:`codec_state_dict` writes; :func:`plan_codec_state` reads up to it."""


def codec_state_dict(keys: Iterable[Any], rank: int) -> dict[str, Any]:
    """Worker ``rank``'s codec state of ``keys`` (``KeyState`` objects), as plain data::

        {"format": "pskv-codec-state", "version": 1, "rank": R,
         "keys": [{"key": K, "shape": [...], "dtype": "float32", "codec": {spec},
                   "chunks": [{"index": i, "start": s, "numel": n, "pushes": p,
                               "state": {name: numpy array} or None}, ...]}, ...]}

    Everything but the arrays is JSON-able. ``state`` is the chunk encoder's
    :meth:`~kvstore.codecs.Encoder.state` (host copies the caller owns), or the state a load
    left waiting for it; None where the key has no encoder (no push since init, or since a
    load of a state without one): the chunk starts from zero. ``pushes`` is for information.
    """
    described = []
    for state in keys:
        chunks = []
        for chunk in state.chunks:
            saved = _chunk_state(state, chunk.index)
            chunks.append(
                {
                    "index": chunk.index,
                    "start": chunk.start,
                    "numel": chunk.numel,
                    "pushes": state.pushes_sent[chunk.index] if state.pushes_sent else 0,
                    "state": saved,
                }
            )
        described.append(
            {
                "key": state.key,
                "shape": [int(d) for d in state.shape],
                "dtype": state.dtype,
                "codec": state.codec.spec(),
                "chunks": chunks,
            }
        )
    return {"format": STATE_FORMAT, "version": STATE_VERSION, "rank": rank, "keys": described}


def plan_codec_state(
    keys: Mapping[Any, Any], saved: Any, rank: int
) -> dict[Any, list[dict[str, np.ndarray]] | None]:
    """Check a :func:`codec_state_dict` result against this worker's keys (``KeyState`` by
    key) and return, per saved key, the per-chunk states to load (copies; None: the key had
    no encoder, so it starts from zero). Changes nothing.

    Raises:
        CheckpointError: not a codec state, a newer version, another worker's, a key that is
            not initialised here or twice in it, or one initialised with another shape, dtype,
            compression or chunk plan (naming the key and both sides).
        CodecError: a chunk's arrays are not what its encoder keeps (names, shapes, dtypes).
    """
    if not isinstance(saved, Mapping) or saved.get("format") != STATE_FORMAT:
        raise CheckpointError(
            f"expected a codec state of kv.codec_state (format {STATE_FORMAT!r}), got "
            f"{_what(saved)}"
        )
    version = saved.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"the codec state has a malformed version {version!r}")
    if version > STATE_VERSION:
        raise CheckpointError(
            f"the codec state is of version {version}, newer than this pskv reads "
            f"({STATE_VERSION}): upgrade pskv"
        )
    if saved.get("rank") != rank:
        raise CheckpointError(
            f"the codec state is worker {saved.get('rank')!r}'s, this is worker {rank}: "
            f"residuals and random streams are per worker, so every worker loads the state it "
            f"saved itself"
        )
    described = saved.get("keys")
    if not isinstance(described, list | tuple):
        raise CheckpointError(f"the codec state's keys are {_what(described)}, not a list")
    by_id = {_key_id(key): state for key, state in keys.items()}
    plan: dict[Any, list[dict[str, np.ndarray]] | None] = {}
    for entry in described:
        if not isinstance(entry, Mapping) or "key" not in entry:
            raise CheckpointError(f"the codec state has a malformed key entry: {_what(entry)}")
        state = by_id.get(_key_id(entry["key"]))
        if state is None:
            raise CheckpointError(
                f"the codec state has key {entry['key']!r}, which this store did not "
                f"initialise: kv.init every key before loading its codec state"
            )
        if state.key in plan:
            raise CheckpointError(f"the codec state has key {state.key!r} twice")
        _check_key(state, entry)
        plan[state.key] = _check_chunks(state, entry.get("chunks"), rank)
    return plan


def _what(value: Any) -> str:
    text = repr(value) if isinstance(value, str | int | float | type(None)) else ""
    return f"{type(value).__name__} {text}".strip()[:200]


def _check_key(state: Any, entry: Mapping[str, Any]) -> None:
    """The saved key's shape, dtype and compression must be this store's."""
    try:
        saved = (
            tuple(int(d) for d in entry["shape"]),
            str(entry["dtype"]),
            dict(entry["codec"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the codec state of key {state.key!r} is malformed ({exc!r})"
        ) from exc
    here = (tuple(state.shape), state.dtype, state.codec.spec())
    if saved != here:
        raise CheckpointError(
            f"key {state.key!r}: the codec state is of shape {saved[0]} {saved[1]}, "
            f"compression {saved[2]}; this store initialised it with shape {here[0]} "
            f"{here[1]}, compression {here[2]}"
        )


def _check_chunks(state: Any, chunks: Any, rank: int) -> list[dict[str, np.ndarray]] | None:
    """The chunks' states, checked by loading them into a throwaway host encoder of the key."""
    try:
        saved_plan = [(int(c["index"]), int(c["start"]), int(c["numel"])) for c in chunks]
        states = [c["state"] for c in chunks]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the chunk table of key {state.key!r} in the codec state is malformed ({exc!r})"
        ) from exc
    here = [(c.index, c.start, c.numel) for c in state.chunks]
    if saved_plan != here:
        raise CheckpointError(
            f"key {state.key!r} was saved in chunks (index, start, numel) {saved_plan[:8]}, "
            f"this store has {here[:8]}: the number of servers, KVSTORE_PARTITION_BYTES and "
            f"KVSTORE_BIGARRAY_BOUND must be the saving job's (kv.load_checkpoint re-cuts "
            f"chunks; a codec state does not)"
        )
    if all(s is None for s in states):
        return None
    copies: list[dict[str, np.ndarray]] = []
    for chunk, saved in zip(state.chunks, states, strict=True):
        if not isinstance(saved, Mapping):
            raise CheckpointError(
                f"key {state.key!r} chunk {chunk.index}: the codec state holds {_what(saved)} "
                f"where the other chunks hold an encoder state"
            )
        for name, array in saved.items():
            if not isinstance(array, np.ndarray):
                raise CodecError(
                    f"key {state.key!r} chunk {chunk.index}: state {name!r} is "
                    f"{type(array).__name__}, not a numpy array"
                )
        copies.append({str(name): np.array(array, copy=True) for name, array in saved.items()})
    # The encoders check names, shapes, dtypes and scalars (a push count >= 0) themselves.
    probe = state.new_key_encoder(None, rank)
    for chunk, encoder, saved in zip(state.chunks, probe.chunks, copies, strict=True):
        try:
            encoder.load_state(saved)
        except CodecError as exc:
            raise CodecError(f"key {state.key!r} chunk {chunk.index}: {exc}") from exc
    return copies


__all__ = [
    "STATE_FORMAT",
    "STATE_VERSION",
    "codec_state",
    "codec_state_dict",
    "plan_codec_state",
    "plan_restore",
]
