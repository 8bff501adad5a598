"""Peer-controlled text made safe for logs, and warnings from peers kept from flooding them.

Whatever a peer controls (a routing identity, a key name, a codec name, an error text that quotes
a field of its message, a socket address) is passed through :func:`printable` before it is
logged, so that it can neither start a forged log line nor drive the reader's terminal, and
cannot make one line arbitrarily long:

* control characters (C0, DEL, C1), Unicode line and paragraph separators, and format
  characters (bidi overrides and isolates, zero-width characters, the BOM) are shown as
  escapes: ``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\u2028``, ``\\u202e``, ``\\U000e0001``;
* bytes that are not UTF-8 are shown as ``\\xNN``; lone surrogates in a ``str`` as ``\\udNNN``;
* the result keeps at most ``limit`` characters (:data:`TEXT_LIMIT` by default; an escape is
  never split) followed by a marker that says how much was cut: ``... (1234 more bytes)``.

The escaping is for reading, not for decoding back: a backslash is left as it is, so a peer
can write text that looks like an escape, but never a real line break or terminal control.

:class:`WarningThrottle` limits the warnings about peers: at most ``per_peer`` per peer per
``interval`` seconds and ``total`` for all peers together per ``interval``, so that neither one
peer nor many identities (a stranger can make unlimited ones) can flood the log; the next
warning that is logged says how many were left out. See ``docs/operations.md`` ("Security").
"""

from __future__ import annotations

import logging
import threading
import time
import unicodedata
from collections.abc import Callable, Hashable
from typing import NamedTuple

TEXT_LIMIT = 200
"""How many characters of a peer-controlled text :func:`printable` keeps by default."""

WARNINGS_PER_PEER = 5
"""How many warnings about one peer :class:`WarningThrottle` logs per interval by default."""

WARNINGS_TOTAL = 50
"""How many warnings about all peers together :class:`WarningThrottle` logs per interval by
default."""

WARNING_INTERVAL = 10.0
"""The interval (seconds) of :class:`WarningThrottle`'s limits by default."""

TRACKED_PEERS = 4096
"""How many peers :class:`WarningThrottle` remembers by default (the least recently warned
about are forgotten first)."""

_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Unicode categories shown as escapes: controls (C0, DEL, C1), format characters (bidi
overrides and isolates, zero-width characters, the BOM, tags), surrogates, and line and
paragraph separators."""


def _unsafe(char: str) -> bool:
    """Whether ``char`` is shown as an escape."""
    if " " <= char <= "~":  # printable ASCII: the common case, without a table look-up
        return False
    return unicodedata.category(char) in _UNSAFE_CATEGORIES


def _escape(char: str, from_bytes: bool) -> str:
    """The escape that shows ``char``; a surrogate decoded from bytes shows the raw byte."""
    named = _NAMED_ESCAPES.get(char)
    if named is not None:
        return named
    code = ord(char)
    if from_bytes and 0xDC80 <= code <= 0xDCFF:  # surrogateescape's stand-in for a raw byte
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _char_bytes(char: str) -> int:
    """How many bytes of the original input ``char`` stands for (surrogateescape: one)."""
    return 1 if 0xDC80 <= ord(char) <= 0xDCFF else len(char.encode("utf-8"))


def printable(value: object, limit: int = TEXT_LIMIT) -> str:
    """``value`` (text, bytes, or anything :func:`str` renders, such as an exception) as one
    safe log fragment: unsafe characters escaped, at most ``limit`` characters kept, and a
    marker saying how many characters (bytes, for ``bytes`` input) were cut.

    The work done is bounded by ``limit``, not by the size of ``value`` (bytes and text are
    cut before they are decoded or scanned).
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    from_bytes = isinstance(value, bytes | bytearray | memoryview)
    if isinstance(value, bytes | bytearray | memoryview):
        view = memoryview(value).cast("B")
        total = view.nbytes
        # the head holds at least limit + 1 whole characters, so a character split at its end
        # is never among those kept
        text = bytes(view[: 4 * limit + 4]).decode("utf-8", "surrogateescape")
    else:
        full = value if isinstance(value, str) else str(value)
        total = len(full)
        text = full[: limit + 1]
    pieces: list[str] = []
    length = 0
    consumed = 0  # characters (or bytes, from bytes) of the input shown so far
    for char in text:
        shown = _escape(char, from_bytes) if _unsafe(char) else char
        if length + len(shown) > limit:
            break
        pieces.append(shown)
        length += len(shown)
        consumed += _char_bytes(char) if from_bytes else 1
    cut = total - consumed
    if cut > 0:
        pieces.append(f"... ({cut} more {'bytes' if from_bytes else 'characters'})")
    return "".join(pieces)


class Verdict(NamedTuple):
    """:meth:`WarningThrottle.allow`'s answer."""

    allowed: bool
    """Whether to log this warning."""
    suppressed: int
    """When allowed: how many warnings about this peer were left out since the last one
    logged."""
    others: int
    """When allowed: how many warnings about other peers were left out, and not yet reported,
    by the limit for all peers (or because their peer was forgotten)."""
    seconds: float
    """When ``suppressed``: over how many seconds (since the last warning logged about this
    peer)."""

    def note(self) -> str:
        """The text to append to the logged warning: what was left out (empty if nothing)."""
        parts = []
        if self.suppressed:
            parts.append(
                f"{self.suppressed} more from this peer suppressed in the last "
                f"{max(1, round(self.seconds))} s"
            )
        if self.others:
            parts.append(f"{self.others} from other peers suppressed")
        return f" ({'; '.join(parts)})" if parts else ""


class _Peer:
    """What the throttle remembers about one peer."""

    __slots__ = ("logged_at", "suppressed", "window_count", "window_start")

    def __init__(self, now: float) -> None:
        self.window_start = now
        self.window_count = 0
        self.suppressed = 0
        self.logged_at = now


class WarningThrottle:
    """Rate limits for warnings about peers, per peer and for all peers together.

    Each peer (any hashable key: a routing identity, an address; keep it short) gets fixed
    windows of ``interval`` seconds, starting at its first warning, of at most ``per_peer``
    logged warnings; all peers together get fixed windows of at most ``total``. So at most
    ``total`` warnings are logged per ``interval``, whatever any number of peers send. At
    most ``max_peers`` peers are remembered (the least recently warned about are forgotten,
    their unreported count moving to the others' count). Thread-safe.

    Args:
        per_peer: warnings logged per peer per interval.
        total: warnings logged for all peers per interval.
        interval: the windows' length in seconds.
        max_peers: how many peers are remembered.
        clock: the time source (seconds; tests pass a fake one).
    """

    def __init__(
        self,
        per_peer: int = WARNINGS_PER_PEER,
        total: int = WARNINGS_TOTAL,
        interval: float = WARNING_INTERVAL,
        max_peers: int = TRACKED_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_peer < 1 or total < 1 or max_peers < 1 or not interval > 0:
            raise ValueError(
                "per_peer, total and max_peers must be at least 1 and interval positive, not "
                f"{per_peer}, {total}, {max_peers}, {interval}"
            )
        self.per_peer = per_peer
        self.total = total
        self.interval = interval
        self.max_peers = max_peers
        self._clock = clock
        self._peers: dict[Hashable, _Peer] = {}  # least recently warned about first
        self._window_start = clock()
        self._window_count = 0
        self._others = 0
        self._lock = threading.Lock()

    def allow(self, peer: Hashable) -> Verdict:
        """Count a warning about ``peer`` and say whether to log it (and what was left out)."""
        with self._lock:
            now = self._clock()
            state = self._peers.pop(peer, None)
            if state is None:
                state = _Peer(now)
                if len(self._peers) >= self.max_peers:
                    oldest = next(iter(self._peers))
                    self._others += self._peers.pop(oldest).suppressed
            self._peers[peer] = state  # now the most recently warned about
            if now - state.window_start >= self.interval:
                state.window_start, state.window_count = now, 0
            if now - self._window_start >= self.interval:
                self._window_start, self._window_count = now, 0
            if state.window_count >= self.per_peer:
                state.suppressed += 1
                return Verdict(False, 0, 0, 0.0)
            if self._window_count >= self.total:
                self._others += 1
                return Verdict(False, 0, 0, 0.0)
            state.window_count += 1
            self._window_count += 1
            verdict = Verdict(True, state.suppressed, self._others, now - state.logged_at)
            state.suppressed = 0
            state.logged_at = now
            self._others = 0
            return verdict

    def warn(
        self,
        log: logging.Logger,
        peer: Hashable,
        message: str,
        *args: object,
        level: int = logging.WARNING,
    ) -> bool:
        """Log ``message % args`` at ``level`` unless the limits for ``peer`` say no; the line
        ends with what was left out before it. Returns whether it was logged. The arguments
        must already be safe (:func:`printable`)."""
        verdict = self.allow(peer)
        if verdict.allowed:
            log.log(level, message + "%s", *args, verdict.note())
        return verdict.allowed

    def __len__(self) -> int:
        """How many peers are remembered."""
        return len(self._peers)


__all__ = [
    "TEXT_LIMIT",
    "TRACKED_PEERS",
    "WARNINGS_PER_PEER",
    "WARNINGS_TOTAL",
    "WARNING_INTERVAL",
    "Verdict",
    "WarningThrottle",
    "printable",
]
