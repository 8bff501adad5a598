"""Exception hierarchy of kvstore.

Every error this package raises on purpose derives from :class:`KVStoreError`. The classes that
also derive from a builtin (``ValueError``, ``KeyError``, ``TimeoutError``, ``ConnectionError``)
let callers catch them the usual Python way.

Errors that a server reports travel as a stable string code plus a message (see
:class:`ErrorCode`); the worker turns them back into the matching class with
:func:`error_from_code`, so a misuse is raised as the same class whether the worker or the server
caught it.

This module depends on nothing else in the package.
"""

from __future__ import annotations

from enum import StrEnum


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
    INTERNAL = "internal"


_CODE_TO_CLASS: dict[str, type[KVStoreError]] = {
    ErrorCode.BAD_MESSAGE: ProtocolError,
    ErrorCode.CLUSTER_MISMATCH: ConfigError,
    ErrorCode.MODE_MISMATCH: ConfigError,
    ErrorCode.DUPLICATE_RANK: ConfigError,
    ErrorCode.WRONG_SERVER: ConfigError,
    ErrorCode.NOT_INITIALIZED: KeyNotInitializedError,
    ErrorCode.DUPLICATE_INIT: DuplicateInitError,
    ErrorCode.SPEC_MISMATCH: ValueMismatchError,
    ErrorCode.BAD_VALUE: ValueMismatchError,
    ErrorCode.CODEC: CodecError,
    ErrorCode.OPTIMIZER: OptimizerError,
    ErrorCode.NO_OPTIMIZER: UsageError,
}


def error_from_code(code: str, message: str, server: str = "") -> KVStoreError:
    """Build the exception a worker raises for a server's ``ERROR`` reply.

    Args:
        code: the reply's error code.
        message: the reply's message.
        server: a short description of the server (``"server 1 (tcp://...)"``) to prefix.
    """
    text = f"{server}: {message}" if server else message
    cls = _CODE_TO_CLASS.get(code)
    if cls is None:
        return RemoteError(code, text)
    return cls(text)
