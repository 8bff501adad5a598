"""A server's side of checkpoints: what its shard holds, writing it, and reading it back.

The protocol (collective SAVE and LOAD requests, see :class:`kvstore.server.ShardServer`) and
the file format (:mod:`kvstore.checkpoint`) live elsewhere; this module turns a server's chunks
into a part and a part back into its chunks' state.

A shard holds, for every initialised chunk: its published value, its master copy (float16
keys), its optimizer state (SGD's momentum; Adam's mean, variance and step count) and how many
updates it had, and the state a codec's aggregator carries between rounds (the sketch codec's
momentum and error tables, which fit only the same chunk sizes). That is everything the next
round's arithmetic reads: other aggregators start every round from nothing, and round
bookkeeping (pushes in flight, pulls waiting) must be empty when a checkpoint is taken
(:func:`busy_reason`). Which pushes of which worker were applied
(``ChunkState.applied``) is the transport's bookkeeping, matched by the worker's own count of
pushes sent; neither is saved, and a load leaves both as they are.

Loading is two-phase so that it happens everywhere or nowhere: :func:`prepare_load` reads and
checks everything (the manifest, this server's part and its checksum; server 0 also the
checksums of the workers' parts) and stages the state without touching the chunks; the commit
(:meth:`StagedLoad.apply`) only copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore import checkpoint
from kvstore.codecs import accumulator_dtype
from kvstore.errors import CheckpointError, CodecError, OptimizerError
from kvstore.optimizer_spec import make_optimizer_spec
from kvstore.server.chunk import ChunkSpec, ChunkState, named_with
from kvstore.server.optimizers import Optimizer, make_optimizer


def busy_reason(chunks: Iterable[ChunkState]) -> str | None:
    """Why the shard cannot be saved or loaded now (a round in flight...), or None."""
    for chunk in chunks:
        problem = chunk.busy()
        if problem is not None:
            return problem
    return None


def optimizer_entry(optimizer: Optimizer | None) -> dict[str, Any] | None:
    """The optimizer as the manifest and the parts record it."""
    if optimizer is None:
        return None
    return {"name": optimizer.spec.name, "params": dict(optimizer.spec.params)}


def snapshot(
    chunks: Iterable[ChunkState], job: Mapping[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and metadata of a shard part (the live arrays: write them while the chunks'
    locks are held). ``job`` is recorded as it is (server rank, job size, mode, optimizer)."""
    arrays: dict[str, np.ndarray] = {}
    described = []
    for i, chunk in enumerate(c for c in chunks if c.initialized):
        state, meta = chunk.checkpoint_state()
        spec = chunk.spec
        arrays.update({f"{i}.{name}": array for name, array in state.items()})
        described.append({**spec_entry(spec), "arrays": sorted(state), **meta})
    return arrays, {"kind": "server", **job, "chunks": described}


def spec_entry(spec: ChunkSpec) -> dict[str, Any]:
    """A chunk's spec as a part's chunk table (and a replica's state) records it."""
    return {
        "key": spec.key,
        "chunk": spec.index,
        "start": spec.start,
        "numel": spec.numel,
        "dtype": spec.dtype,
        "shape": list(spec.shape),
        "codec": dict(spec.codec),
        "averaged": spec.averaged,
    }


@dataclass
class StagedLoad:
    """A load read and checked by phase 0, applied by phase 1 (the commit).

    Attributes:
        path: the checkpoint directory.
        restores: per chunk, its saved arrays, rebuilt optimizer state and metadata.
        optimizer: the optimizer to set on commit (the job had none; the checkpoint has one).
    """

    path: str
    restores: list[tuple[ChunkState, dict[str, np.ndarray], dict[str, Any] | None, dict]] = field(
        default_factory=list
    )
    optimizer: Optimizer | None = None

    def apply(self, spares: list[np.ndarray]) -> None:
        """Copy the staged state into the chunks (on an executor thread, the chunks' locks
        held); ``spares[i]`` receives chunk i's value, which the caller then publishes."""
        for (chunk, arrays, state, meta), out in zip(self.restores, spares, strict=True):
            chunk.restore(arrays, state, meta, out)


def _key_id(key: Any) -> tuple[str, Any]:
    return (type(key).__name__, key)


def prepare_load(
    path: str,
    chunks: list[ChunkState],
    optimizer: Optimizer | None,
    *,
    server_rank: int,
    num_servers: int,
    num_workers: int,
    mode: str | None,
) -> StagedLoad:
    """Phase 0 of a load (runs on an executor thread; reads files, changes nothing).

    Raises:
        CheckpointError: the checkpoint is incomplete, corrupted, of a newer format or of
            another job, or does not hold exactly this server's keys with the same specs.
    """
    manifest = checkpoint.read_manifest(path)
    checkpoint.check_job(
        manifest, mode=mode or manifest["mode"], num_workers=num_workers, num_servers=num_servers
    )
    name = checkpoint.server_file(server_rank)
    arrays, meta = checkpoint.read_part(path, name, manifest)
    if meta.get("kind") != "server" or meta.get("server_rank") != server_rank:
        raise CheckpointError(f"{path}/{name} is not server {server_rank}'s part")
    if server_rank == 0:
        # The workers check their own parts too, but only after this phase: a part that fails
        # then would leave the servers restored and that worker not.
        workers = {checkpoint.worker_file(r) for r in range(num_workers)}
        files = {k: v for k, v in manifest["files"].items() if k in workers}
        checkpoint.verify_parts(path, {"files": files})
    staged = StagedLoad(path, optimizer=_saved_optimizer(manifest, optimizer))
    target = optimizer if optimizer is not None else staged.optimizer
    pieces = _saved_pieces(arrays, meta, f"{path}/{name}")
    current = [c for c in chunks if c.initialized]
    here = {_key_id(c.spec.key) for c in current}
    unknown = [pieces[k][0][3]["key"] for k in pieces if k not in here]
    if unknown:
        raise CheckpointError(
            f"server {server_rank}: the checkpoint has key(s) {unknown[:5]!r} that this job did "
            f"not initialise: call kv.init for every key before kv.load_checkpoint"
        )
    for chunk in current:
        try:
            staged.restores.append(_stage_chunk(chunk, pieces, target, server_rank))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(
                f"{path}/{name}: malformed state of {chunk.spec.name} ({exc!r})"
            ) from exc
    return staged


def _saved_optimizer(manifest: Mapping[str, Any], current: Optimizer | None) -> Optimizer | None:
    """The optimizer a load sets (None: keep the job's), after checking the job's against the
    checkpoint's."""
    saved = manifest.get("optimizer")
    if saved is None:
        if current is not None:
            raise CheckpointError(
                f"the checkpoint was saved without a server optimizer, but this job set "
                f"{current.spec!r}"
            )
        return None
    try:
        spec = make_optimizer_spec(saved["name"], saved["params"])
    except (OptimizerError, KeyError, TypeError) as exc:
        raise CheckpointError(f"the checkpoint's optimizer {saved!r} is not valid: {exc}") from exc
    if current is None:
        return make_optimizer(spec)
    if current.spec.name != spec.name or current.spec.params != spec.params:
        raise CheckpointError(
            f"the checkpoint was saved with optimizer {spec!r} but this job set {current.spec!r}: "
            f"call kv.set_optimizer with the saved arguments before kv.load_checkpoint (or not "
            f"at all: the load sets it), and change it afterwards"
        )
    return None


Piece = tuple[int, int, dict[str, np.ndarray], dict[str, Any]]


def _saved_pieces(
    arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], where: str
) -> dict[tuple[str, Any], list[Piece]]:
    """The part's chunks grouped by key: (start, numel, arrays, metadata)."""
    pieces: dict[tuple[str, Any], list[Piece]] = {}
    try:
        for i, described in enumerate(meta["chunks"]):
            own = {name: arrays[f"{i}.{name}"] for name in described["arrays"]}
            start, numel = int(described["start"]), int(described["numel"])
            pieces.setdefault(_key_id(described["key"]), []).append((start, numel, own, described))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: malformed chunk table ({exc!r})") from exc
    return pieces


def _stage_chunk(
    chunk: ChunkState,
    pieces: Mapping[tuple[str, Any], list[Piece]],
    optimizer: Optimizer | None,
    server_rank: int,
) -> tuple[ChunkState, dict[str, np.ndarray], dict[str, Any] | None, dict]:
    spec = chunk.spec
    what = f"{spec.name} on server {server_rank}"
    saved = pieces.get(_key_id(spec.key))
    if not saved:
        raise CheckpointError(
            f"key {spec.key!r} is initialised in this job but server {server_rank}'s part of the "
            f"checkpoint does not have it"
        )
    first = saved[0][3]
    if (
        tuple(first["shape"]) != spec.shape
        or first["dtype"] != spec.dtype
        or tuple(sorted(first["codec"].items())) != spec.codec
    ):
        raise CheckpointError(
            f"key {spec.key!r}: the checkpoint has shape {tuple(first['shape'])} "
            f"{first['dtype']}, compression {first['codec']}; this job initialised "
            f"{spec.describe()}"
        )
    # (parts written before keys could be averaged have no such entry: none was)
    saved_averaged = first.get("averaged", False)
    if saved_averaged is not spec.averaged:
        raise CheckpointError(
            f"key {spec.key!r}: the checkpoint has it with averaged={saved_averaged!r}, this job "
            f"initialised it with averaged={spec.averaged}: init it as it was saved"
        )
    start, stop = spec.start, spec.start + spec.numel
    covering = [p[3] for p in saved if p[0] < stop and p[0] + p[1] > start] or [first]
    meta = covering[0]
    opt = (meta["optimizer"], meta["scalars"])
    if any((m["optimizer"], m["scalars"]) != opt for m in covering):
        raise CheckpointError(
            f"{what}: the saved chunks it is cut from have different optimizer states"
        )
    arrays = checkpoint.cut([p[:3] for p in saved], start, stop, what)
    acc = accumulator_dtype(spec.dtype)
    _expect(arrays.get("value"), np.dtype(spec.dtype), spec.numel, f"{what}: value")
    if chunk.master is not None:
        _expect(arrays.get("master"), acc, spec.numel, f"{what}: master copy")
    saved_aggregator = named_with(arrays, "agg.")
    if saved_aggregator:  # a codec's server state: the commit only copies it
        try:
            chunk.aggregator.check_state(saved_aggregator)
        except CodecError as exc:
            raise CheckpointError(f"{what}: {exc}") from exc
    state = None
    if optimizer is not None and meta["optimizer"] == optimizer.name:
        opt_arrays = named_with(arrays, "opt.")
        try:
            state = optimizer.import_state(opt_arrays, dict(meta["scalars"]), spec.numel, acc, what)
        except OptimizerError as exc:
            raise CheckpointError(str(exc)) from exc
    return chunk, arrays, state, meta


def _expect(array: np.ndarray | None, dtype: np.dtype, numel: int, what: str) -> None:
    if array is None:
        raise CheckpointError(f"{what} is missing from the checkpoint")
    if array.dtype != dtype or array.shape != (numel,):
        raise CheckpointError(
            f"{what} is {array.dtype}{list(array.shape)} in the checkpoint, expected "
            f"{np.dtype(dtype)}[{numel}]"
        )


__all__ = [
    "StagedLoad",
    "busy_reason",
    "optimizer_entry",
    "prepare_load",
    "snapshot",
    "spec_entry",
]
