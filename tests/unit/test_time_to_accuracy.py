"""The time-to-accuracy harness's bookkeeping, on made-up reports (no run, no clock): how
worker 0's reports become records, when a run is at its target, what its summary and table
say, for both workloads."""

from __future__ import annotations

import json
import os
import time

import pytest

from benchmarks.time_to_accuracy import (
    NO_REPORT,
    last_words,
    lines_until,
    main,
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
    assert rows[0].startswith("| Mbit/s | run | servers | epochs | seconds to 97% | final")
    dense = next(row for row in rows if "| ps-dense |" in row)
    assert "| ps-dense | colocated |" in dense  # where the parameter server's servers ran
    assert "| 2.00x | 2.00x (ddp-fp32) |" in dense  # DDP's time over the dense run's
    assert rows[-1].startswith("| 10 | hivemind-uint8 | - | did not train: RuntimeError: cannot")
    assert rows[-1].count("|") == rows[0].count("|")  # a whole row (its "|" made "/")
    assert last_words("") == "no output"


def test_runs_not_trained_on_free_links_get_the_workload_s_compute_floor():
    runs = {("ps-2bit", 10.0): _records("ps-2bit", [(1, 0.9, 5.0), (2, 0.95, 9.0), (3, 0.97, 12.0)],
                                        "accuracy"),
            ("diloco", 10.0): _records("diloco", [(1, 0.97, 4.0)], "accuracy")}  # fmt: skip
    floors = {"diloco": _records("diloco", [(1, 0.9, 2.0), (2, 0.97, 4.0)], "accuracy"),
              "ddp-fp32": _records("ddp-fp32", [(1, 0.9, 3.0)], "accuracy")}  # fmt: skip
    ps, diloco = summaries(runs, 0.97, floors)
    # the cheapest run per report on free links is the compute floor: 2 s an epoch, 3 needed
    assert (ps["floor_from"], ps["floor_seconds"], ps["over_floor"]) == ("diloco", 6.0, 2.0)
    assert (diloco["floor_from"], diloco["floor_seconds"]) == ("diloco", 2.0)  # its own


def test_a_run_with_no_report_before_its_timeout_keeps_a_row_saying_so(tmp_path):
    runs = {("diloco", 10.0): _records("diloco", [(1, 0.97, 4.0)], "accuracy")}
    table = tmp_path / "t.md"
    failed = {("hivemind-fp16", 10.0): f"{NO_REPORT} 150 s timeout"}
    write_table(table, summaries(runs, 0.97), 0.97, failed)
    row = table.read_text().splitlines()[-1]
    assert row.startswith("| 10 | hivemind-fp16 | - | no report within the 150 s timeout |")


def test_lines_stop_at_the_deadline_when_the_stream_falls_silent():
    read, write = os.pipe()
    with os.fdopen(read) as stream:
        with os.fdopen(write, "w") as writer:
            writer.write("first\n")
            writer.flush()
            lines = lines_until(stream, time.monotonic() + 0.3)
            assert next(lines) == "first\n"
            assert next(lines) is None  # nothing more came before the deadline
        time.sleep(0.1)  # the writer is gone: the reader thread ends at the stream's end


def test_lines_end_with_the_stream_before_the_deadline():
    read, write = os.pipe()
    with os.fdopen(read) as stream:
        with os.fdopen(write, "w") as writer:
            writer.write("a\nb\n")
        assert list(lines_until(stream, time.monotonic() + 60)) == ["a\n", "b\n"]


def test_a_run_that_did_not_get_there_says_how_far_it_got(tmp_path):
    records = _records("ps-2bit", [(1, 0.8, 40.0), (2, 0.9, 80.0)], "accuracy")
    for record, sent in zip(records, (5e6, 9e6), strict=True):
        record["sent_bytes_per_host"] = sent
    table = tmp_path / "t.md"
    write_table(table, summaries({("ps-2bit", 10.0): records}, 0.97), 0.97)
    row = table.read_text().splitlines()[-1]
    assert row.startswith("| 10 | ps-2bit | colocated | 2 done | not reached | 90.00% | 9.0 |")


def test_tables_are_rebuilt_for_the_rates_asked_for(tmp_path):
    lines = [{"bench": "time_to_accuracy", "preset": "full", "workers": 4, "model": "cnn",
              "rates_mbit": [10.0, 100.0]}]  # fmt: skip
    for rate, accuracy in ((10.0, 0.95), (100.0, 0.98), (0.0, 0.98)):
        lines.append({"run": "diloco", "system": "kvstore", "rate_mbit": rate, "epoch": 1,
                      "accuracy": accuracy, "seconds": 5.0, "wall": 5.0})  # fmt: skip
    source = tmp_path / "runs.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    table = tmp_path / "t.md"
    main(["--from", str(source), "--rates", "100", "--table", str(table)])
    rows = table.read_text().splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith("| 100 | diloco | colocated | 1 | 5.0 |")
    assert rows[0].endswith("| 1.00x |")  # the floor at rate 0 is kept
