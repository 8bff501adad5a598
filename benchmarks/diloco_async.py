"""DiLoCo with a slow worker: ``dist_sync`` (every outer step waits for it) against
``dist_async`` (each worker's pseudo-gradient applied on arrival), with the staleness-aware outer
steps, on the same data.

Every run trains the MNIST example's CNN in its DiLoCo mode under ``kvstore-launch`` (4 workers,
1 server, loopback), the last worker made ``--slowdown`` times slower (it sleeps that many times
each step's own time, less one): a worker on a slower device. Worker 0 (a fast one) reports
the accuracy of the outer weights after each of its epochs; the runs (:data:`RUNS`):

* ``sync-equal``: ``dist_sync``, no slow worker (the reference speed);
* ``sync``: ``dist_sync`` with the slow worker;
* ``async``: ``dist_async``, the same outer SGD applied to each ``Δ / N`` on arrival;
* ``async-delayed-nesterov``: ``dist_async``, the paper's outer Nesterov SGD (learning rate
  0.7, momentum 0.9) with its momentum refreshed once every N arrivals, momentum-free steps in
  between (Liu et al. 2024);
* ``async-dcasgd``: ``dist_async``, MXNet's delay-compensated SGD as the outer step.

The other runs' outer step is plain averaging (``--outer-lr`` 1, ``--outer-momentum`` 0), which
trains this CNN at H = 10 as well as per-step training does.

Prints each epoch as a JSON line and one summary line per run: seconds to ``--target``, final
accuracy, wall time of worker 0's training; ``--table`` writes them as markdown.

    python -m benchmarks.diloco_async --preset full --out results/diloco_async.jsonl --table a.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import append_jsonl, emit, machine
from benchmarks.diloco_convergence import CNN_EXAMPLE, run_job

RUNS: dict[str, dict[str, Any]] = {
    "sync-equal": {"mode": "dist_sync", "slow": False, "outer": []},
    "sync": {"mode": "dist_sync", "slow": True, "outer": []},
    "async": {"mode": "dist_async", "slow": True, "outer": []},
    "async-delayed-nesterov": {"mode": "dist_async", "slow": True,
                               "outer": ["--outer-lr", "0.7", "--outer-momentum", "0.9",
                                         "--outer-momentum-every", "N"]},
    "async-dcasgd": {"mode": "dist_async", "slow": True, "outer": ["--outer", "dcasgd"]},
}  # fmt: skip
"""Each run's mode, whether its last worker is slow, and its outer optimizer options beyond the
common ones (``N``: the number of workers)."""

PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {"runs": ["sync", "async-delayed-nesterov"], "workers": 2, "epochs": 1,
              "model": "mlp", "sync_every": 8},
    "full": {"runs": list(RUNS), "workers": 4, "epochs": 8, "model": "cnn", "sync_every": 10},
}  # fmt: skip


def worker_command(args: argparse.Namespace, name: str, json_path: Path) -> list[str]:
    run = RUNS[name]
    outer = ["--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)]
    outer += [str(args.workers) if word == "N" else word for word in run["outer"]]
    return [sys.executable, str(CNN_EXAMPLE), "--no-progress", "--json", str(json_path),
            "--model", args.model, "--epochs", str(args.epochs), "--lr", "0.05",
            "--momentum", "0.9", "--compression", "none", "--mode", run["mode"],
            "--diloco", str(args.sync_every), *outer,
            "--slowdown", str(args.slowdown if run["slow"] else 1.0),
            "--slow-rank", str(args.workers - 1)]  # fmt: skip


def summary(name: str, epochs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    wall = 0.0
    reached = None
    for record in epochs:
        wall += record["seconds"]
        if reached is None and record["accuracy"] >= target:
            reached = round(wall, 1)
    return {"bench": "diloco_async", "run": name, "target": target,
            "seconds_to_target": reached, "final_accuracy": epochs[-1]["accuracy"],
            "seconds": round(wall, 1), "epochs": len(epochs)}  # fmt: skip


def write_table(path: Path, lines: list[dict[str, Any]], target: float) -> None:
    rows = [f"| run | seconds to {target:.0%} | final accuracy | worker 0's training (s) |",
            "|---|---|---|---|"]  # fmt: skip
    for s in lines:
        t = "not reached" if s["seconds_to_target"] is None else f"{s['seconds_to_target']:.1f}"
        rows.append(f"| `{s['run']}` | {t} | {s['final_accuracy']:.2%} | {s['seconds']:.1f} |")
    path.write_text("\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS))
    parser.add_argument("-n", "--workers", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--model", choices=["mlp", "cnn"])
    parser.add_argument("--sync-every", type=int)
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.0)
    parser.add_argument("--slowdown", type=float, default=2.5)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", type=Path)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    for name in ("runs", "workers", "epochs", "model", "sync_every"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    started = time.time()
    lines = []
    for name in args.runs:
        with tempfile.TemporaryDirectory(prefix="diloco-async-") as tmp:
            json_path = Path(tmp) / "worker0.jsonl"
            try:
                output = run_job(worker_command(args, name, json_path), json_path,
                                 workers=args.workers, servers=1, timeout=args.timeout)  # fmt: skip
            except RuntimeError as exc:
                emit(failed := {"bench": "diloco_async", "run": name, "error": str(exc)[-1500:]})
                append_jsonl(args.out, failed)
                continue
        epochs = [json.loads(line) for line in output if line.startswith("{")]
        for record in epochs:
            line = {"bench": "diloco_async", "run": name, "epoch": record["epoch"],
                    "accuracy": record["accuracy"],
                    "seconds": round(record["seconds"], 3)}  # fmt: skip
            emit(line)
            append_jsonl(args.out, line)
        lines.append(summary(name, epochs, args.target))
    setting = {"bench": "diloco_async", "preset": args.preset, "machine": machine(),
               "workers": args.workers, "slowdown": args.slowdown, "sync_every": args.sync_every,
               "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
               "wall_seconds": round(time.time() - started, 1)}  # fmt: skip
    emit(setting)
    append_jsonl(args.out, setting)
    for line in lines:
        emit(line)
        append_jsonl(args.out, line)
    if args.table is not None:
        write_table(args.table, lines, args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
