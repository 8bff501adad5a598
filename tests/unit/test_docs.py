"""The documentation builds, and what it states is what the code and the data say."""

from __future__ import annotations

import subprocess
import sys

from kvtest import REPO

from kvstore.envvars import ENV_VARS

DOCS = REPO / "docs"


def test_docs_build_strictly(tmp_path):
    """``mkdocs build --strict``: no broken link, no page missing from the navigation."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "performance" / "index.html").exists()


def test_cluster_grid_page_is_what_the_data_gives(tmp_path):
    table = tmp_path / "grid.md"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "report.py"),
            str(REPO / "results" / "cluster_mtu9000.jsonl"),
            "--markdown",
            str(table),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    page = (DOCS / "cluster-grid.md").read_text()
    assert page.endswith(table.read_text())


def test_every_environment_variable_is_documented_for_users_and_operators():
    readme = (REPO / "README.md").read_text()
    readme_table = readme[readme.index("| variable") :]
    operations = (DOCS / "operations.md").read_text()
    full_table = operations[operations.index("| variable") :]
    for var in ENV_VARS:
        assert f"| `{var.name}` |" in readme_table, f"README's table lacks {var.name}"
        assert f"| `{var.name}` |" in full_table, f"operations.md's table lacks {var.name}"
        assert var.meaning in full_table, f"operations.md's entry for {var.name} is stale"


def test_no_doc_cites_a_file_that_does_not_exist():
    """Paths in backticks that look like repository files (``benchmarks/x.py``) exist."""
    import re

    pattern = re.compile(r"`((?:benchmarks|examples|deploy|kvstore|server|worker|codecs|tests|"
                         r"results|docs)/[\w./-]+\.(?:py|md|jsonl|png|yaml|sbatch))`")  # fmt: skip
    for page in [REPO / "README.md", *DOCS.glob("*.md")]:
        for path in pattern.findall(page.read_text()):
            assert (REPO / path).exists(), f"{page.name} cites {path}, which does not exist"
