"""The hierarchy table compares each aggregated cell with the same hosts of one worker, the
flat job of the same N and gloo on the same hosts (benchmarks/report_hierarchy.py)."""

from __future__ import annotations

import json

from benchmarks.report_hierarchy import load, markdown, rows


def _kv(workers: int, k: int, aggregated: bool, step: float, up: int, cpu_job: float = 0.25):
    record = {
        "bench": "cluster",
        "system": "kvstore",
        "workload": "key10m",
        "codec": "none",
        "workers": workers,
        "seconds_per_step": step,
        "host_up_bytes_per_step": up,
        "host_down_bytes_per_step": up // 2,
        "cpu_busy": 0.5,
        "cpu_job": cpu_job,
    }
    if k > 1:
        record |= {"workers_per_host": k, "hierarchy": aggregated}
    return record


def test_each_aggregated_cell_is_compared_with_its_three_references(tmp_path):
    path = tmp_path / "hierarchy.jsonl"
    records = [
        _kv(2, 1, True, 1.0, 40_000_000),  # 2 hosts of one worker
        _kv(4, 2, False, 2.0, 80_000_000),  # the flat job of 4 on 2 hosts
        _kv(4, 2, True, 1.1, 40_000_000),
        {
            "system": "gloo-fp32",
            "workload": "key10m",
            "workers": 4,
            "workers_per_host": 2,
            "seconds_per_step": 0.5,
        },
        {
            "system": "kvstore",
            "workload": "key10m",
            "codec": "none",
            "workers": 8,
            "workers_per_host": 4,
            "hierarchy": True,
            "error": "lost",
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    table = rows(*load([str(path)]), cores=2)
    assert table == [
        [
            "key10m",
            "dense",
            "2 x 2",
            "40.0 / 20.0 MB",
            "1.00x / 1.00x",
            "1.100 s",
            "1.10x",
            "2.000 s",
            "0.55x",
            "0.500 s",
            "2.20x",
            "0.50, 0.50",
        ]
    ]
    assert markdown(table).count("\n") == 2  # a header, its rule and the row
