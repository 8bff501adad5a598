"""Turn ``bench_cluster.py`` JSON lines into a Markdown table and a PNG plot.

    python -m benchmarks.report results/cluster_mtu9000.jsonl \\
        --markdown TABLE.md --plot docs/img/cluster.png

(docs/cluster-grid.md is the table under a short introduction; a test checks it against the data.)

The table has one row per workload, workers, servers and placement: seconds per push+pull step
for each codec of the run (dense ``none``, ``2bit``, ``2bit-agg``), each next to its wire floor
and their ratio, and the gloo allreduce baselines for the same workers. A cell's note also gives
the machine's CPU use, the hypervisor's steal and other load where large, and the range of the
timed steps where they had not settled. The plot shows seconds per step as bars, each with its
floor as a black tick.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(paths: list[str]) -> tuple[list[dict], list[dict], dict]:
    """(kvstore cells, baseline cells: gloo and bare ``zmq``, the run's summary line)."""
    kv, baselines, meta = [], [], {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if "machine" in record:
                meta = record
            elif record.get("system") == "kvstore":
                kv.append(record)
            elif str(record.get("system", "")).startswith("gloo") or record.get("system") == "zmq":
                baselines.append(record)
    return kv, baselines, meta


NOTABLE_STEAL = 0.05
"""A cell's note names the hypervisor's steal from this share of the cores on."""

NOTABLE_OTHERS = 0.10
"""A cell's note names CPU use outside the job's processes from this share on (kernel network
work charged to no process of the job is usually 0.02-0.08 of the cores)."""

NOTABLE_SPREAD = 1.15
"""A cell's note gives the range of its timed steps where the slowest took this many times the
fastest: its steps had not settled (a slow TCP start, a neighbour's load), and its median is
less sure than its neighbours'."""


def _step_range(record: dict) -> str | None:
    """``"steps A-B s"`` where the cell's timed steps spread by :data:`NOTABLE_SPREAD` or more."""
    steps = record.get("step_seconds") or []
    if len(steps) < 2 or min(steps) <= 0 or max(steps) / min(steps) < NOTABLE_SPREAD:
        return None
    return f"steps {min(steps):.3f}-{max(steps):.3f} s"


def _cell(record: dict | None) -> str:
    if record is None:
        return "-"
    if "error" in record:
        return "error"
    ratio = record.get("over_floor")
    notes = [f"{ratio:.2f}x"] if ratio else []
    if record.get("cpu_busy") is not None:
        # the emulated hosts share the benchmark machine's cores: a busy machine means the
        # run measured the CPU, not the links
        notes.append(f"cpu {record['cpu_busy']:.0%}")
        # load from outside the job (other guests of the host, other processes) slows a cell
        # for reasons that are not the job's: say so where it was large enough to matter
        if record.get("cpu_steal", 0) >= NOTABLE_STEAL:
            notes.append(f"steal {record['cpu_steal']:.0%}")
        if record.get("cpu_others", 0) >= NOTABLE_OTHERS:
            notes.append(f"others {record['cpu_others']:.0%}")
    spread = _step_range(record)
    if spread:
        notes.append(spread)
    return f"{record['seconds_per_step']:.3f}" + (f" ({', '.join(notes)})" if notes else "")


CODEC_LABELS = {
    "none": "dense",
    "2bit": "2-bit",
    "2bit-agg": "2-bit agg",
}
"""Codec name -> its column title, in column order."""


def _codecs(kv: list[dict]) -> list[str]:
    present = {r["codec"] for r in kv}
    return [c for c in CODEC_LABELS if c in present] + sorted(present - set(CODEC_LABELS))


def _floor(record: dict | None) -> str:
    return f"{record['floor_seconds']:.3f}" if record and "floor_seconds" in record else "-"


def markdown(kv: list[dict], baselines: list[dict], meta: dict) -> str:
    rows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in kv:
        rows[(r["workload"], r["workers"], r["servers"], r["placement"])][r["codec"]] = r
    gloo: dict[tuple, dict[str, dict]] = defaultdict(dict)
    bare: dict[tuple, dict] = {}
    for r in baselines:
        if r["system"] == "zmq":
            bare[(r["workload"], r["workers"], r["servers"], r["placement"])] = r
            rows.setdefault((r["workload"], r["workers"], r["servers"], r["placement"]), {})
        else:
            gloo[(r["workload"], r["workers"])][r["system"]] = r
    codecs = _codecs(kv)
    header = ["workload", "workers", "servers", "placement"]
    for codec in codecs:
        label = CODEC_LABELS.get(codec, codec)
        header += [f"{label}: s/step (x floor, cpu)", f"{label} floor s"]
    if bare:  # the column only where the run measured it (``--baselines zmq``)
        header += ["bare pyzmq, dense bytes"]
    header += ["gloo fp32 allreduce", "gloo fp16 allreduce"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in sorted(rows, key=lambda k: (k[0], k[1], k[2], k[3])):
        workload, n, s, placement = key
        g = gloo.get((workload, n), {})
        cells = [workload, str(n), str(s), placement]
        for codec in codecs:
            record = rows[key].get(codec)
            cells += [_cell(record), _floor(record)]
        if bare:
            cells += [_cell(bare.get(key))]
        cells += [_cell(g.get("gloo-fp32")), _cell(g.get("gloo-fp16"))]
        lines.append("| " + " | ".join(cells) + " |")
    machine = meta.get("machine", {})
    lines.append("")
    lines.append(
        f"Measured on {machine.get('cores', '?')} cores ({machine.get('cpu', '?')}), every link "
        f"shaped to {kv[0]['rate_mbit']:.0f} Mbit/s each way, MTU {kv[0].get('mtu', '?')}, "
        f"TCP units of up to {kv[0].get('gso_max_bytes', 65536) // 1024} KiB, "
        f"TCP congestion control {kv[0].get('tcp_cc', 'the machine default')}; "
        f"median over steps of the slowest worker. Gloo's floor is its ring's "
        f"2(N-1)/N x bytes / rate. cpu: the benchmark machine's CPU use during the run "
        f"(all emulated hosts share its cores); steal: of it, time the hypervisor gave other "
        f"guests (from {NOTABLE_STEAL:.0%}); others: of it, use outside the job's processes "
        f"(from {NOTABLE_OTHERS:.0%}); steps: the fastest and slowest timed step, where the "
        f"slowest took {NOTABLE_SPREAD:g}x the fastest or more. dense and 2-bit: SGD on the "
        f"servers, weights "
        f"pulled dense; 2-bit agg: no server optimizer, the round's summed gradient pulled as "
        f"the relayed 2-bit pushes (dense from N = 9 on)."
        + (
            " bare pyzmq: processes placed like kvstore's moving the dense cell's bytes in the "
            "same chunks with nothing else (benchmarks/bare_cluster.py), against the dense "
            "floor: how close this machine gets to the floor at all."
            if bare
            else ""
        )
        if kv
        else ""
    )
    return "\n".join(lines)


def plot(kv: list[dict], baselines: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in kv})
    codecs = _codecs(kv)
    colors = ["tab:blue", "tab:orange", "tab:purple", "tab:red", "tab:brown"]
    width = 0.8 / len(codecs)
    fig, axes = plt.subplots(len(workloads), 1, figsize=(13, 4.8 * len(workloads)), squeeze=False)
    for ax, workload in zip(axes[:, 0], workloads, strict=True):
        configs = sorted(
            {(r["workers"], r["servers"], r["placement"]) for r in kv if r["workload"] == workload}
        )
        labels = [f"N{n} S{s}\n{'sep' if p == 'separate' else 'co'}" for n, s, p in configs]
        x = list(range(len(configs)))
        for j, codec in enumerate(codecs):
            offset = (j - (len(codecs) - 1) / 2) * width
            values, floors = [], []
            for n, s, p in configs:
                match = [
                    r
                    for r in kv
                    if (r["workload"], r["workers"], r["servers"], r["placement"], r["codec"])
                    == (workload, n, s, p, codec)
                    and "seconds_per_step" in r
                ]
                values.append(match[0]["seconds_per_step"] if match else float("nan"))
                floors.append(match[0]["floor_seconds"] if match else float("nan"))
            xs = [i + offset for i in x]
            ax.bar(xs, values, width=width * 0.95, color=colors[j % len(colors)],
                   label=CODEC_LABELS.get(codec, codec))  # fmt: skip
            ax.scatter(xs, floors, marker="_", s=160, color="black",
                       label="wire floor" if j == 0 else None, zorder=3)  # fmt: skip
        for system, marker in (("gloo-fp32", "v"), ("gloo-fp16", "^")):
            xs, ys = [], []
            for i, (n, s, p) in enumerate(configs):
                match = [
                    r
                    for r in baselines
                    if (r["workload"], r["workers"], r["system"]) == (workload, n, system)
                    and "seconds_per_step" in r
                ]
                if match and (s, p) == (1, "separate"):
                    xs.append(i)
                    ys.append(match[0]["seconds_per_step"])
            if xs:
                ax.scatter(xs, ys, marker=marker, color="tab:green", zorder=4, label=system)
        bare = {
            (r["workers"], r["servers"], r["placement"]): r["seconds_per_step"]
            for r in baselines
            if r["system"] == "zmq" and r["workload"] == workload and "seconds_per_step" in r
        }
        xs = [i for i, config in enumerate(configs) if config in bare]
        if xs:
            ax.scatter(xs, [bare[configs[i]] for i in xs], marker="x", color="black", zorder=4,
                       label="bare pyzmq (dense bytes)")  # fmt: skip
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("seconds per push+pull step")
        ax.set_title(f"{workload}: kvstore vs the wire floor (N workers, S servers)")
        ax.legend(fontsize=8, ncols=6)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="JSON-lines files from bench_cluster.py")
    parser.add_argument("--markdown", help="write the table here (default: print it)")
    parser.add_argument("--plot", help="write a PNG plot here")
    args = parser.parse_args(argv)
    kv, baselines, meta = load(args.results)
    table = markdown(kv, baselines, meta)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    else:
        print(table)
    if args.plot:
        plot(kv, baselines, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
