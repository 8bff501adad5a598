"""The time-to-accuracy harness's bookkeeping, on made-up reports (no run, no clock): how
worker 0's reports become records, when a run is at its target, what its summary and table
say, for both workloads."""

from __future__ import annotations

import json

import pytest

from benchmarks.time_to_accuracy import (
    last_words,
    progress_record,
    reached,
    report_point,
    summaries,
    write_table,
)


def _records(run: str, points: list[tuple[int, float, float]], metric: str) -> list[dict]:
    """A run's records from (report number, quality, wall) triples."""
    unit = "epoch" if metric == "accuracy" else "step"
    return [{"run": run, "system": "kvstore", unit: n, metric: q, "wall": w} for n, q, w in points]


def test_mnist_epochs_add_their_own_seconds_and_a_first_report_is_its_whole_wall():
    first, wall = report_point({"epoch": 1, "accuracy": 0.9, "seconds": 2.5}, 0.0)
    assert first == {"epoch": 1, "accuracy": 0.9, "seconds": 2.5} and wall == 2.5
    second, wall = report_point({"epoch": 2, "accuracy": 0.95, "seconds": 1.5}, wall)
    assert second["seconds"] == 1.5 and wall == 4.0


def test_language_model_reports_count_from_the_start_of_training():
    first, wall = report_point({"step": 25, "perplexity": 30.0, "seconds": 4.0}, 0.0)
    assert first == {"step": 25, "perplexity": 30.0, "seconds": 4.0} and wall == 4.0
    second, wall = report_point({"step": 50, "perplexity": 20.0, "seconds": 10.0}, wall)
    assert second["seconds"] == 6.0 and wall == 10.0  # the report's own share


def test_reports_are_read_from_either_worker_and_nothing_else():
    epoch = {"epoch": 1, "loss": 0.5, "accuracy": 0.9, "seconds": 1.0}
    evaluation = {"step": 25, "val_loss": 3.0, "perplexity": 20.1, "seconds": 4.0}
    assert progress_record(json.dumps(epoch)) == epoch
    assert progress_record(json.dumps(evaluation)) == evaluation
    assert progress_record('{"bench": "other"}') is None
    assert progress_record("step 25: loss 3.1") is None


def test_accuracy_is_reached_from_below_and_perplexity_from_above():
    assert reached({"accuracy": 0.97}, 0.97) and not reached({"accuracy": 0.969}, 0.97)
    assert reached({"perplexity": 14.0}, 14.0) and not reached({"perplexity": 14.1}, 14.0)


def test_summary_floor_and_table_of_a_language_model_run():
    runs = {
        ("lm-ps-sync", 100.0): _records("lm-ps-sync", [(25, 30.0, 5.0), (50, 13.0, 9.0)],
                                        "perplexity"),
        ("lm-ddp-fp32", 100.0): _records("lm-ddp-fp32", [(25, 31.0, 8.0), (50, 15.0, 16.0)],
                                         "perplexity"),
    }  # fmt: skip
    for record in runs["lm-ddp-fp32", 100.0]:
        record["system"] = "ddp"
    floors = {"lm-ps-sync": _records("lm-ps-sync", [(25, 30.0, 2.0), (50, 13.0, 4.0)],
                                     "perplexity")}  # fmt: skip
    ps, ddp = summaries(runs, 14.0, floors)
    assert (ps["metric"], ps["to_target"], ps["seconds_to_target"]) == ("perplexity", 50, 9.0)
    # the floor: seconds per report on free links times the reports needed here
    assert ps["floor_seconds"] == 4.0 and ps["over_floor"] == pytest.approx(9.0 / 4.0, abs=0.01)
    assert ddp["seconds_to_target"] is None and ddp["final_quality"] == 15.0


def test_table_compares_at_the_same_rate_and_keeps_the_runs_that_did_not_train(tmp_path):
    runs = {
        ("ps-dense", 10.0): _records("ps-dense", [(1, 0.98, 40.0)], "accuracy"),
        ("ddp-fp32", 10.0): _records("ddp-fp32", [(1, 0.98, 80.0)], "accuracy"),
    }
    runs["ddp-fp32", 10.0][0]["system"] = "ddp"
    table = tmp_path / "t.md"
    failed = {("hivemind-uint8", 10.0): "Traceback ...\nRuntimeError: cannot decode | here\n"}
    write_table(table, summaries(runs, 0.97), 0.97, failed)
    rows = table.read_text().splitlines()
    assert rows[0].startswith("| Mbit/s | run | epochs | seconds to 97% | final accuracy |")
    dense = next(row for row in rows if "| ps-dense |" in row)
    assert "| 2.00x | 2.00x (ddp-fp32) |" in dense  # DDP's time over the dense run's
    assert rows[-1].startswith("| 10 | hivemind-uint8 | did not train: RuntimeError: cannot")
    assert rows[-1].count("|") == rows[0].count("|")  # a whole row (its "|" made "/")
    assert last_words("") == "no output"
