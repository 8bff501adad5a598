"""Every code block of the README runs, as a user would run it, so the README cannot rot.

``python`` blocks are worker scripts: each runs under ``kvstore-launch`` (2 workers, 2 servers),
the torch training loop through ``kvstore.torch`` among them.
``bash`` blocks run in the repository root with bash; a fixed server port in a block is swapped
for a free one. The two quickstart commands start with the install step, which the test suite
cannot repeat inside itself: their install step must be the one ``.ci/run`` runs and name only
extras that exist, and the rest of the first one (the main job) runs. The second one is the
test suite itself, which ``.ci/run`` runs. The one ``text`` block is output, not code: the
quickstart's output, compared with what the main job prints (its first line, and the traffic
that each worker's last line reports, which does not depend on float rounding).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tomllib

import pytest
from kvtest import REPO

pytestmark = pytest.mark.integration

TRAFFIC = re.compile(r"pushed ([\d.]+) MB \(compression ([\d.]+)x\), pulled ([\d.]+) MB$")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
INSTALL = re.compile(r'^pip install torch==[\d.]+ -e "\.\[([\w,]+)\]"$')
README = (REPO / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return [code for lang, code in BLOCK.findall(README) if lang == language]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(command: list[str], timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Run in the repository root in a session of its own; on a time-out kill that session."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{command} did not finish in {timeout} s:\n{output}")
    return subprocess.CompletedProcess(command, process.returncode, output)


def test_every_block_is_python_bash_or_output():
    languages = [lang for lang, _ in BLOCK.findall(README)]
    assert languages, "the README has no code blocks"
    assert set(languages) <= {"python", "bash", "text"}, languages
    assert languages.count("text") == 1, "only the quickstart's output is compared with a run"


def quickstart() -> tuple[str, str]:
    install_first = [b.strip() for b in blocks("bash") if b.startswith("pip install")]
    assert len(install_first) == 2, "the quickstart is two commands"
    return install_first[0], install_first[1]


def test_quickstart_installs_what_ci_installs():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    main_job, test_suite = quickstart()
    for command in (main_job, test_suite):
        install = command.split(" && ")[0]
        match = INSTALL.match(install)
        assert match, f"unexpected install step: {install}"
        assert set(match.group(1).split(",")) <= set(extras), install
    ci = (REPO / ".ci" / "run").read_text()
    install, tests = test_suite.split(" && ")
    assert f"\n{install}\n" in ci, ".ci/run must install what the README's test command does"
    assert tests == "python3 -m pytest -n 2 tests"
    assert re.search(r"^python3 -m pytest -n 2 tests\b", ci, re.MULTILINE)


def test_quickstart_main_job_prints_what_the_readme_shows():
    main_job, _ = quickstart()
    result = run(["bash", "-c", main_job.split(" && ", 1)[1]])
    assert result.returncode == 0, result.stdout
    shown = blocks("text")[0].splitlines()
    printed = result.stdout.splitlines()
    assert shown[0] in printed, f"the first line differs:\n{result.stdout}"
    for rank in (0, 1):
        prefix = f"[worker {rank}] rank {rank} done"
        done = [line for line in printed if line.startswith(prefix)]
        assert len(done) == 1, result.stdout
        accuracy = float(re.search(r"test accuracy ([\d.]+)%", done[0]).group(1))
        assert accuracy > 85.0, done[0]
        # Megabytes to 0.01 MB: a message header's request id takes 1 to 3 bytes, and the
        # heartbeats' pings take ids at times of their own, so a byte count varies by a few.
        (line,) = [line for line in shown if line.startswith(prefix)]
        (pushed, ratio, pulled), (job_pushed, job_ratio, job_pulled) = (
            TRAFFIC.search(text).groups() for text in (line, done[0])
        )
        assert job_ratio == ratio, f"README: {line}\nprinted: {done[0]}"
        for megabytes, expected in ((job_pushed, pushed), (job_pulled, pulled)):
            assert float(megabytes) == pytest.approx(float(expected), abs=0.0101), done[0]


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs_as_a_worker_script(index, tmp_path):
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(blocks("python")[index])
    launch = [sys.executable, "-m", "kvstore.deploy", "-n", "2", "-s", "2"]
    result = run([*launch, "--", sys.executable, str(script)])
    assert result.returncode == 0, result.stdout
    assert "[worker 1]" in result.stdout


def other_bash_blocks() -> list[str]:
    return [b for b in blocks("bash") if not b.startswith("pip install")]


@pytest.mark.parametrize("index", range(len(other_bash_blocks())))
def test_bash_block_runs(index):
    code = other_bash_blocks()[index]
    code = re.sub(r"\b9100\b", str(free_port()), code)
    result = run(["bash", "-euo", "pipefail", "-c", code])
    assert result.returncode == 0, result.stdout
    assert "rank 0 done" in result.stdout
