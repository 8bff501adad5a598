"""kvstore-launch --launcher slurm, end to end through a stand-in srun that runs steps here."""

from __future__ import annotations

import json
import os
import sys

import pytest
from kvtest import kill_a_launched_server, launch

pytestmark = pytest.mark.integration

PY = sys.executable

# Records its options and command to a file of its own, then becomes the command (as srun's
# task would be), in the --chdir directory. Every option the backend gives is --name[=value].
STAND_IN_SRUN = """#!{python}
import json, os, sys
args = sys.argv[1:]
options = []
while args and args[0].startswith("-"):
    options.append(args.pop(0))
with open(os.path.join({records!r}, f"{{os.getpid()}}.json"), "w") as record:
    json.dump({{"options": options, "argv": args, "rank": os.environ.get("KVSTORE_RANK")}}, record)
for option in options:
    if option.startswith("--chdir="):
        os.chdir(option.split("=", 1)[1])
os.execvp(args[0], args)
"""

WORKER = (
    "import os, numpy as np, kvstore\n"
    "kv = kvstore.create('dist_sync')\n"
    "kv.init('w', np.zeros(4, np.float32)); kv.push('w', np.ones(4, np.float32))\n"
    "out = np.empty(4, np.float32); kv.pull('w', out=out)\n"
    "print('sum', out[0], os.environ['KVSTORE_SERVERS'], os.getcwd()); kv.close()\n"
)


@pytest.fixture
def slurm_env(tmp_path):
    """A fake allocation: a stand-in srun first on PATH and Slurm's variables.

    The two "nodes" are names of this machine: servers bind 127.0.0.1 (``--host``), and
    workers reach them by node name, as they would on a cluster.
    """
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(STAND_IN_SRUN.format(python=PY, records=str(records)))
    srun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "KVSTORE_"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        SLURM_JOB_NODELIST="127.0.0.[1],localhost",
        SLURM_JOB_ID="4242",
    )
    return env, records


def test_a_job_runs_through_srun_on_the_allocations_nodes(slurm_env, tmp_path):
    env, records = slurm_env
    workdir = tmp_path / "work"
    workdir.mkdir()
    result = launch(
        "--launcher", "slurm", "--host", "127.0.0.1", "-n", "3", "-s", "2",
        "--", PY, "-c", WORKER, env=env, cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    servers = "tcp://127.0.0.1:{},tcp://localhost:{}"
    for rank in range(3):
        prefix = f"[worker {rank}] sum "
        line = next(x for x in result.stdout.splitlines() if x.startswith(prefix))
        total, addresses, cwd = line.removeprefix(prefix).split()
        assert total == "3.0" and cwd == str(workdir)
        host_port = [a.rsplit(":", 1) for a in addresses.split(",")]
        assert addresses == servers.format(host_port[0][1], host_port[1][1])
    assert "slurm job 4242, 2 node(s): servers on 127.0.0.1 localhost; " in result.stderr
    assert "workers on 127.0.0.1 localhost 127.0.0.1" in result.stderr

    steps = {}
    for path in records.iterdir():
        record = json.loads(path.read_text())
        options = dict(o.split("=", 1) if "=" in o else (o, None) for o in record["options"])
        steps[options["--job-name"]] = (options, record)
    assert sorted(steps) == [
        "kvstore-server-0",
        "kvstore-server-1",
        "kvstore-worker-0",
        "kvstore-worker-1",
        "kvstore-worker-2",
    ]
    nodes = {name: options["--nodelist"] for name, (options, _) in steps.items()}
    assert nodes == {
        "kvstore-server-0": "127.0.0.1",
        "kvstore-server-1": "localhost",
        "kvstore-worker-0": "127.0.0.1",  # workers follow the servers, cycling
        "kvstore-worker-1": "localhost",
        "kvstore-worker-2": "127.0.0.1",
    }
    for name, (options, record) in steps.items():
        assert options["--nodes"] == "1" and options["--ntasks"] == "1"
        assert "--overlap" in options and options["--export"] == "ALL"
        assert options["--chdir"] == str(workdir)
        if name.startswith("kvstore-server"):
            assert record["argv"][:5] == [PY, "-m", "kvstore.server", "--host", "127.0.0.1"]
            assert "--num-workers" in record["argv"] and record["rank"] is None
        else:
            assert record["argv"][:2] == [PY, "-c"]
            assert record["rank"] == name.rsplit("-", 1)[1]  # in the environment srun exports


def test_a_failing_step_fails_the_job(slurm_env, tmp_path):
    env, _ = slurm_env
    code = "import os, sys; sys.exit(4 if os.environ['KVSTORE_RANK'] == '1' else 0)"
    result = launch("--launcher", "slurm", "--host", "127.0.0.1", "-n", "2", "-s", "1",
                    "--", PY, "-c", code, env=env, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 4, result.stderr
    assert "worker 1 exited with code 4" in result.stderr


def test_outside_an_allocation_or_without_srun(slurm_env, tmp_path):
    env, _ = slurm_env
    outside = {k: v for k, v in env.items() if k != "SLURM_JOB_NODELIST"}
    result = launch("--launcher", "slurm", "-n", "1", "--", "true", env=outside, cwd=tmp_path)
    assert result.returncode == 2
    assert "inside a Slurm allocation" in result.stderr and "SLURM_JOB_NODELIST" in result.stderr
    no_srun = {**env, "PATH": str(tmp_path)}
    result = launch("--launcher", "slurm", "-n", "1", "--", "true", env=no_srun, cwd=tmp_path)
    assert result.returncode == 2 and "needs srun, which is not on PATH" in result.stderr
    result = launch("--launcher", "slurm", "-H", "hosts", "-n", "1", "--", "true", env=env,
                    cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2 and "-H is for --launcher ssh" in result.stderr


def test_a_server_step_is_restarted_on_its_node(slurm_env, tmp_path):
    """A server killed during the job comes back as a new srun step of the same name on the
    same node, on its port, with KVSTORE_SERVERS; the workers reach it at the same address."""
    env, records = slurm_env
    restart = kill_a_launched_server(
        ["--launcher", "slurm", "--host", "127.0.0.1", "-n", "1", "-s", "2", "--replicas", "2",
         "--restart-servers"],
        tmp_path,
        env=env,
    )  # fmt: skip
    assert restart.returncode == 0, restart.stderr
    address = restart.servers[1]
    assert address.startswith("tcp://localhost:")  # by node name, as workers reach it
    port = address.rsplit(":", 1)[1]
    servers = ",".join(restart.servers)
    assert f"[worker 0] replicas 2 servers {servers}" in restart.stdout
    assert restart.after.env["KVSTORE_SERVERS"] == servers
    assert restart.after.env["KVSTORE_REPLICAS"] == "2"
    assert f"restarting it on node localhost at {address}" in restart.stderr
    assert f"server 1 rejoined at {address}" in restart.stderr

    steps = [json.loads(path.read_text()) for path in records.iterdir()]
    server_1 = [r for r in steps if "--job-name=kvstore-server-1" in r["options"]]
    assert len(server_1) == 2  # the first step and the replacement
    assert all("--nodelist=localhost" in r["options"] for r in server_1)
    ports = sorted(r["argv"][r["argv"].index("--port") + 1] for r in server_1)
    assert ports == ["0", port]
