"""Every code block of the README runs, as a user would run it, so the README cannot rot.

``python`` blocks are worker scripts: each runs under ``kvstore-launch`` (2 workers, 2 servers),
the torch training loop through ``kvstore.torch`` among them.
``bash`` blocks run in the repository root with bash; a fixed server port in a block is swapped
for a free one. The two quickstart commands start with the install step, which the test suite
cannot repeat inside itself: their install step must be the one ``.ci/run`` runs and name only
extras that exist, and the rest of the first one (the main job) runs. The second one is the
test suite itself, which ``.ci/run`` runs. The one ``text`` block is output, not code: the
quickstart's output, compared line by line with what the main job prints on a fresh install.
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

import kvstore

pytestmark = pytest.mark.integration

SECONDS = re.compile(r"  \(\d+\.\d s\)$")
"""An epoch line's time, which the comparison leaves out."""
ROUNDED = re.compile(r"(loss |test accuracy )[\d.]+")
"""Figures that depend on how the CPU's vector instructions round torch's matrix products."""
EPOCH = re.compile(r"^\[worker 0\] epoch (\d+):")
REFERENCE_CPU = re.compile(r"where torch runs its (\w+) kernels")
COMPILE_NOTICE = re.compile(r"`(compiling the numba kernels[^`]*)`")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
INSTALL = re.compile(r'^pip install torch==[\d.]+ -e "\.\[([\w,]+)\]"$')
README = (REPO / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return [code for lang, code in BLOCK.findall(README) if lang == language]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(
    command: list[str],
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    stderr: int = subprocess.STDOUT,
) -> subprocess.CompletedProcess:
    """Run in the repository root in a session of its own, with ``env`` added to this
    process's environment; on a time-out kill that session. stderr goes to stdout unless
    ``stderr`` is ``subprocess.PIPE``."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    try:
        output, errors = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, errors = process.communicate()
        pytest.fail(f"{command} did not finish in {timeout} s:\n{output}{errors or ''}")
    return subprocess.CompletedProcess(command, process.returncode, output, errors)


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


def rounds_as_the_readme_says() -> bool:
    """Whether this machine computes the README's losses and accuracies bit for bit: the torch
    release its install step pins, running the vector kernels (torch's CPU capability) that the
    README names."""
    import torch

    (pin,) = re.findall(r"torch==([\d.]+)", quickstart()[0])
    (capability,) = REFERENCE_CPU.findall(" ".join(README.split()))
    release = torch.__version__.split("+")[0]
    return release == pin and torch.backends.cpu.get_cpu_capability() == capability


def comparable(line: str, exact: bool) -> str:
    """A line of output without its epoch's seconds and, unless ``exact``, its losses and
    accuracies."""
    line = SECONDS.sub("", line)
    return line if exact else ROUNDED.sub(r"\1#", line)


def epoch_of(line: str) -> int | None:
    """The epoch of one of worker 0's epoch lines; None for other lines."""
    match = EPOCH.match(line)
    return int(match.group(1)) if match else None


def by_process(lines: list[str]) -> dict[str, list[str]]:
    """Lines by the ``[worker R]`` prefix the launcher gives them (each process's in its order:
    two processes' lines interleave as they come)."""
    grouped: dict[str, list[str]] = {}
    for line in lines:
        grouped.setdefault(line.split("]")[0] + "]", []).append(line)
    return grouped


def test_quickstart_main_job_prints_what_the_readme_shows(tmp_path):
    """The main job, run as the README gives it on a fresh install (numba's cache empty), prints
    the README's sample on stdout: every line but the epochs' seconds, and the epochs that
    "..." stands for, nothing else. Worker 0 says once on stderr, in the README's words, that it
    compiles the kernels."""
    main_job, _ = quickstart()
    result = run(
        ["bash", "-c", main_job.split(" && ", 1)[1]],
        timeout=280.0,  # less than pytest's limit of a test, so that a hang shows the output
        env={"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")},  # what a fresh install has
        stderr=subprocess.PIPE,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    exact = rounds_as_the_readme_says()
    shown = [comparable(line, exact) for line in blocks("text")[0].splitlines()]
    printed = [comparable(line, exact) for line in result.stdout.splitlines()]
    # "..." stands for worker 0's epochs between the one above it and the one below it.
    gap = shown.index("...")
    before, after = epoch_of(shown[gap - 1]) or 0, epoch_of(shown[gap + 1]) or 0
    elided = [line for line in printed if before < (epoch_of(line) or 0) < after]
    assert [epoch_of(line) for line in elided] == list(range(before + 1, after)), result.stdout
    kept = [line for line in printed if line not in elided]
    assert by_process(kept) == by_process(shown[:gap] + shown[gap + 1 :]), result.stdout

    notices = [line for line in result.stderr.splitlines() if "compiling the numba" in line]
    assert len(notices) == 1 and notices[0].startswith("[worker 0] "), result.stderr
    (words,) = COMPILE_NOTICE.findall(README)
    assert " ".join(words.split()) in notices[0]


def test_troubleshooting_config_error_is_what_a_store_without_the_variables_raises(monkeypatch):
    (message,) = re.findall(r"^\| `ConfigError: ([^`]+)` \|", README, re.MULTILINE)
    for name in list(os.environ):
        if name.startswith("KVSTORE_") or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    with pytest.raises(kvstore.ConfigError, match=f"^{re.escape(message)}"):
        kvstore.create("dist_sync")


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
