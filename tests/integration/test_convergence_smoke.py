"""The convergence harness's smoke preset: two short MNIST jobs under kvstore-launch (dense and
2-bit), their JSON lines, the markdown table and the plot (no accuracy or timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvtest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_convergence_smoke_preset_reports_every_run(tmp_path):
    for module in ("torch", "mlxtend", "matplotlib"):
        pytest.importorskip(module)
    table, plot = tmp_path / "convergence.md", tmp_path / "convergence.png"
    command = [sys.executable, "-m", "benchmarks.convergence", "--preset", "smoke"]
    result = subprocess.run(
        [*command, "--table", str(table), "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]

    epochs = [r for r in records if "epoch" in r]
    assert [(r["run"], r["epoch"], r["seed"]) for r in epochs] == [("none", 1, 0), ("2bit", 1, 0)]
    for record in epochs:
        assert 0.0 <= record["accuracy"] <= 1.0 and record["loss"] > 0
        assert record["workers"] == 2 and record["servers"] == 1 and record["model"] == "mlp"
        assert record["pushed_bytes"] == record["pushed_bytes_total"] > 0
    dense, twobit = epochs
    assert dense["raw_bytes"] == twobit["raw_bytes"]  # the same gradients' worth of values
    assert 0.99 < dense["density"] < 1.01  # headers only
    assert twobit["density"] < 0.1  # 2 bits of 32, plus headers

    summaries = {r["run"]: r for r in records if "seeds_done" in r}
    assert set(summaries) == {"none", "2bit"}
    assert all(s["seeds_done"] == 1 and s["seeds_failed"] == 0 for s in summaries.values())
    assert "machine" in records[-1]

    rows = [line for line in table.read_text().splitlines() if line.startswith("| `")]
    assert [row.split("|")[1].strip() for row in rows] == ["`none`", "`2bit`"]
    assert rows[0].split("|")[5].strip() == "+0.00"  # the dense run against itself

    data = plot.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data.endswith(b"IEND\xaeB`\x82")

    # --from rebuilds the same table from the printed lines, without training
    printed = tmp_path / "printed.jsonl"
    printed.write_text(result.stdout)
    rebuilt = tmp_path / "rebuilt.md"
    subprocess.run(
        [*command[:3], "--from", str(printed), "--table", str(rebuilt)],
        check=True,
        timeout=60,
        cwd=REPO,
    )
    assert rebuilt.read_text() == table.read_text()
