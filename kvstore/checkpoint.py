"""The checkpoint format of ``kv.save_checkpoint`` / ``kv.load_checkpoint``: files, atomicity,
verification. No sockets here; the server and the worker client call these functions.

A checkpoint is a directory::

    PATH/
      manifest.json      format name and version, the job's shape (mode, workers, servers,
                         optimizer, keys with shape, dtype and compression) and the sha256 and
                         size of every other file
      server-0.npz ...   server I's shard, written by server I: per chunk its value, its master
                         copy (float16 keys), its optimizer state and update count, and
                         whether it is averaged
      worker-0.npz ...   worker R's codec state, written by worker R: per chunk the encoder's
                         state (2-bit residuals) and how many pushes it sent

Each ``.npz`` is ``np.savez`` of plain numeric arrays plus one ``uint8`` array, :data:`META`,
holding the file's JSON metadata; it is read with ``np.load(allow_pickle=False)``. Nothing is
ever pickled, so loading a checkpoint cannot run code.

Atomicity. Every process writes its file into a staging directory beside ``PATH``
(:func:`staging_path`): to a temporary name, flushed and fsynced, then renamed into place, and
then its sha256 into ``NAME.sha256`` the same way. Once every part is in, rank 0 collects those
checksums into ``manifest.json`` (written last, the same way), and renames the staging directory
to ``PATH`` (moving an older checkpoint at ``PATH`` aside first and deleting it after). So a
directory at ``PATH`` either has a manifest whose checksums match every file, or does not load:
:func:`read_manifest` refuses a directory without a manifest, and :func:`read_part` a file
whose size or sha256 differ from the manifest's.

Versioned. :data:`FORMAT_VERSION` is written into the manifest and into every part; a reader
refuses a newer version with a clear error (older ones it knows how to read).

Chunks. Servers and workers keep state per key chunk (see :mod:`kvstore.topology`), and the
chunk plan depends on settings that may change between runs (``KVSTORE_PARTITION_BYTES``, and
whether the servers are on the workers' host). A part therefore records each chunk's element
range within its key, and a loader cuts the state it needs out of the saved chunks that cover
the range (:func:`cut`): element-wise state (values, residuals, momentum) re-cuts freely; a
scalar (Adam's step count) must be equal over the pieces it is cut from.

This module depends on nothing else in the package but :mod:`kvstore.errors`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import CheckpointError

FORMAT = "pskv-checkpoint"
"""The manifest's ``format`` field."""

FORMAT_VERSION = 1
"""The version this code writes; it reads versions up to this one."""

MANIFEST = "manifest.json"
META = "__meta__"
"""The array of each part that holds its JSON metadata (as uint8 bytes)."""

_HASH_BLOCK = 1 << 20


def server_file(rank: int) -> str:
    """The name of server ``rank``'s part."""
    return f"server-{rank}.npz"


def worker_file(rank: int) -> str:
    """The name of worker ``rank``'s part."""
    return f"worker-{rank}.npz"


def part_names(num_servers: int, num_workers: int) -> list[str]:
    """The names of every part of a checkpoint of a job of this size."""
    return [server_file(s) for s in range(num_servers)] + [
        worker_file(r) for r in range(num_workers)
    ]


def staging_path(path: str | os.PathLike[str]) -> Path:
    """The directory a checkpoint of ``path`` is written into before it is renamed to ``path``
    (beside it, so the rename stays on one file system)."""
    target = Path(path)
    return target.parent / f".{target.name}.saving"


# low-level file helpers --------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable (where the platform allows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename still happened
    finally:
        os.close(fd)


def _temp_name(directory: Path, name: str) -> Path:
    return directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


class _HashingWriter:
    """A write-only, unseekable file object that hashes what goes through it.

    Handed to ``np.savez``, it makes ``zipfile`` stream the archive (data descriptors instead
    of seeking back), so the checksum is computed while writing, not by reading the file again.
    """

    def __init__(self, file: Any) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._file.write(view)
        self.sha256.update(view)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def read(self, *args: Any) -> bytes:  # numpy takes objects with ``read`` as files
        raise io.UnsupportedOperation("write-only")

    def flush(self) -> None:
        self._file.flush()


def _write_atomic(directory: Path, name: str, write: Any) -> tuple[str, int]:
    """Write ``directory/name`` through ``write(file)`` to a temporary name, fsync it and
    rename it into place; returns its sha256 (hex) and size."""
    temp = _temp_name(directory, name)
    try:
        with open(temp, "wb") as raw:
            writer = _HashingWriter(raw)
            write(writer)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(temp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return writer.sha256.hexdigest(), writer.size


def _write_text_atomic(directory: Path, name: str, text: str) -> None:
    _write_atomic(directory, name, lambda f: f.write(text.encode()))


def file_sha256(path: Path) -> tuple[str, int]:
    """The sha256 (hex) and size of a file, read in blocks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


# parts -------------------------------------------------------------------------------------------


def write_part(
    directory: str | os.PathLike[str],
    name: str,
    arrays: Mapping[str, np.ndarray],
    meta: Mapping[str, Any],
) -> str:
    """Write one part (an ``.npz``) atomically, and its checksum beside it (``NAME.sha256``).

    Args:
        directory: the staging directory (made if missing).
        name: the part's file name (:func:`server_file`, :func:`worker_file`).
        arrays: plain numeric arrays (host memory); written as they are.
        meta: JSON-serialisable metadata; ``version`` is added.

    Returns:
        the part's sha256, hex.

    Raises:
        CheckpointError: an array is not plain numeric data.
        OSError: the file system refused.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    for key, array in arrays.items():
        if key == META or not isinstance(array, np.ndarray) or array.dtype.hasobject:
            raise CheckpointError(f"{name}: {key!r} is not a plain numeric array")
    text = json.dumps({**meta, "version": FORMAT_VERSION}, sort_keys=True)
    # (typed loosely: numpy's stub reads any keyword of savez as its allow_pickle flag)
    payload: dict[str, Any] = {**arrays, META: np.frombuffer(text.encode(), np.uint8)}
    sha, size = _write_atomic(folder, name, lambda f: np.savez(f, **payload))
    _write_text_atomic(folder, name + ".sha256", f"{sha} {size}\n")
    _fsync_dir(folder)
    return sha


def read_part(
    directory: str | os.PathLike[str], name: str, manifest: Mapping[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read one part after checking its size and sha256 against the manifest.

    Returns:
        its arrays (without the metadata) and its metadata.

    Raises:
        CheckpointError: the part is missing, not in the manifest, differs from the manifest's
            checksum, or is not a readable part of a known version.
    """
    path = Path(directory) / name
    entry = manifest.get("files", {}).get(name)
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path.parent}: the manifest does not list {name}")
    _verify_file(path, entry)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        meta = json.loads(arrays.pop(META).tobytes().decode())
    except Exception as exc:  # zipfile, numpy and json raise many unrelated types
        raise CheckpointError(f"{path} is not a readable checkpoint file: {exc}") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: its metadata is not a JSON object")
    _check_version(meta.get("version"), str(path))
    return arrays, meta


def verify_parts(directory: str | os.PathLike[str], manifest: Mapping[str, Any]) -> None:
    """Check the size and sha256 of every file the manifest lists.

    Raises:
        CheckpointError: naming the first file that is missing or differs.
    """
    folder = Path(directory)
    for name, entry in sorted(manifest.get("files", {}).items()):
        _verify_file(folder / name, entry)


def _verify_file(path: Path, entry: Mapping[str, Any]) -> None:
    """Check one file against its manifest entry (``bytes`` and ``sha256``)."""
    try:
        sha, size = file_sha256(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint file: {exc}") from exc
    if size != entry.get("bytes") or sha != entry.get("sha256"):
        raise CheckpointError(
            f"{path} does not match the manifest (size {size}, sha256 {sha[:16]}..., expected "
            f"{entry.get('bytes')}, {str(entry.get('sha256'))[:16]}...): the file was changed "
            f"or corrupted after the checkpoint was written"
        )


# manifest ----------------------------------------------------------------------------------------


def _check_version(version: Any, where: str) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{where}: format version {version!r} is not valid")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format version {version}, newer than this pskv reads (up to "
            f"{FORMAT_VERSION}): load it with a newer pskv"
        )


_MANIFEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "mode": str,
    "num_workers": int,
    "num_servers": int,
    "keys": list,
    "files": dict,
}


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a checkpoint's manifest (format, version, fields).

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint of a version this code reads.
    """
    folder = Path(path)
    file = folder / MANIFEST
    try:
        text = file.read_text()
    except FileNotFoundError:
        if not folder.is_dir():
            raise CheckpointError(f"no checkpoint at {folder}: it is not a directory") from None
        raise CheckpointError(
            f"{folder} is not a complete checkpoint: it has no {MANIFEST} (a save that did not "
            f"finish leaves none)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a pskv checkpoint manifest")
    _check_version(manifest.get("version"), str(file))
    for name, kind in _MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(name), kind):
            raise CheckpointError(f"{file}: field {name!r} is missing or malformed")
    expected = set(part_names(manifest["num_servers"], manifest["num_workers"]))
    if set(manifest["files"]) != expected:
        raise CheckpointError(
            f"{file} lists files {sorted(manifest['files'])}, expected {sorted(expected)}"
        )
    return manifest


def check_job(
    manifest: Mapping[str, Any], *, mode: str, num_workers: int, num_servers: int
) -> None:
    """Refuse a checkpoint of a job of another shape.

    Raises:
        CheckpointError: the mode, number of workers or number of servers differ.
    """
    saved = (manifest["mode"], manifest["num_workers"], manifest["num_servers"])
    if saved != (mode, num_workers, num_servers):
        raise CheckpointError(
            f"the checkpoint is of a {saved[0]} job of {saved[1]} worker(s) and {saved[2]} "
            f"server(s), this is a {mode} job of {num_workers} worker(s) and {num_servers} "
            f"server(s): resume with the same mode, number of workers and number of servers"
        )


def key_spec(key: Any, shape: Sequence[int], dtype: str, codec: Mapping[str, Any]) -> dict:
    """A key's entry in the manifest (and what a loader compares against)."""
    return {"key": key, "shape": [int(d) for d in shape], "dtype": dtype, "codec": dict(codec)}


def describe_key_spec(spec: Mapping[str, Any]) -> str:
    return f"shape {tuple(spec['shape'])} {spec['dtype']}, compression {spec['codec']}"


def compare_keys(saved: Iterable[Mapping[str, Any]], current: Iterable[Mapping[str, Any]]) -> None:
    """Check that the keys initialised now are the checkpoint's keys, with equal specs.

    Raises:
        CheckpointError: naming the first key that is missing on either side or differs.
    """
    saved_by_key = {_key_id(s["key"]): s for s in saved}
    current_by_key = {_key_id(s["key"]): s for s in current}
    for ident, spec in current_by_key.items():
        other = saved_by_key.get(ident)
        if other is None:
            raise CheckpointError(
                f"key {spec['key']!r} is initialised in this job but not in the checkpoint"
            )
        if _spec_tuple(other) != _spec_tuple(spec):
            raise CheckpointError(
                f"key {spec['key']!r}: the checkpoint has {describe_key_spec(other)}, this job "
                f"initialised {describe_key_spec(spec)}"
            )
    missing = [s["key"] for ident, s in saved_by_key.items() if ident not in current_by_key]
    if missing:
        raise CheckpointError(
            f"the checkpoint has key(s) {missing[:5]!r} that this job did not initialise: call "
            f"kv.init for every key before kv.load_checkpoint"
        )


def _key_id(key: Any) -> tuple[str, Any]:
    # 3 and "3" are different keys; JSON keeps the difference, a dict lookup must too.
    return (type(key).__name__, key)


def _spec_tuple(spec: Mapping[str, Any]) -> tuple:
    return (
        tuple(spec["shape"]),
        spec["dtype"],
        tuple(sorted(dict(spec["codec"]).items())),
    )


def clear_stale_manifest(staging: str | os.PathLike[str]) -> None:
    """Remove a manifest a save that crashed left in the staging directory (rank 0, before a
    save writes any part), so a half-rewritten staging directory never looks complete."""
    with contextlib.suppress(FileNotFoundError):
        (Path(staging) / MANIFEST).unlink()


def finalize(
    path: str | os.PathLike[str],
    staging: str | os.PathLike[str],
    manifest: Mapping[str, Any],
    parts: Sequence[str],
) -> dict[str, Any]:
    """Complete a save: write the manifest (listing every part's checksum) into the staging
    directory, then rename it to ``path``. Run by one process (rank 0) after every part is in.

    A checkpoint already at ``path`` is replaced: it is renamed aside, the new one renamed in,
    and the old one deleted (a crash between the two renames leaves the old checkpoint at
    ``.NAME.old-*`` beside ``path``, and no directory at ``path``).

    Returns:
        the manifest as written.

    Raises:
        CheckpointError: a part or its checksum is missing, or ``path`` exists and is not a
            checkpoint (it is never deleted then).
        OSError: the file system refused.
    """
    target, folder = Path(path), Path(staging)
    files: dict[str, dict[str, Any]] = {}
    for name in parts:
        try:
            sha, size = (folder / f"{name}.sha256").read_text().split()
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{folder}: the checksum of {name} is missing: {exc}") from exc
        files[name] = {"sha256": sha, "bytes": int(size)}
        if (folder / name).stat().st_size != int(size):
            raise CheckpointError(f"{folder / name} does not have the size its writer reported")
    keep = set(parts)
    for entry in folder.iterdir():  # sidecars, leftovers of a crashed save, temporary files
        if entry.name not in keep and entry.is_file():
            entry.unlink()
    written = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        **manifest,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
    }
    _write_text_atomic(folder, MANIFEST, json.dumps(written, indent=1, sort_keys=True) + "\n")
    _fsync_dir(folder)
    aside = None
    if target.exists() or target.is_symlink():
        if not target.is_dir() or (any(target.iterdir()) and not (target / MANIFEST).exists()):
            raise CheckpointError(
                f"{target} exists and is not a pskv checkpoint; refusing to replace it"
            )
        aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, aside)
    os.replace(folder, target)
    _fsync_dir(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return written


# chunk pieces ------------------------------------------------------------------------------------


def cut(
    pieces: Sequence[tuple[int, int, Mapping[str, np.ndarray]]], start: int, stop: int, what: str
) -> dict[str, np.ndarray]:
    """The element-wise arrays of elements ``[start, stop)`` of a key, cut from saved pieces.

    Args:
        pieces: ``(start, numel, arrays)`` of the saved chunks of the key (any order); every
            array of a piece has ``numel`` elements, or is a 0-d array holding a value of the
            whole key that every chunk keeps a copy of (a sparse codec's push count), and the
            pieces have the same array names.
        start, stop: the range wanted.
        what: names the range in errors (``"key 'w' chunk 2 on server 1"``).

    Returns:
        one array per name, ``stop - start`` elements (a view where one piece covers the range).

    Raises:
        CheckpointError: the saved pieces do not cover ``[start, stop)`` exactly once.
    """
    for piece_start, numel, arrays in pieces:
        if piece_start == start and numel == stop - start:  # the same chunk: any state fits
            return dict(arrays)
    covering = sorted(
        (p for p in pieces if p[0] < stop and p[0] + p[1] > start and p[1] > 0),
        key=lambda p: p[0],
    )
    position = start
    for piece_start, numel, _ in covering:
        if piece_start > position:
            break
        position = max(position, piece_start + numel)
    if not covering or covering[0][0] > start or position < stop:
        raise CheckpointError(
            f"{what}: elements [{start}, {stop}) are not in the checkpoint (saved with another "
            f"KVSTORE_BIGARRAY_BOUND or number of servers?)"
        )
    names = set(covering[0][2])
    if any(set(p[2]) != names for p in covering):
        raise CheckpointError(f"{what}: the saved chunks that cover it hold different state")
    result = {}
    for name in names:
        parts = []
        if np.ndim(covering[0][2][name]) == 0:  # a value of the whole key: any copy
            result[name] = covering[0][2][name]
            continue
        for piece_start, numel, arrays in covering:
            lo, hi = max(start, piece_start) - piece_start, min(stop, piece_start + numel)
            array = arrays[name]
            if array.ndim != 1 or array.shape[0] != numel:
                raise CheckpointError(f"{what}: saved state {name!r} is not one value per element")
            parts.append(array[lo : hi - piece_start])
        result[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return result


__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "META",
    "check_job",
    "clear_stale_manifest",
    "compare_keys",
    "cut",
    "describe_key_spec",
    "file_sha256",
    "finalize",
    "key_spec",
    "part_names",
    "read_manifest",
    "read_part",
    "server_file",
    "staging_path",
    "verify_parts",
    "worker_file",
    "write_part",
]
