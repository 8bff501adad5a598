"""kvstore-launch --launcher slurm and deploy/slurm/job.sbatch on a real Slurm.

Runs where Slurm and MUNGE are installed and the tests run as root (slurmd needs it): a module
fixture starts a one-host cluster of its own with ``deploy/slurm/one-host-slurm.sh`` (free
ports, its own MUNGE socket) and stops it by its daemons' pid files. Skipped otherwise, with the
reason. What a user sees is checked in the job's log: a successful job ends without a line
from srun or slurmstepd (no "forcing job termination", no CANCELLED step, no killed task),
because the launcher stops its servers through their own shutdown.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]
ONE_HOST_SLURM = REPO / "deploy" / "slurm" / "one-host-slurm.sh"
SLURM_NOISE = re.compile(r"srun: |slurmstepd|CANCELLED|forcing job termination|Killed|error", re.I)

WORKER = (
    "import os, numpy as np, kvstore\n"
    "kv = kvstore.create('dist_sync')\n"
    "kv.init('w', np.zeros(4, np.float32)); kv.push('w', np.ones(4, np.float32))\n"
    "out = np.empty(4, np.float32); kv.pull('w', out=out)\n"
    "print('sum', out[0], os.environ['KVSTORE_SERVERS']); kv.close()\n"
)


def _why_no_slurm() -> str | None:
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd runs as root, and these tests do not"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment of a user of a running one-host Slurm (``SLURM_CONF`` set)."""
    why = _why_no_slurm()
    if why:
        pytest.skip(f"no real Slurm here: {why}")
    directory = tmp_path_factory.mktemp("one-host-slurm")
    started = subprocess.run(
        ["bash", str(ONE_HOST_SLURM), "start", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert started.returncode == 0, started.stderr
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "KVSTORE_"))}
        env.update(SLURM_CONF=str(directory / "slurm.conf"), KVSTORE_LOG_LEVEL="INFO")
        yield env
    finally:
        subprocess.run(["bash", str(ONE_HOST_SLURM), "stop", str(directory)], timeout=60)


def _sbatch(env: dict[str, str], cwd: Path, log: Path, *args: str) -> tuple[int, str]:
    """``sbatch --wait`` (its exit status is the job's) on one node; the job's log."""
    result = subprocess.run(
        ["sbatch", "--wait", "--nodes=1", f"--output={log}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result.returncode, log.read_text() if log.exists() else result.stderr


def test_the_launchers_steps_run_and_end_cleanly_under_real_srun(slurm, tmp_path):
    command = f'exec {PY} -m kvstore.deploy --launcher slurm -n 2 -s 2 -- {PY} -c "$WORKER"'
    code, log = _sbatch({**slurm, "WORKER": WORKER}, tmp_path, tmp_path / "job.out",
                        "--wrap", command)  # fmt: skip
    assert code == 0, log
    host = socket.gethostname()
    sums = [line for line in log.splitlines() if " sum " in line]
    assert len(sums) == 2 and all(line.split()[3] == "2.0" for line in sums), log
    addresses = sums[0].split()[4].split(",")
    assert [a.rsplit(":", 1)[0] for a in addresses] == [f"tcp://{host}"] * 2  # node names
    for rank, address in enumerate(addresses):  # what each server logs is what workers use
        assert f"server {rank}/2 serving 2 worker(s) on {address} (every interface)" in log
    assert log.count("the launcher asked this server to stop") == 2, log
    assert not [line for line in log.splitlines() if SLURM_NOISE.search(line)], log


def test_the_shipped_batch_script_runs_unedited_on_a_small_node(slurm, tmp_path):
    """`deploy/slurm/job.sbatch` as shipped asks for whole nodes, not a CPU count, so it starts
    on this one (2 CPUs will do); arguments after the script reach the training script."""
    for module in ("torch", "mlxtend"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the example needs {module} (the torch and examples extras)")
    script = REPO / "deploy" / "slurm" / "job.sbatch"
    code, log = _sbatch(slurm, REPO, tmp_path / "job.out", str(script), "--epochs", "1")
    assert code == 0, log
    assert re.search(r"\[worker 0\] epoch 1: loss \d", log), log
    for rank in range(4):
        assert f"[worker {rank}] rank {rank} done" in log, log
    assert log.count("the launcher asked this server to stop") == 2, log
    assert not [line for line in log.splitlines() if SLURM_NOISE.search(line)], log
