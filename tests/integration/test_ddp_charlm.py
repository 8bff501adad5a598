"""The language-model workload's DDP worker trains what the example's synchronous mode trains:
same model, shards, windows, AdamW schedule and clipping, so the two jobs' validation losses
agree to float rounding (the only difference is where the gradients are averaged)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from kvtest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = ["--layers", "1", "--width", "32", "--heads", "4", "--context", "32"]
SCHEDULE = ["--steps", "6", "--eval-every", "3", "--warmup", "2", "--val-windows", "8"]


def _finish(processes: list[subprocess.Popen], what: str) -> list[str]:
    """Every process's output once it exited 0 (killed, and the test failed, after 300 s)."""
    outputs = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in processes:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
                other.communicate()
            pytest.fail(f"the {what} did not finish in 300 s")
        assert process.returncode == 0, f"{what}:\n{output}"
        outputs.append(output)
    return outputs


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_ddp_worker_trains_the_language_model_as_the_examples_sync_mode(tmp_path):
    pytest.importorskip("torch")
    master = f"127.0.0.1:{_free_port()}"
    worker = [sys.executable, "-m", "benchmarks.ddp_charlm", "--master", master]
    ranks = [
        _start([*worker, "--rank", str(rank), "--num-workers", "2", *TINY, *SCHEDULE])
        for rank in range(2)
    ]
    lead, _ = _finish(ranks, "DDP job")
    ddp = [json.loads(line) for line in lead.splitlines() if line.startswith("{")]

    out = tmp_path / "sync.jsonl"
    launcher = [sys.executable, "-m", "kvstore.deploy", "-n", "2", "-s", "1", "--"]
    example = [sys.executable, str(REPO / "examples/charlm/train.py"), "--mode", "sync"]
    (_output,) = _finish(
        [_start([*launcher, *example, *TINY, *SCHEDULE, "--json", str(out)])],
        "example's sync job",
    )
    sync = [json.loads(line) for line in out.read_text().splitlines()]

    assert [r["step"] for r in ddp] == [r["step"] for r in sync] == [3, 6]
    for mine, theirs in zip(ddp, sync, strict=True):
        assert mine["samples"] == theirs["samples"]
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)
        assert isinstance(mine["seconds"], float)  # reported; its value is not bound
    assert ddp[-1]["val_loss"] < ddp[0]["val_loss"]
