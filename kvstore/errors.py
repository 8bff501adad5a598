"""Exception hierarchy of kvstore.

Every error this package raises on purpose derives from :class:`KVStoreError`. The classes that
also derive from a builtin (``ValueError``, ``KeyError``, ``TimeoutError``, ``ConnectionError``)
let callers catch them the usual Python way.

Errors that a server reports travel as a stable string code plus a message (see
:class:`ErrorCode`); the worker turns them back into the matching class with
:func:`error_from_code`, so a misuse is raised as the same class whether the worker or the server
caught it.

:func:`did_you_mean` words the suggestion of an "unknown name" message (a codec, an optimizer,
a parameter): the close match to a misspelled name.

This module depends on nothing else in the package.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from enum import StrEnum

SUGGESTION_CUTOFF = 0.6
"""How alike (difflib's ratio, 0-1) a known name must be to an unknown one to be suggested:
``topkk`` gets ``topk``, ``zip`` gets nothing."""


def close_match(name: object, choices: Iterable[str]) -> str | None:
    """The choice most like ``name``, case ignored (difflib's ratio, at least
    :data:`SUGGESTION_CUTOFF`); None where none is alike, or where ``name`` is not a string."""
    if not isinstance(name, str):
        return None
    by_folded: dict[str, str] = {}
    for choice in choices:
        by_folded.setdefault(choice.casefold(), choice)
    found = difflib.get_close_matches(name.casefold(), by_folded, n=1, cutoff=SUGGESTION_CUTOFF)
    return by_folded[found[0]] if found else None


def did_you_mean(names: Iterable[str], choices: Iterable[str]) -> str:
    """The suggestion for the unknown ``names`` among ``choices``, to append to a message that
    names them: ``" (did you mean 'topk'?)"`` for one, ``" (did you mean 'ratio' for 'ratoi',
    'sample' for 'sampel'?)"`` for several; ``""`` where none has a close match (see
    :func:`close_match`)."""
    known = list(choices)
    unknown = list(names)
    pairs = [(name, close_match(name, known)) for name in unknown]
    found = [(name, match) for name, match in pairs if match is not None]
    if not found:
        return ""
    if len(unknown) == 1:
        return f" (did you mean {found[0][1]!r}?)"
    return " (did you mean " + ", ".join(f"{m!r} for {n!r}" for n, m in found) + "?)"


class KVStoreError(Exception):
    """Base class of every error raised by kvstore."""


class ConfigError(KVStoreError, ValueError):
    """A missing or malformed setting (environment variable, CLI flag or argument)."""


class ProtocolError(KVStoreError):
    """A message that does not follow the wire protocol (see :mod:`kvstore.wire`)."""


class CodecError(KVStoreError, ValueError):
    """An unknown codec, bad codec parameters, or a value the codec cannot encode."""


class OptimizerError(KVStoreError, ValueError):
    """An unknown optimizer or bad optimizer hyperparameters."""


class KeyNotInitializedError(KVStoreError, KeyError):
    """A push or pull of a key that was never initialised with ``kv.init``."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class DuplicateInitError(KVStoreError, ValueError):
    """``kv.init`` called twice for the same key."""


class ValueMismatchError(KVStoreError, ValueError):
    """A value whose shape or dtype differs from the one the key was initialised with."""


class UsageError(KVStoreError, RuntimeError):
    """A call made in the wrong order or state (compression after init, use after close, ...)."""


class NonFiniteError(KVStoreError, ValueError):
    """A push of float values holding NaN or an infinity (``KVSTORE_ALLOW_NONFINITE=1`` lets
    them through). Nothing of the refused push was sent and no residual changed, so the caller
    may skip the step or stop; the message names the key and how many elements are bad."""


class RemoteError(KVStoreError):
    """An error reported by a server that has no more specific class.

    Attributes:
        code: the server's stable error code (an :class:`ErrorCode` value).
        message: the server's explanation.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class KVStoreTimeoutError(KVStoreError, TimeoutError):
    """A blocking call waited longer than ``KVSTORE_TIMEOUT`` seconds."""


class ConnectionLostError(KVStoreError, ConnectionError):
    """A server could not be reached, or closed its connection while requests were pending."""


class AuthenticationError(KVStoreError, ConnectionError):
    """A server refused this worker's credentials, or the two sides' security settings differ.

    Raised by the call that connects (``kvstore.create``) when the CURVE handshake with a
    server fails: the worker's client key is not the job's, its server public key is not the
    server's, or only one side has keys (see ``KVSTORE_AUTH_DIR``). Nothing reached the server.
    """


class ServerLostError(ConnectionLostError):
    """A server died, stalled or became unreachable during a job.

    Raised by every call that waits on it (and at once by later calls that need it) once it
    closed its connection or sent nothing for ``KVSTORE_HEARTBEAT_TIMEOUT`` seconds.

    Attributes:
        server: the lost server's rank (None where unknown).
        address: its address (``""`` where unknown).
    """

    def __init__(self, message: str, server: int | None = None, address: str = "") -> None:
        super().__init__(message)
        self.server = server
        self.address = address


class WorkerLostError(KVStoreError, ConnectionError):
    """Another worker of the job died or stalled, and this call needed it.

    A server declares a worker lost when it heard nothing from it for
    ``KVSTORE_HEARTBEAT_TIMEOUT`` seconds; every request that waits on it (a ``dist_sync``
    round, a barrier, an init waiting for rank 0, ``set_optimizer``) then fails with this
    error, and so do later ones until a replacement took the rank back.

    Attributes:
        rank: the lost worker's rank (None where unknown).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class CheckpointError(KVStoreError):
    """A checkpoint that cannot be saved or loaded: incomplete, corrupted, of a newer format,
    or of another job (different workers, servers, keys, compression or optimizer)."""


class ErrorCode(StrEnum):
    """Stable error codes carried by ``ERROR`` replies on the wire."""

    BAD_MESSAGE = "bad_message"
    NOT_CONNECTED = "not_connected"
    CLUSTER_MISMATCH = "cluster_mismatch"
    MODE_MISMATCH = "mode_mismatch"
    DUPLICATE_RANK = "duplicate_rank"
    NOT_INITIALIZED = "not_initialized"
    DUPLICATE_INIT = "duplicate_init"
    SPEC_MISMATCH = "spec_mismatch"
    BAD_VALUE = "bad_value"
    CODEC = "codec"
    OPTIMIZER = "optimizer"
    NO_OPTIMIZER = "no_optimizer"
    WRONG_SERVER = "wrong_server"
    MESSAGE_LIMIT = "message_limit"
    WORKER_LOST = "worker_lost"
    CHECKPOINT = "checkpoint"
    REPLICA = "replica"
    """A replica's state does not follow its primary's (a backup that missed a round)."""
    SHARD_MOVED = "shard_moved"
    """The shard is answered by another replica now (its backup took over)."""
    INTERNAL = "internal"


_CODE_TO_CLASS: dict[str, type[KVStoreError]] = {
    ErrorCode.BAD_MESSAGE: ProtocolError,
    ErrorCode.CLUSTER_MISMATCH: ConfigError,
    ErrorCode.MODE_MISMATCH: ConfigError,
    ErrorCode.DUPLICATE_RANK: ConfigError,
    ErrorCode.WRONG_SERVER: ConfigError,
    ErrorCode.MESSAGE_LIMIT: ConfigError,
    ErrorCode.NOT_INITIALIZED: KeyNotInitializedError,
    ErrorCode.DUPLICATE_INIT: DuplicateInitError,
    ErrorCode.SPEC_MISMATCH: ValueMismatchError,
    ErrorCode.BAD_VALUE: ValueMismatchError,
    ErrorCode.CODEC: CodecError,
    ErrorCode.OPTIMIZER: OptimizerError,
    ErrorCode.NO_OPTIMIZER: UsageError,
    ErrorCode.CHECKPOINT: CheckpointError,
    ErrorCode.WORKER_LOST: WorkerLostError,
}


def error_from_code(
    code: str, message: str, server: str = "", lost_rank: int | None = None
) -> KVStoreError:
    """Build the exception a worker raises for a server's ``ERROR`` reply.

    Args:
        code: the reply's error code.
        message: the reply's message.
        server: a short description of the server (``"server 1 (tcp://...)"``) to prefix.
        lost_rank: the worker rank a ``worker_lost`` reply names.
    """
    text = f"{server}: {message}" if server else message
    cls = _CODE_TO_CLASS.get(code)
    if cls is None:
        return RemoteError(code, text)
    if cls is WorkerLostError:
        return WorkerLostError(text, lost_rank)
    return cls(text)
