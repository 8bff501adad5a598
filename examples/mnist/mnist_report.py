"""What worker 0 reports after each epoch: its traffic from ``kv.stats()`` snapshots, and at
the end a plot of accuracy and loss against epochs and megabytes pushed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TIMINGS = ("encode_seconds", "d2h_seconds", "h2d_seconds", "wire_seconds")
"""Cumulative ``kv.stats()`` times reported per step in ``--json`` lines, where the installed
kvstore has them."""


def plot(path: Path, history: list[dict[str, float]], title: str) -> None:
    """Write a PNG of test accuracy and mean training loss after each epoch: against the epoch
    (left panel) and against the megabytes this worker had pushed by then (right panel), the
    cost in traffic of that accuracy."""
    # Imported here: only --plot needs matplotlib, and Agg draws without a display.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    accuracies = [100 * h["accuracy"] for h in history]
    losses = [h["loss"] for h in history]
    megabytes = [h["pushed_mb"] for h in history]
    figure, panels = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    for panel, xs, label in (
        (panels[0], epochs, "epoch"),
        (panels[1], megabytes, "MB pushed by worker 0"),
    ):
        panel.plot(xs, accuracies, "o-", color="tab:blue")
        panel.set_xlabel(label)
        panel.set_ylabel("test accuracy (%)", color="tab:blue")
        loss_axis = panel.twinx()  # loss and accuracy have different scales
        loss_axis.plot(xs, losses, "s--", color="tab:red")
        loss_axis.set_ylabel("training loss", color="tab:red")
    panels[0].set_xticks(epochs)
    figure.suptitle(title)
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)


def epoch_record(
    epoch: int, before: Any, now: Any, first: Any, steps: int
) -> dict[str, float | int]:
    """An epoch's traffic from two ``kv.stats()`` snapshots (``first``: before training):
    bytes of the epoch and since the start, the density sent (bytes pushed over the
    uncompressed values' bytes: headers and, for sparse codecs, indices included), and the
    per-step milliseconds of the timings the installed kvstore counts."""
    pushed = now.pushed_bytes - before.pushed_bytes
    raw = now.pushed_raw_bytes - before.pushed_raw_bytes
    record: dict[str, float | int] = {
        "epoch": epoch,
        "pushed_bytes": pushed,
        "pulled_bytes": now.pulled_bytes - before.pulled_bytes,
        "pushed_bytes_total": now.pushed_bytes - first.pushed_bytes,
        "pulled_bytes_total": now.pulled_bytes - first.pulled_bytes,
        "raw_bytes": raw,
        "density": pushed / raw if raw else 1.0,
    }
    for name in TIMINGS:
        later, earlier = getattr(now, name, None), getattr(before, name, None)
        if later is not None and earlier is not None:
            record[f"{name.removesuffix('_seconds')}_ms_per_step"] = 1e3 * (later - earlier) / steps
    return record
