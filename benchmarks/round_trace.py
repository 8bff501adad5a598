"""When a cluster cell's synchronous rounds complete on the servers, and how soon they are answered.

A server sums a chunk's round once every worker's push of it arrived, then answers every worker
with the new value. :mod:`link_trace` shows how busy the links were; this shows what the servers
saw: how far apart in time the N pushes of one round reached a server (``spread_ms``), how long
the server took from a round's last push to its first reply (``reply_lag_ms``: the sum, the
optimizer and the send, plus any wait for a core), and when in a step the first round completed
and the last reply left.

Times are those of the server's handlers (wall clock, which the emulated hosts share): a push
counts when the server's loop took it up, after its last byte arrived, and a reply when it was
handed to ZeroMQ, before it crossed the server's uplink.

``bench_cluster.py --round-trace`` starts each kvstore server through this script
(``python round_trace.py OUT -- SERVER_ARGS``), which wraps the server's push and value-reply
handlers to record ``(kind, time, worker rank, key, chunk)`` and writes them to ``OUT`` as JSON
when the server stops; :func:`summarize` then reads them against the timed steps' spans.
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Event = tuple[str, float, int, Any, int]
"""``(kind, wall-clock seconds, worker rank, key, chunk index)``, kind ``push`` or ``reply``."""


def instrument(server_class: Any, events: list[Event]) -> None:
    """Wrap ``server_class``'s push handler and value-reply sender to append to ``events``."""
    clock = time.time
    on_push = server_class._on_push
    send_value = server_class._send_value

    def traced_on_push(self: Any, identity: bytes, rank: int, msg: Any) -> None:
        events.append(("push", clock(), rank, msg.get("k"), msg.get("c")))
        on_push(self, identity, rank, msg)

    def traced_send_value(self: Any, reply: Any, chunk: Any, *args: Any) -> None:
        events.append(("reply", clock(), reply.rank, chunk.spec.key, chunk.spec.index))
        send_value(self, reply, chunk, *args)

    server_class._on_push = traced_on_push
    server_class._send_value = traced_send_value


def run_server(out: str, server_argv: Sequence[str]) -> int:
    """Run a kvstore server (``python -m kvstore.server`` arguments) with its rounds traced;
    the events are written to ``out`` when it stops."""
    from kvstore.server.__main__ import main
    from kvstore.server.server import ShardServer

    events: list[Event] = []
    instrument(ShardServer, events)
    try:
        return main(list(server_argv))
    finally:
        Path(out).write_text(json.dumps(events))


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(
    events_per_server: Sequence[Sequence[Event]],
    spans: Sequence[tuple[float, float]],
    num_workers: int,
) -> dict[str, float] | None:
    """Medians over the timed steps' (``spans``, which do not overlap) server-steps, in ms from
    the step's start.

    Per server and step: ``first_push_ms`` (its first push taken up), ``first_round_ms`` (its
    first complete round: every worker's push of a chunk in), ``last_push_ms``,
    ``last_reply_ms``; per round, medians and 90th percentiles over all rounds:
    ``spread_ms`` (last push of the round minus its first) and ``reply_lag_ms`` (first reply
    minus the round's last push). ``step_ms`` is the step's span. None without a complete round.
    """
    per_step: dict[str, list[float]] = defaultdict(list)
    spreads: list[float] = []
    lags: list[float] = []
    spans = sorted(spans)
    starts = [start for start, _ in spans]
    for events in events_per_server:
        # One pass over the server's events: each goes to the span it falls in, if any.
        pushes: list[dict[tuple[str, int], list[float]]] = [defaultdict(list) for _ in spans]
        replies: list[dict[tuple[str, int], list[float]]] = [defaultdict(list) for _ in spans]
        for kind, t, _rank, key, chunk in events:
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= spans[i][1]:
                (pushes if kind == "push" else replies)[i][(str(key), chunk)].append(t)
        for (start, end), step_pushes, step_replies in zip(spans, pushes, replies, strict=True):
            rounds = {k: sorted(v) for k, v in step_pushes.items() if len(v) == num_workers}
            if not rounds:
                continue
            completed = [v[-1] for v in rounds.values()]
            per_step["first_push_ms"].append(min(min(v) for v in step_pushes.values()) - start)
            per_step["first_round_ms"].append(min(completed) - start)
            per_step["last_push_ms"].append(max(max(v) for v in step_pushes.values()) - start)
            all_replies = [t for v in step_replies.values() for t in v]
            if all_replies:
                per_step["last_reply_ms"].append(max(all_replies) - start)
            per_step["step_ms"].append(end - start)
            for key, times in rounds.items():
                spreads.append(times[-1] - times[0])
                answered = [t for t in step_replies.get(key, ()) if t >= times[-1]]
                if answered:
                    lags.append(min(answered) - times[-1])
    if not spreads:
        return None
    summary = {name: round(statistics.median(v) * 1e3, 2) for name, v in per_step.items()}
    summary["spread_ms"] = round(statistics.median(spreads) * 1e3, 2)
    summary["spread_p90_ms"] = round(_percentile(spreads, 0.9) * 1e3, 2)
    if lags:
        summary["reply_lag_ms"] = round(statistics.median(lags) * 1e3, 2)
        summary["reply_lag_p90_ms"] = round(_percentile(lags, 0.9) * 1e3, 2)
    summary["rounds"] = len(spreads)
    return summary


def load(paths: Sequence[Path]) -> list[list[Event]]:
    """The events of each server's file (a server that wrote none has none)."""
    return [json.loads(p.read_text()) if p.exists() else [] for p in paths]


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit("usage: round_trace.py OUT -- KVSTORE_SERVER_ARGS...")
    sys.exit(run_server(sys.argv[1], sys.argv[3:]))
