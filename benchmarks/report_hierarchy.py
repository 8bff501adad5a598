"""Turn the ``hierarchy`` preset's JSON lines into a Markdown table: hosts of k workers
against hosts of one.

    python -m benchmarks.bench_cluster --preset hierarchy --hierarchy both \\
        --out results/cluster_hierarchy.jsonl
    python -m benchmarks.report_hierarchy results/cluster_hierarchy.jsonl

One row per workload, codec, worker-host count and k > 1 workers per host, for the job that
aggregates on its hosts (``KVSTORE_HIERARCHY=1``):

* the payload bytes through the busiest worker host's link per step, up and down, against the
  job of the same hosts with one worker each (k = 1);
* seconds per step, against the k = 1 job, against the flat job of the same N workers
  (``KVSTORE_HIERARCHY=0``: each of the host's workers pushes and pulls on its own) and against
  gloo's fp32 allreduce of the same workers on the same hosts;
* the share of this machine's cores that were busy during the timed steps (``cpu_busy``) and
  how many cores the job's processes kept busy on average (``cpu_job x cores``): where that is
  near the core count, the cores and not the links bound the step.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks import report

Cell = tuple[str, str, int, int, bool]
"""(workload, codec, workers, workers per host, aggregated on the host)."""


def load(paths: list[str]) -> tuple[dict[Cell, dict], dict[tuple[str, int, int], dict]]:
    """(kvstore cells by :data:`Cell`, gloo fp32 cells by (workload, workers, per host)), read
    by :func:`benchmarks.report.load`; a cell measured twice keeps its last record, a failed
    one none."""
    records, baselines, _ = report.load(paths)
    kv: dict[Cell, dict] = {}
    for record in records:
        if "seconds_per_step" in record:
            k = int(record.get("workers_per_host", 1))
            aggregated = bool(record.get("hierarchy", k == 1))
            kv[(record["workload"], record["codec"], int(record["workers"]), k, aggregated)] = (
                record
            )
    gloo = {
        (r["workload"], int(r["workers"]), int(r.get("workers_per_host", 1))): r
        for r in baselines
        if r["system"] == "gloo-fp32" and "seconds_per_step" in r
    }
    return kv, gloo


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


CODEC_NAMES = {"none": "dense", "2bit-both": "2-bit both ways"}
"""How the table names the preset's codecs (others: as the records do)."""


def rows(
    kv: dict[Cell, dict], gloo: dict[tuple[str, int, int], dict], cores: int
) -> list[list[str]]:
    """The table's rows (see the module's docstring)."""
    out = []
    order = list(CODEC_NAMES)

    def place(cell: Cell) -> tuple:
        workload, codec, workers, k, _ = cell
        known = order.index(codec) if codec in order else len(order)
        return (workload, known, codec, workers // k, k)

    for cell in sorted(kv, key=place):
        workload, codec, workers, k, aggregated = cell
        if k == 1 or not aggregated:
            continue
        hosts = workers // k
        record = kv[cell]
        alone = kv.get((workload, codec, hosts, 1, True))
        flat = kv.get((workload, codec, workers, k, False))
        baseline = gloo.get((workload, workers, k))
        step = record["seconds_per_step"]
        up, down = record["host_up_bytes_per_step"], record["host_down_bytes_per_step"]
        out.append(
            [
                workload,
                CODEC_NAMES.get(codec, codec),
                f"{hosts} x {k}",
                f"{up / 1e6:.1f} / {down / 1e6:.1f} MB",
                _ratio(up, alone and alone["host_up_bytes_per_step"])
                + " / "
                + _ratio(down, alone and alone["host_down_bytes_per_step"]),
                f"{step:.3f} s",
                _ratio(step, alone and alone["seconds_per_step"]),
                f"{flat['seconds_per_step']:.3f} s" if flat else "failed",
                _ratio(step, flat and flat["seconds_per_step"]),
                f"{baseline['seconds_per_step']:.3f} s" if baseline else "-",
                _ratio(step, baseline and baseline["seconds_per_step"]),
                f"{record['cpu_busy']:.2f}, {record['cpu_job'] * cores:.2f}",
            ]
        )
    return out


HEADER = [
    "workload",
    "codec",
    "hosts x k",
    "host link up / down per step",
    "vs k = 1",
    "step",
    "vs k = 1",
    "flat job of N",
    "vs flat",
    "gloo fp32",
    "vs gloo",
    "CPU busy, job cores",
]


def markdown(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="JSON-lines files from bench_cluster.py")
    parser.add_argument(
        "--cores", type=int, default=os.cpu_count(), help="the cores of the measuring machine"
    )
    args = parser.parse_args(argv)
    kv, gloo = load(args.results)
    print(markdown(rows(kv, gloo, args.cores)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
