"""What a worker's calls moved and where their time went: :class:`TrafficStats`.

The store keeps one :class:`TrafficStats` that its parts add to as they work (the pushes, the
landing of replies, the round trips of multi-round codecs); :meth:`kvstore.KVStore.stats`
returns a snapshot. :class:`EncodeClock` splits the time of encoder calls into encoding and
device-to-host copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstore.codecs import xp


@dataclass
class TrafficStats:
    """Bytes this worker moved, counted over all frames (headers included).

    Attributes:
        pushed_bytes: bytes sent by push/pushpull messages.
        pushed_raw_bytes: what those pushes would have been uncompressed (value bytes).
        pulled_bytes: value bytes received by pull/pushpull replies.
        push_messages: push/pushpull messages sent.
        pull_messages: pull replies received.
        encode_seconds: time in the encoders (GPU values: their kernels, until done), the
            device-to-host copies of the payloads excluded.
        d2h_seconds: device-to-host copies of GPU values' payloads into pinned host memory.
        wire_seconds: time pull and pushpull calls waited for the servers' replies (for host
            ``out`` arrays, the copies that land replies as they arrive included).
        h2d_seconds: host-to-device copies of pulled values into GPU ``out`` arrays.

    The times are this process's wall-clock seconds inside this store's calls (the transfer
    clock, :data:`kvstore.codecs.xp.TRANSFERS`, is per process: stores used at once from
    several threads of one process may see each other's copies).
    """

    pushed_bytes: int = 0
    pushed_raw_bytes: int = 0
    pulled_bytes: int = 0
    push_messages: int = 0
    pull_messages: int = 0
    encode_seconds: float = 0.0
    d2h_seconds: float = 0.0
    wire_seconds: float = 0.0
    h2d_seconds: float = 0.0

    @property
    def compression_ratio(self) -> float:
        """Uncompressed push bytes over bytes actually pushed (1.0 before any push)."""
        return self.pushed_raw_bytes / self.pushed_bytes if self.pushed_bytes else 1.0

    def as_dict(self) -> dict[str, float]:
        return {
            "pushed_bytes": self.pushed_bytes,
            "pushed_raw_bytes": self.pushed_raw_bytes,
            "pulled_bytes": self.pulled_bytes,
            "push_messages": self.push_messages,
            "pull_messages": self.pull_messages,
            "compression_ratio": self.compression_ratio,
            "encode_seconds": self.encode_seconds,
            "d2h_seconds": self.d2h_seconds,
            "wire_seconds": self.wire_seconds,
            "h2d_seconds": self.h2d_seconds,
        }


class EncodeClock:
    """Splits the time of encoder calls into encoding and device-to-host copies (read off
    the process's transfer clock) and adds them to ``stats``."""

    def __init__(self, stats: TrafficStats) -> None:
        self._stats = stats
        self.start()

    def start(self) -> None:
        self._began = time.perf_counter()
        self._copies = xp.TRANSFERS.d2h_seconds

    def lap(self) -> None:
        """Count the time since :meth:`start` (or the last lap) and start again."""
        now = time.perf_counter()
        d2h = xp.TRANSFERS.d2h_seconds - self._copies
        self._stats.d2h_seconds += d2h
        self._stats.encode_seconds += now - self._began - d2h
        self._began, self._copies = now, xp.TRANSFERS.d2h_seconds
