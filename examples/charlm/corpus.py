"""The character LM's corpus: the docstrings of the Python standard library, read offline.

The text is collected at run time by parsing (``ast``, never importing) every ``.py`` file under
the interpreter's standard library (``sysconfig.get_paths()["stdlib"]``), in sorted path order,
so that every worker and every run of the same interpreter gets the same text; nothing is
downloaded. Skipped: ``site-packages`` (installed packages, not the library), the test
suites (any ``test``/``tests`` folder), ``idlelib`` and files that do not parse.

A *document* is one docstring (of a module, class or function), dedented by
``ast.get_docstring``. The text is **bytes** (UTF-8, vocabulary 256): nothing is dropped or
mapped, and a token is a byte. Documents are joined with a blank line between them.

The held-out split is by document: a document whose SHA-1 (``hashlib``, not Python's salted
``hash``) falls in the lowest 10% goes to validation, the rest to training. Identical
docstrings (``"Return self==value."``) hash alike and so land on the same side: the split
holds no document on both sides.

Each worker trains on its own contiguous shard of the training bytes (:func:`shard`), and
draws batches of random windows from a generator seeded by ``(seed, rank, step)``
(:func:`sample_windows`): the same batches whatever happened before.

Parsing the library takes seconds of CPU (measured here: 5-8 s for one process, more when
several workers start at once on shared cores); :func:`load_corpus` keeps the two texts in the
system's temp folder (about 1.7 MB), and reads them back in well under a second.
"""

from __future__ import annotations

import ast
import gc
import hashlib
import os
import struct
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

VOCABULARY = 256
"""Tokens are UTF-8 bytes."""

VALIDATION_FRACTION = 0.10
"""The share of documents (by hash) held out for validation."""

SEPARATOR = b"\n\n"
"""Between two documents."""

SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})
"""Folders of the standard library whose files are not read (anywhere in the path)."""


@dataclass(frozen=True)
class Corpus:
    """The training and validation text as byte tensors (``torch.uint8``), and the number of
    documents on each side."""

    train: torch.Tensor
    validation: torch.Tensor
    train_documents: int
    validation_documents: int


def stdlib_root() -> Path:
    """The standard library's folder of this interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` in sorted path order, without the skipped folders
    (which are not even listed: ``site-packages`` can hold far more files than the library)."""
    found: list[Path] = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED_FOLDERS]
        found.extend(Path(folder, name) for name in files if name.endswith(".py"))
    return sorted(found)


def docstrings(source: str) -> Iterator[str]:
    """The docstrings of a module's source: the module's, then each class's and function's
    in source order (nested ones after their parent's), stripped; raises
    ``SyntaxError``/``ValueError`` when it does not parse."""
    pending: list[ast.AST] = [ast.parse(source)]
    while pending:
        node = pending.pop()
        if isinstance(node, _WITH_DOCSTRING):
            text = ast.get_docstring(node, clean=True)
            if text and text.strip():
                yield text.strip()
        # Statements only: a def or class sits in a statement list, never in an expression.
        pending.extend(reversed(_child_statements(node)))


_WITH_DOCSTRING = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _child_statements(node: ast.AST) -> list[ast.AST]:
    children: list[ast.AST] = []
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        value = getattr(node, field, None)
        if isinstance(value, list):
            children.extend(child for child in value if isinstance(child, ast.AST))
    return children


def documents(files: Iterable[Path]) -> list[bytes]:
    """Every docstring of ``files``, UTF-8 encoded, in the order given."""
    found: list[bytes] = []
    # The syntax trees are many small objects and no cycles: the collector's passes over
    # them would take about as long as the parse.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for path in files:
            try:
                source = path.read_text(encoding="utf-8")
                found.extend(text.encode("utf-8") for text in docstrings(source))
            except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
                continue  # a file that does not read or parse (a template, another encoding)
    finally:
        if collecting:
            gc.enable()
    return found


def is_validation(document: bytes) -> bool:
    """Whether ``document`` is held out: its SHA-1, read as a number in [0, 1), is below
    :data:`VALIDATION_FRACTION`."""
    digest = hashlib.sha1(document, usedforsecurity=False).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < VALIDATION_FRACTION


def load_corpus(root: Path | None = None, *, cache: bool = True) -> Corpus:
    """The corpus of the standard library under ``root`` (default: this interpreter's), split
    into training and validation documents.

    Parsing the library takes seconds of CPU (more when several workers start at once on
    shared cores), so with ``cache`` the two texts are kept in the system's temp folder under
    a name made from the library's path and every file's path, size and modification time:
    a changed file, another interpreter or another library makes another name, and a cache
    file that does not read back whole is ignored and rewritten.
    """
    root = stdlib_root() if root is None else root
    files = source_files(root)
    path = _cache_path(root, files) if cache else None
    if path is not None:
        cached = _read_cache(path)
        if cached is not None:
            return cached
    train: list[bytes] = []
    validation: list[bytes] = []
    for document in documents(files):
        (validation if is_validation(document) else train).append(document)
    if not train or not validation:
        raise RuntimeError(
            f"the standard library under {root} gave {len(train)} training and "
            f"{len(validation)} validation docstrings; need some of each"
        )
    corpus = Corpus(
        train=_as_tensor(SEPARATOR.join(train)),
        validation=_as_tensor(SEPARATOR.join(validation)),
        train_documents=len(train),
        validation_documents=len(validation),
    )
    if path is not None:
        _write_cache(path, corpus)
    return corpus


_CACHE_MAGIC = b"pskv-charlm-corpus-1\n"
_HEADER = struct.Struct("<4Q")  # train bytes, validation bytes, train docs, validation docs


def _cache_path(root: Path, files: list[Path]) -> Path:
    fingerprint = hashlib.sha256(_CACHE_MAGIC + str(root).encode())
    for path in files:
        stat = path.stat()
        fingerprint.update(f"\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return Path(tempfile.gettempdir(), f"pskv-charlm-{fingerprint.hexdigest()[:32]}.bin")


def _read_cache(path: Path) -> Corpus | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    start = len(_CACHE_MAGIC) + _HEADER.size
    if not data.startswith(_CACHE_MAGIC) or len(data) < start:
        return None
    train_bytes, validation_bytes, train_docs, validation_docs = _HEADER.unpack_from(
        data, len(_CACHE_MAGIC)
    )
    if len(data) != start + train_bytes + validation_bytes:
        return None
    middle = start + train_bytes
    return Corpus(
        train=_as_tensor(data[start:middle]),
        validation=_as_tensor(data[middle:]),
        train_documents=train_docs,
        validation_documents=validation_docs,
    )


def _write_cache(path: Path, corpus: Corpus) -> None:
    """Written to a file of its own, then renamed: workers that start together each write
    a whole file, and a reader sees one whole file or none."""
    header = _HEADER.pack(
        len(corpus.train),
        len(corpus.validation),
        corpus.train_documents,
        corpus.validation_documents,
    )
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, delete=False) as out:
            out.write(_CACHE_MAGIC + header)
            out.write(corpus.train.numpy().tobytes())
            out.write(corpus.validation.numpy().tobytes())
        os.replace(out.name, path)
    except OSError:
        return  # no cache then: the next run parses again


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def shard(text: torch.Tensor, rank: int, workers: int) -> torch.Tensor:
    """Worker ``rank``'s contiguous share of ``text``: the ``rank``-th of ``workers`` equal
    slices (the last few bytes of an uneven split go to no one)."""
    if not 0 <= rank < workers:
        raise ValueError(f"rank must be in [0, {workers}), got {rank}")
    size = len(text) // workers
    return text[rank * size : (rank + 1) * size]


def sample_windows(
    text: torch.Tensor, batch: int, context: int, *, seed: int, rank: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``batch`` random windows of ``text``: inputs and next-byte targets, both
    ``(batch, context)`` int64. The window starts come from a generator seeded by ``(seed,
    rank, step)`` alone."""
    if len(text) <= context:
        raise ValueError(f"a text of {len(text)} bytes has no window of {context + 1}")
    generator = torch.Generator().manual_seed(_mix(seed, rank, step))
    starts = torch.randint(0, len(text) - context, (batch,), generator=generator)
    return _windows(text, starts, context)


def fixed_windows(text: torch.Tensor, count: int, context: int) -> tuple[torch.Tensor, ...]:
    """``count`` windows spread evenly over ``text`` (the same ones every time): the
    validation set of an evaluation."""
    if len(text) <= context:
        raise ValueError(f"a text of {len(text)} bytes has no window of {context + 1}")
    starts = torch.linspace(0, len(text) - context - 1, count).long()
    return _windows(text, starts, context)


def _windows(
    text: torch.Tensor, starts: torch.Tensor, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = starts[:, None] + torch.arange(context + 1)[None, :]
    chunk = text[offsets].long()
    return chunk[:, :-1], chunk[:, 1:]


def _mix(seed: int, rank: int, step: int) -> int:
    """One 63-bit generator seed from the three numbers (stable across runs and machines)."""
    digest = hashlib.sha256(f"{seed}/{rank}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
