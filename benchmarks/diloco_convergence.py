"""DiLoCo's convergence against synchronous data-parallel training, at equal samples: quality
against steps and against the bytes each worker moved.

Two workloads, each trained by its example under ``kvstore-launch`` (4 workers, 1 server by
default, the same data shards, batch and seed for every run):

* ``cnn``: the MNIST example's CNN (``examples/mnist/train.py``; its metric is test accuracy);
  the baseline is its per-step training with the servers' SGD, DiLoCo runs use the same SGD
  locally as the inner optimizer;
* ``lm``: the character-level transformer language model (``examples/charlm/train.py``, on the
  standard library's docstrings; its metric is held-out perplexity), AdamW inside; the baseline
  is its per-step synchronous mode (the workers' mean gradient, AdamW on every worker).

The runs (:data:`CONFIGS`), each with every ``--sync-every`` H:

* ``sync``: synchronous data-parallel, dense (the baseline; once, whatever H);
* ``diloco``: dense pseudo-gradients and weights, the workload's outer optimizer;
* ``diloco-topk``: top-k 1% pseudo-gradients (error feedback) and bf16 pulls;
* ``diloco-2bit``: 2-bit pseudo-gradients and bf16 pulls (threshold 0.01 for the CNN, 0.002
  for the language model: about the size of their pseudo-gradients' entries);
* ``diloco-topk-2bit``: ``topk2bit`` pseudo-gradients (top-k 1%, values in 2 bits, error
  feedback) and bf16 pulls;
* ``streaming``: Streaming DiLoCo, dense, ``fragments`` 4 and ``overlap`` 1, the workload's
  outer optimizer.

The compressed runs take the outer step as SparseLoCo does: plain averaging (outer SGD, learning
rate 1, no momentum), their error feedback standing in for the outer momentum; the dense ones
take the workload's outer optimizer (``--cnn-outer`` / ``--lm-outer``: learning rate and
momentum, Nesterov when the momentum is not 0).

Every run prints its evaluations as JSON lines, then one summary line: the final quality, its
difference to the baseline (points of accuracy, or percent of perplexity), the bytes each worker
pushed and pulled, and how many times fewer than the baseline's. ``--table`` writes a markdown
table, ``--plot`` a PNG per workload (quality against steps, and against bytes)::

    python -m benchmarks.diloco_convergence --preset full --out results/diloco_convergence.jsonl \\
        --table diloco.md --plot docs/img/diloco_convergence.png
    python -m benchmarks.diloco_convergence --from results/diloco_convergence.jsonl --table t.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, append_jsonl, emit, machine

CNN_EXAMPLE = REPO / "examples" / "mnist" / "train.py"
LM_EXAMPLE = REPO / "examples" / "charlm" / "train.py"

CONFIGS: dict[str, dict[str, str]] = {
    "sync": {"push": "none", "pull": "none"},
    "diloco": {"push": "none", "pull": "none"},
    "diloco-topk": {"push": "topk:ratio=0.01", "pull": "bf16", "outer": "average"},
    "diloco-2bit": {"push": "2bit:threshold={threshold}", "pull": "bf16", "outer": "average"},
    "diloco-topk-2bit": {"push": "topk2bit:ratio=0.01", "pull": "bf16", "outer": "average"},
    "streaming": {"push": "none", "pull": "none", "fragments": "4", "overlap": "1"},
}
"""Each run's push and pull compression (the example's specs), and Streaming DiLoCo's options."""

TWO_BIT_THRESHOLD = {"cnn": 0.01, "lm": 0.002}
"""The 2-bit threshold of each workload's pseudo-gradients."""

BASELINE = "sync"


def push_spec(workload: str, config: str) -> str:
    """The push codec spec of one run."""
    return CONFIGS[config]["push"].format(threshold=TWO_BIT_THRESHOLD[workload])


AVERAGE = (1.0, 0.0)
"""Outer SGD with learning rate 1 and no momentum: the mean of the workers' models."""

PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {"workloads": ["cnn"], "configs": ["sync", "streaming"],
              "cnn_sync_every": [8], "lm_sync_every": [8], "workers": 2, "cnn_epochs": 1,
              "cnn_model": "mlp", "lm_steps": 40, "cnn_outer": AVERAGE, "lm_outer": (0.7, 0.9)},
    "full": {"workloads": ["cnn", "lm"], "configs": list(CONFIGS), "cnn_sync_every": [12, 32],
             "lm_sync_every": [20], "workers": 4, "cnn_epochs": 8, "cnn_model": "cnn",
             "lm_steps": 300, "cnn_outer": AVERAGE, "lm_outer": (0.7, 0.9)},
}  # fmt: skip


def outer_options(args: argparse.Namespace, workload: str, config: str) -> list[str]:
    """The example's outer optimizer options of one run."""
    lr, momentum = AVERAGE if CONFIGS[config].get("outer") == "average" else (
        args.cnn_outer if workload == "cnn" else args.lm_outer)  # fmt: skip
    return ["--outer-lr", str(lr), "--outer-momentum", str(momentum)]


def cnn_command(args: argparse.Namespace, config: str, h: int, json_path: Path) -> list[str]:
    """The MNIST example's worker command of one run."""
    run = CONFIGS[config]
    command = [sys.executable, str(CNN_EXAMPLE), "--no-progress", "--json", str(json_path),
               "--model", args.cnn_model, "--epochs", str(args.cnn_epochs), "--lr", "0.05",
               "--momentum", "0.9", "--seed", str(args.seed), "--optimizer", "server",
               "--compression", push_spec("cnn", config),
               "--pull-compression", run["pull"]]  # fmt: skip
    if config != BASELINE:
        command += ["--diloco", str(h), *outer_options(args, "cnn", config),
                    "--fragments", run.get("fragments", "1"),
                    "--overlap", run.get("overlap", "0")]  # fmt: skip
    return command


def lm_command(args: argparse.Namespace, config: str, h: int, json_path: Path) -> list[str]:
    """The language model example's worker command of one run."""
    run = CONFIGS[config]
    steps = args.lm_steps
    command = [sys.executable, str(LM_EXAMPLE), "--json", str(json_path), "--steps", str(steps),
               "--eval-every", str(max(1, steps // 10)), "--seed", str(args.seed),
               "--compression", push_spec("lm", config),
               "--pull-compression", run["pull"]]  # fmt: skip
    if args.lm_options:
        command += args.lm_options.split()
    if config == BASELINE:
        return [*command, "--mode", "sync"]
    return [*command, "--mode", "diloco", "--sync-every", str(h),
            *outer_options(args, "lm", config), "--fragments", run.get("fragments", "1"),
            "--overlap", run.get("overlap", "0")]  # fmt: skip


COMMANDS = {"cnn": cnn_command, "lm": lm_command}


def points(workload: str, lines: list[str]) -> list[dict[str, Any]]:
    """The evaluations in worker 0's JSON lines: step, quality, bytes moved and seconds of
    training so far."""
    found: list[dict[str, Any]] = []
    for line in lines:
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if workload == "cnn" and "epoch" in record:
            before = found[-1]["seconds"] if found else 0.0  # the example times each epoch
            found.append({"step": record["epoch"] * record["steps_per_epoch"],
                          "quality": 100 * record["accuracy"],
                          "pushed_bytes": record["pushed_bytes_total"],
                          "pulled_bytes": record["pulled_bytes_total"],
                          "seconds": before + record["seconds"]})  # fmt: skip
        elif workload == "lm" and "perplexity" in record:
            found.append({"step": record["step"], "quality": record["perplexity"],
                          "pushed_bytes": record["pushed_bytes_total"],
                          "pulled_bytes": record["pulled_bytes_total"],
                          "seconds": record["seconds"]})  # fmt: skip
    return found


def run_job(
    worker: list[str], json_path: Path, *, workers: int, servers: int, timeout: float
) -> list[str]:
    """Run ``worker`` (an example's command, worker 0 writing ``json_path``) under the launcher
    with ``workers`` x ``servers``; the lines worker 0 wrote.

    Raises:
        RuntimeError: the job failed or ran out of time (with the end of its output).
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "kvstore.deploy", "-n", str(workers), "-s", str(servers), "--",
         *worker],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a time-out kills the whole job
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise RuntimeError(f"no result in {timeout:g} s:\n{output[-2000:]}") from None
    if process.returncode != 0:
        raise RuntimeError(f"exit status {process.returncode}:\n{output[-2000:]}")
    lines = json_path.read_text().splitlines() if json_path.exists() else []
    if not lines:
        raise RuntimeError(f"worker 0 reported nothing:\n{output[-2000:]}")
    return lines


def train(args: argparse.Namespace, workload: str, config: str, h: int) -> list[dict[str, Any]]:
    """One run under the launcher; worker 0's evaluations.

    Raises:
        RuntimeError: the job failed, ran out of time or reported no evaluation.
    """
    with tempfile.TemporaryDirectory(prefix="diloco-") as tmp:
        json_path = Path(tmp) / "worker0.jsonl"
        worker = COMMANDS[workload](args, config, h, json_path)
        lines = run_job(
            worker, json_path, workers=args.workers, servers=args.servers, timeout=args.timeout
        )
    found = points(workload, lines)
    if not found:
        raise RuntimeError("worker 0 reported no evaluation")
    return found


def summarize(by_run: dict[tuple[str, str, int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One line per run: final quality, bytes per worker, both against the baseline's."""
    lines = []
    for (workload, config, h), found in by_run.items():
        last = found[-1]
        moved = last["pushed_bytes"] + last["pulled_bytes"]
        base = next((v for (w, c, _), v in by_run.items() if w == workload and c == BASELINE), None)
        line: dict[str, Any] = {
            "bench": "diloco_convergence", "workload": workload, "run": config,
            "sync_every": None if config == BASELINE else h, "steps": last["step"],
            "quality": round(last["quality"], 3), "bytes_per_worker": moved,
        }  # fmt: skip
        if base is not None:
            base_last = base[-1]
            base_moved = base_last["pushed_bytes"] + base_last["pulled_bytes"]
            line["bytes_fewer"] = round(base_moved / moved, 1) if moved else None
            if workload == "cnn":
                line["vs_baseline"] = round(last["quality"] - base_last["quality"], 2)  # points
            else:
                line["vs_baseline"] = round(100 * (last["quality"] / base_last["quality"] - 1), 2)
        lines.append(line)
    return lines


def write_table(path: Path, summary: list[dict[str, Any]]) -> None:
    lines = []
    for workload, metric, unit in (("cnn", "test accuracy (%)", "points"),
                                   ("lm", "held-out perplexity", "%")):  # fmt: skip
        rows = [s for s in summary if s["workload"] == workload]
        if not rows:
            continue
        lines += [f"| {workload} run | H | {metric} | vs sync ({unit}) | MB per worker "
                  "(pushed + pulled) | bytes fewer than sync |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for s in rows:
            h = "-" if s["sync_every"] is None else str(s["sync_every"])
            vs = (
                "-"
                if s["run"] == BASELINE or "vs_baseline" not in s
                else f"{s['vs_baseline']:+.2f}"
            )
            fewer = "1x" if s["run"] == BASELINE else f"{s.get('bytes_fewer', 0):,.0f}x"
            lines.append(f"| `{s['run']}` | {h} | {s['quality']:.2f} | {vs} | "
                         f"{s['bytes_per_worker'] / 1e6:,.2f} | {fewer} |")  # fmt: skip
        lines.append("")
    path.write_text("\n".join(lines))


def write_plot(path: Path, by_run: dict[tuple[str, str, int], list[dict[str, Any]]]) -> None:
    """Per workload: quality against steps (left) and against MB moved per worker (right, log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({w for w, _, _ in by_run})
    figure, axes = plt.subplots(len(workloads), 2, figsize=(12, 4.2 * len(workloads)),
                                layout="constrained", squeeze=False)  # fmt: skip
    for row, workload in zip(axes, workloads, strict=True):
        for (w, config, h), found in by_run.items():
            if w != workload:
                continue
            label = config if config == BASELINE else f"{config} H={h}"
            style = "-" if h == min(hh for ww, _, hh in by_run if ww == workload) else "--"
            mb = [(p["pushed_bytes"] + p["pulled_bytes"]) / 1e6 for p in found]
            row[0].plot([p["step"] for p in found], [p["quality"] for p in found], style,
                        marker="o", markersize=3, label=label)  # fmt: skip
            row[1].plot(mb, [p["quality"] for p in found], style, marker="o", markersize=3,
                        label=label)  # fmt: skip
        metric = "test accuracy (%)" if workload == "cnn" else "held-out perplexity"
        row[0].set_xlabel("inner steps per worker")
        row[1].set_xlabel("MB moved per worker (pushed + pulled), log scale")
        row[1].set_xscale("log")
        for panel in row:
            panel.set_ylabel(f"{workload}: {metric}")
            panel.grid(alpha=0.3)
            if workload == "cnn":
                panel.set_ylim(90, 100)
            else:
                panel.set_yscale("log")
        row[1].legend(fontsize="x-small")
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--workloads", nargs="+", choices=sorted(COMMANDS))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS))
    parser.add_argument("--cnn-sync-every", type=int, nargs="+", metavar="H")
    parser.add_argument("--lm-sync-every", type=int, nargs="+", metavar="H")
    parser.add_argument("-n", "--workers", type=int)
    parser.add_argument("-s", "--servers", type=int, default=1)
    parser.add_argument("--cnn-epochs", type=int)
    parser.add_argument("--cnn-model", choices=["mlp", "cnn"])
    parser.add_argument("--lm-steps", type=int)
    parser.add_argument("--lm-options", default="", help="more options of the LM example")
    parser.add_argument("--cnn-outer", type=float, nargs=2, metavar=("LR", "MOMENTUM"))
    parser.add_argument("--lm-outer", type=float, nargs=2, metavar=("LR", "MOMENTUM"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    parser.add_argument("--table", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--from", dest="source", type=Path, help="rebuild from earlier lines")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    for name in ("workloads", "configs", "cnn_sync_every", "lm_sync_every", "workers",
                 "cnn_epochs", "cnn_model", "lm_steps", "cnn_outer", "lm_outer"):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    by_run: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    if args.source is not None:
        for line in args.source.read_text().splitlines():
            record = json.loads(line)
            if "step" in record and "quality" in record and "bytes_per_worker" not in record:
                key = (record["workload"], record["run"], record["sync_every"] or 0)
                by_run.setdefault(key, []).append(record)
    else:
        started = time.time()
        for workload in args.workloads:
            for config in args.configs:
                every = args.cnn_sync_every if workload == "cnn" else args.lm_sync_every
                for h in [0] if config == BASELINE else every:
                    try:
                        found = train(args, workload, config, h)
                    except RuntimeError as exc:
                        emit(failed := {"bench": "diloco_convergence", "workload": workload,
                                        "run": config, "sync_every": h or None,
                                        "error": str(exc)[-1500:]})  # fmt: skip
                        append_jsonl(args.out, failed)
                        continue
                    by_run[(workload, config, h)] = found
                    for point in found:
                        record = {"bench": "diloco_convergence", "workload": workload,
                                  "run": config, "sync_every": h or None, **point}  # fmt: skip
                        emit(record)
                        append_jsonl(args.out, record)
        setting = {"bench": "diloco_convergence", "preset": args.preset, "machine": machine(),
                   "workers": args.workers, "servers": args.servers,
                   "cnn_outer": list(args.cnn_outer), "lm_outer": list(args.lm_outer),
                   "wall_seconds": round(time.time() - started, 1)}  # fmt: skip
        emit(setting)
        append_jsonl(args.out, setting)
    summary = summarize(by_run)
    for line in summary:
        emit(line)
    if args.table is not None:
        write_table(args.table, summary)
    if args.plot is not None and by_run:
        write_plot(args.plot, by_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
