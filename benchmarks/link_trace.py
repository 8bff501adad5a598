"""How busy each emulated link was while a cell's steps ran, from its byte counters.

A cell above its wire floor lost time on its busiest link in one of two ways, and the median
step time cannot tell them apart: the link stood idle for part of the step (before the first
round's replies came, while the last ones drained), or it carried traffic below its rate (flows
held back by a send window or lead limit, senders late to refill them). The bridge's byte
counters can. :class:`LinkTrace` samples them about every millisecond for every host's link (a
bridge port's ``rx_bytes`` is what the host sent, its uplink; ``tx_bytes`` what it received,
its downlink) and :func:`summarize` sorts each link's time during the timed steps (the barriers
between them left out) into 5 ms bins: ``full`` (at least 90% of the link rate), ``idle``
(under 10%) and ``partial`` (the rest), next to its ``utilization`` (bytes over rate x time).

The sampler is a child process that asks for real-time scheduling (``SCHED_FIFO``, where it is
permitted): the emulated hosts share this machine's cores, and a sampler that waits for a core
behind the job would report the bins it slept through as idle links. Bins it did not sample
(it fell behind anyway) take the counters' straight-line interpolation; ``sample_gap_ms`` says
how long its longest gap was. Its reads cost a few percent of a core, so it is opt-in:
``python -m benchmarks.bench_cluster --link-trace``.

    python -m benchmarks.link_trace --sample OUT.bin PORT [PORT ...]   # the sampler (internal)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import REPO, module_command

SAMPLE_INTERVAL_S = 0.001
"""Time between two samples of every counter."""

BIN_S = 0.005
"""Width of a summary bin: a few TCP units (192 KiB, 1.6 ms at 1 Gbit/s) and token-bucket
bursts (256 KiB), so that a link sending steadily fills every bin."""

FULL_SHARE = 0.9
"""A bin that moved at least this share of the link rate's bytes is ``full``."""

IDLE_SHARE = 0.1
"""A bin that moved less than this share is ``idle``."""

_RT_PRIORITY = 10
"""``SCHED_FIFO`` priority of the sampler: above every normal process, below the kernel's own
real-time threads."""


def _counter_files(ports: Sequence[str]) -> list[str]:
    """Per port, its received then its sent byte counter (what its host sent, then received)."""
    return [
        f"/sys/class/net/{port}/statistics/{name}"
        for port in ports
        for name in ("rx_bytes", "tx_bytes")
    ]


def sample(out_path: str, ports: Sequence[str], interval_s: float = SAMPLE_INTERVAL_S) -> None:
    """The sampler: append ``time.time()`` and every counter (float64 each) to ``out_path``
    every ``interval_s`` until SIGTERM or SIGINT, then once more (so the last row counts every
    byte moved before the signal), flush and return. It prints ``ready`` once the first row is
    written."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(_RT_PRIORITY))
    except (PermissionError, AttributeError, OSError):
        pass  # normal priority: the gaps show in sample_gap_ms
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fds = [os.open(path, os.O_RDONLY) for path in _counter_files(ports)]
    row = np.empty(1 + len(fds), dtype=np.float64)
    ready = False
    with open(out_path, "wb") as out:
        while True:
            last = stop
            row[0] = time.time()
            for i, fd in enumerate(fds):
                row[i + 1] = int(os.pread(fd, 32, 0))
            out.write(row.tobytes())
            if not ready:  # after the first sample: what starts later is covered
                print("ready", flush=True)
                ready = True
            if last:
                break
            time.sleep(interval_s)
    for fd in fds:
        os.close(fd)


class LinkTrace:
    """Sample the byte counters of ``ports`` (bridge ports, one per host) from :meth:`start`
    to :meth:`stop` (or while in the block).

    Once stopped, :attr:`times` (wall clock, seconds) and :attr:`counters` (one row per
    sample; per port its uplink then its downlink bytes, cumulative) hold the samples; the
    first was taken before :meth:`start` returned.
    """

    def __init__(self, ports: Sequence[str]) -> None:
        self.ports = list(ports)
        name = f"kvstore-link-trace-{os.getpid()}-{id(self)}.bin"
        self._path = Path(tempfile.gettempdir()) / name
        self._process: subprocess.Popen | None = None
        self.times = np.empty(0)
        self.counters = np.empty((0, 2 * len(self.ports)))

    def start(self) -> None:
        """Start the sampler and wait until it took its first sample.

        Raises:
            RuntimeError: the sampler could not read the counters.
        """
        argv = module_command("link_trace", "--sample", str(self._path), *self.ports)
        self._process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO)
        if self._process.stdout.readline().strip() != "ready":  # counters open, sampling
            process, self._process = self._process, None
            process.stdout.close()
            code = process.wait()
            raise RuntimeError(f"the link sampler failed to start (exit {code})")

    def stop(self) -> None:
        """Stop the sampler (once its last sample is in) and read its samples; nothing when
        it is not running."""
        process, self._process = self._process, None
        if process is None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()
        try:
            rows = np.fromfile(self._path, dtype=np.float64)
        finally:
            self._path.unlink(missing_ok=True)
        width = 1 + 2 * len(self.ports)
        rows = rows[: len(rows) // width * width].reshape(-1, width)
        self.times, self.counters = rows[:, 0], rows[:, 1:]

    def __enter__(self) -> LinkTrace:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def summarize(
    times: np.ndarray,
    counters: np.ndarray,
    rate_bytes_per_s: float,
    spans: Sequence[tuple[float, float]],
    bin_s: float = BIN_S,
) -> list[dict[str, float]] | None:
    """Each counter column's time within ``spans`` (wall-clock intervals, e.g. the timed
    steps), in ``bin_s`` bins laid from each span's start (a span's last partial bin is left
    out).

    Returns, per column, ``utilization`` (bytes within the spans over rate x their length),
    the shares of bins that were ``full``, ``partial`` and ``idle`` (see the module doc), of
    the idle time the part at a span's start and at its end (``head_ms``, ``tail_ms``: the
    mean over spans; for a server's uplink, say, the wait for a step's first replies and the
    time its last pushes took to come back), plus the sampler's longest gap within a span
    (``sample_gap_ms``, the same for every column).
    None when the samples do not cover the spans or no span holds a whole bin.
    """
    if len(times) < 2 or not spans:
        return None
    if times[0] > min(s for s, _ in spans) or times[-1] < max(e for _, e in spans):
        return None
    edges = [s + bin_s * np.arange(int((e - s) / bin_s) + 1) for s, e in spans]
    if not any(len(e) > 1 for e in edges):
        return None
    gap = 0.0
    for start, end in spans:
        inside = times[(times >= start) & (times <= end)]
        gap = max(gap, float(np.diff(np.concatenate(([start], inside, [end]))).max()))
    length = sum(end - start for start, end in spans)
    full_bin = rate_bytes_per_s * bin_s
    summaries = []
    for column in counters.T:
        per_span = [np.diff(np.interp(e, times, column)) / full_bin for e in edges if len(e) > 1]
        heads, tails = zip(*(_idle_ends(m >= IDLE_SHARE) for m in per_span), strict=True)
        moved = np.concatenate(per_span)
        total = sum(
            float(np.interp(end, times, column) - np.interp(start, times, column))
            for start, end in spans
        )
        full = float(np.mean(moved >= FULL_SHARE))
        idle = float(np.mean(moved < IDLE_SHARE))
        summaries.append({
            "utilization": round(total / (rate_bytes_per_s * length), 3),
            "full": round(full, 3),
            "partial": round(1 - full - idle, 3),
            "idle": round(idle, 3),
            "head_ms": round(float(np.mean(heads)) * bin_s * 1000, 1),
            "tail_ms": round(float(np.mean(tails)) * bin_s * 1000, 1),
            "sample_gap_ms": round(gap * 1000, 1),
        })  # fmt: skip
    return summaries


def _idle_ends(active: np.ndarray) -> tuple[int, int]:
    """Idle bins before a span's first active bin and after its last (all of them, twice,
    when none is active)."""
    where = np.flatnonzero(active)
    if not len(where):
        return len(active), len(active)
    return int(where[0]), int(len(active) - 1 - where[-1])


def by_role(summaries: Sequence[Mapping[str, float]], roles: Sequence[str]) -> dict[str, Any]:
    """Group :func:`summarize`'s columns (per host: uplink, downlink) by the host's role.

    ``roles`` names each host's role (``server``, ``worker`` or ``server+worker``). Returns,
    per ``"<role> uplink"`` and ``"<role> downlink"``, the mean of its hosts' shares, and under
    ``busiest`` the single link that moved the most bytes (its name, e.g. ``"server 0
    uplink"``, and its own shares).
    """
    groups: dict[str, list[Mapping[str, float]]] = {}
    busiest: tuple[float, str, Mapping[str, float]] | None = None
    counts: dict[str, int] = {}
    for host, role in enumerate(roles):
        index = counts.get(role, 0)
        counts[role] = index + 1
        pair = summaries[2 * host : 2 * host + 2]
        for direction, summary in zip(("uplink", "downlink"), pair, strict=True):
            groups.setdefault(f"{role} {direction}", []).append(summary)
            if busiest is None or summary["utilization"] > busiest[0]:
                busiest = (summary["utilization"], f"{role} {index} {direction}", summary)
    keys = ("utilization", "full", "partial", "idle", "head_ms", "tail_ms")
    result: dict[str, Any] = {
        name: {k: round(float(np.mean([s[k] for s in members])), 3) for k in keys}
        for name, members in groups.items()
    }
    if busiest is not None:
        result["busiest"] = {"link": busiest[1], **{k: busiest[2][k] for k in keys}}
        result["sample_gap_ms"] = busiest[2]["sample_gap_ms"]
    return result


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "--sample":
        raise SystemExit(__doc__.rsplit("\n\n", 1)[1])
    sample(sys.argv[2], sys.argv[3:])
