"""kvstore-launch: starts, forwards, propagates the first failure, and never hangs."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kvtest import kill_a_launched_server

from kvstore.auth import AUTH_VARS
from kvstore.deploy import LocalBackend, SSHBackend, Supervisor
from kvstore.deploy.backends import ChildCommand, read_hostfile

pytestmark = pytest.mark.integration

PY = sys.executable


def launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "kvstore.deploy", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_success_sets_the_environment_and_prefixes_output():
    code = (
        "import os, sys, kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "print('hello', os.environ['KVSTORE_RANK'], os.environ['KVSTORE_NUM_WORKERS'],"
        " len(os.environ['KVSTORE_SERVERS'].split(',')))\n"
        "print('to stderr', file=sys.stderr)\n"
        "kv.barrier(); kv.close()\n"
    )
    result = launch("-n", "2", "-s", "2", "--", PY, "-c", code)
    assert result.returncode == 0, result.stderr
    assert "[worker 0] hello 0 2 2" in result.stdout
    assert "[worker 1] hello 1 2 2" in result.stdout
    assert "[worker 1] to stderr" in result.stderr
    assert "KVSTORE_READY" not in result.stdout  # consumed by the launcher


def test_first_failing_worker_exit_code_and_the_others_are_stopped(tmp_path):
    pidfile = tmp_path / "pid"
    code = (
        "import os, sys, time\n"
        "rank = int(os.environ['KVSTORE_RANK'])\n"
        f"if rank == 0: open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)\n"
        "time.sleep(1); sys.exit(3)\n"
    )
    start = time.monotonic()
    result = launch("-n", "2", "-s", "1", "--", PY, "-c", code)
    assert result.returncode == 3
    assert "worker 1 exited with code 3; stopping the others" in result.stderr
    assert time.monotonic() - start < 60
    assert not _alive(int(pidfile.read_text()))


def test_worker_killed_by_a_signal():
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    result = launch("-n", "1", "-s", "1", "--", PY, "-c", code)
    assert result.returncode == 128 + signal.SIGKILL
    assert "worker 0 was killed by SIGKILL" in result.stderr


def test_a_server_that_dies_fails_the_launch_fast():
    err = io.BytesIO()
    supervisor = Supervisor(
        LocalBackend(),
        1,
        2,
        [PY, "-c", "import time; time.sleep(120)"],
        out=io.BytesIO(),
        err=err,
    )
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = [c for c in supervisor.children if c.role == "worker"]
            if workers:
                break
            time.sleep(0.05)
        server = next(c for c in supervisor.children if c.role == "server" and c.rank == 1)
        os.kill(server.process.pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive()
    finally:
        supervisor.stop_all()
        thread.join(30)
    assert result == [128 + signal.SIGKILL]
    message = err.getvalue().decode()
    assert "server 1 was killed by SIGKILL while workers were running" in message
    assert all(c.process.poll() is not None for c in supervisor.children)


def test_a_server_that_fails_to_start_is_named(tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 5\n")
    fake.chmod(0o755)

    class BrokenServers(LocalBackend):
        def server_python(self) -> str:
            return str(fake)

    err = io.BytesIO()
    supervisor = Supervisor(BrokenServers(), 1, 1, [PY, "-c", "pass"], out=io.BytesIO(), err=err)
    assert supervisor.run() == 5
    text = err.getvalue().decode()
    assert "[server 0] cannot start" in text
    assert "server 0 exited with code 5 before it was ready" in text
    assert not [c for c in supervisor.children if c.role == "worker"]


def test_usage_errors():
    result = launch("-n", "1")
    assert result.returncode == 2 and "give the worker command" in result.stderr
    result = launch("-n", "1", "--launcher", "ssh", "--", "true")
    assert result.returncode == 2 and "needs -H" in result.stderr
    result = launch("-n", "1", "-s", "1", "--replicas", "2", "--", "true")
    assert result.returncode == 2 and "--replicas must be between 1 and -s 1" in result.stderr


def test_hostfile_and_ssh_placement(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=8\nnode2:4\n\nnode3\n")
    assert read_hostfile(hostfile) == ["node1", "node2", "node3"]
    backend = SSHBackend(["h1", "h2", "h3", "h4", "h5"], num_servers=3)
    assert [backend.server_host(i) for i in range(3)] == ["h1", "h2", "h3"]
    command = backend.child("worker", 2, ["python", "train.py", "--name", "a b"], {"X": "1 2"})
    assert command.argv[:3] == ["ssh", "-o", "BatchMode=yes"]
    assert command.argv[3] == "h1"  # workers follow the servers, cycling
    assert "X='1 2'" in command.argv[4] and "'a b'" in command.argv[4]


def test_workers_per_host_keep_consecutive_ranks_on_one_host():
    backend = SSHBackend(["h1", "h2", "h3"], num_servers=1, workers_per_host=2)
    assert [backend.where("worker", r).split()[-1] for r in range(4)] == ["h2", "h2", "h3", "h3"]
    result = launch("-n", "3", "--workers-per-host", "2", "--", "true")
    assert result.returncode == 2 and "--workers-per-host must be >= 1 and divide" in result.stderr


def test_workers_per_host_aggregate_on_their_host():
    code = (
        "import os, numpy as np, kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init('w', np.zeros(4, np.float32))\n"
        "kv.push('w', np.full(4, kv.rank + 1, np.float32))\n"
        "out = np.empty(4, np.float32); kv.pull('w', out=out)\n"
        "print('local', os.environ['KVSTORE_LOCAL_RANK'], 'of', os.environ['KVSTORE_LOCAL_SIZE'],"
        " 'sum', out[0], 'pushed', kv.stats().pushed_raw_bytes); kv.close()\n"
    )
    result = launch("-n", "4", "-s", "1", "--workers-per-host", "2", "--", PY, "-c", code)
    assert result.returncode == 0, result.stderr
    for rank in range(4):  # each host's two workers push one 16-byte value between them
        assert f"[worker {rank}] local {rank % 2} of 2 sum 10.0 pushed " in result.stdout
    pushed = [int(line.rsplit(" ", 1)[1]) for line in result.stdout.splitlines()
              if " pushed " in line]  # fmt: skip
    assert sorted(pushed) == [0, 0, 16, 16]


def test_ssh_launcher_end_to_end_through_a_stand_in_ssh(tmp_path):
    fake_ssh = tmp_path / "fake-ssh"
    fake_ssh.write_text('#!/bin/bash\nshift\nexec bash -c "$1"\n')  # drop the host, run it here
    fake_ssh.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n127.0.0.1\n")
    code = (
        "import numpy as np, kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init('w', np.zeros(4, np.float32)); kv.push('w', np.ones(4, np.float32))\n"
        "out = np.empty(4, np.float32); kv.pull('w', out=out); print('sum', out[0]); kv.close()\n"
    )
    result = launch(
        "-n", "2", "-s", "2", "--launcher", "ssh", "-H", str(hostfile),
        "--ssh-command", str(fake_ssh), "--python", PY, "--", PY, "-c", code,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "[worker 0] sum 2.0" in result.stdout and "[worker 1] sum 2.0" in result.stdout


def test_servers_stop_through_their_own_shutdown_when_the_job_is_done():
    """The launcher asks each server to stop on its stdin (which srun and ssh pass on, unlike
    signals): the server says so and exits 0, not killed and not 'launcher gone'."""
    result = launch("-n", "1", "-s", "2", "--no-auth", "--", PY, "-c", "print('ok')")
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[server {rank}] " in result.stderr
    assert result.stderr.count("the launcher asked this server to stop") == 2, result.stderr
    assert "stdin closed" not in result.stderr and "Killed" not in result.stderr


def _stand_in_ssh(tmp_path: Path) -> Path:
    """An ssh that runs the remote command here as sshd would: in a non-login shell whose
    PATH is the system's, with none of the launcher's environment."""
    fake_ssh = tmp_path / "fake-ssh"
    fake_ssh.write_text(
        '#!/bin/bash\nshift\nexec env -i HOME="$HOME" PATH=/usr/bin:/bin bash -c "$1"\n'
    )
    fake_ssh.chmod(0o755)
    return fake_ssh


SSH_WORKER = (
    "import sys, numpy as np, kvstore\n"
    "kv = kvstore.create('dist_sync')\n"
    "kv.init('w', np.zeros(4, np.float32)); kv.push('w', np.ones(4, np.float32))\n"
    "out = np.empty(4, np.float32); kv.pull('w', out=out)\n"
    "print('sum', out[0], sys.executable); kv.close()\n"
)


def test_ssh_runs_the_launchers_interpreter_where_the_remote_path_is_the_systems(tmp_path):
    """The documented command, `-- python3 train.py` without --python, works for a user whose
    package lives in a virtualenv (here: this interpreter's prefix), because servers run this
    interpreter by its path and remote commands get its directory first on PATH."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n")
    python3 = Path(PY).parent / "python3"
    if not python3.exists():
        pytest.skip(f"no python3 beside {PY}")
    result = launch(
        "-n", "1", "-s", "1", "--launcher", "ssh", "-H", str(hostfile),
        "--ssh-command", str(_stand_in_ssh(tmp_path)), "--", "python3", "-c", SSH_WORKER,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("[worker 0] sum "))
    assert line.split()[3] == "1.0"
    assert Path(line.split()[4]).parent == Path(PY).parent


def _launch_on_one_ssh_host(tmp_path: Path, python: str) -> subprocess.CompletedProcess:
    """One worker through the stand-in ssh, with ``--python PYTHON`` for the server."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n")
    return launch(
        "-n", "1", "--launcher", "ssh", "-H", str(hostfile),
        "--ssh-command", str(_stand_in_ssh(tmp_path)),
        "--python", python, "--", "python3", "-c", "pass",
    )  # fmt: skip


def test_ssh_names_a_missing_interpreter_and_one_without_kvstore(tmp_path):
    missing = str(tmp_path / "venv" / "bin" / "python3")
    result = _launch_on_one_ssh_host(tmp_path, missing)
    assert result.returncode != 0
    assert f"{missing} was not found on host 127.0.0.1" in result.stderr, result.stderr
    assert "--python" in result.stderr
    # A real interpreter without the package: the system's, where it lacks kvstore.
    system = "/usr/bin/python3"
    if (
        not Path(system).exists()
        or subprocess.run([system, "-c", "import kvstore"]).returncode == 0
    ):
        return
    result = _launch_on_one_ssh_host(tmp_path, system)
    assert result.returncode != 0
    assert f"{system} on host 127.0.0.1 cannot import kvstore" in result.stderr, result.stderr


# server restarts (--replicas R --restart-servers) ------------------------------------------------


def _same_but_the_port(before: list[str], port: str) -> list[str]:
    argv = list(before)
    assert argv[argv.index("--port") + 1] == "0"  # the first one took what the system gave
    argv[argv.index("--port") + 1] = port
    return argv


def test_a_killed_server_is_restarted_at_its_address(tmp_path):
    restart = kill_a_launched_server(
        ["-n", "1", "-s", "2", "--replicas", "2", "--restart-servers"], tmp_path
    )
    assert restart.returncode == 0, restart.stderr
    servers = ",".join(restart.servers)
    assert f"[worker 0] replicas 2 servers {servers}" in restart.stdout
    before, after = restart.before, restart.after
    port = restart.servers[1].rsplit(":", 1)[1]
    assert after.argv == _same_but_the_port(before.argv, port)
    assert before.env["KVSTORE_REPLICAS"] == after.env["KVSTORE_REPLICAS"] == "2"
    # the first servers start empty; the replacement knows every server, to catch up from
    assert before.env["KVSTORE_SERVERS"] == "" and after.env["KVSTORE_SERVERS"] == servers
    assert all(before.env[v] == after.env[v] for v in AUTH_VARS)  # the job's keys
    assert (
        f"server 1 was killed by SIGKILL while workers were running; restarting it at "
        f"{restart.servers[1]} (restart 1 of 3)" in restart.stderr
    )
    assert f"server 1 rejoined at {restart.servers[1]}" in restart.stderr


def test_ssh_restarts_a_server_through_ssh(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n")
    restart = kill_a_launched_server(
        [
            "-n", "1", "-s", "2", "--replicas", "2", "--restart-servers", "--launcher", "ssh",
            "-H", str(hostfile), "--ssh-command", str(_stand_in_ssh(tmp_path)),
        ],
        tmp_path,
    )  # fmt: skip
    assert restart.returncode == 0, restart.stderr
    # the stand-in ssh starts from an empty environment: all of this came over ssh
    servers = ",".join(restart.servers)
    assert f"[worker 0] replicas 2 servers {servers}" in restart.stdout
    before, after = restart.before, restart.after
    assert after.argv == _same_but_the_port(before.argv, restart.servers[1].rsplit(":", 1)[1])
    assert after.env["KVSTORE_REPLICAS"] == "2" and after.env["KVSTORE_SERVERS"] == servers
    assert all(before.env.get(v) == after.env.get(v) for v in AUTH_VARS)  # secrets on stdin
    assert f"restarting it on host 127.0.0.1 at {restart.servers[1]}" in restart.stderr
    assert f"server 1 rejoined at {restart.servers[1]}" in restart.stderr


FAKE_SERVER = """#!{python}
import os, sys
argv = sys.argv[1:]
rank = int(argv[argv.index("--server-rank") + 1])
port = int(argv[argv.index("--port") + 1]) or 40000 + rank  # nothing listens there
if os.environ.get("MOVE") and argv[argv.index("--port") + 1] != "0":
    port += 1
print("KVSTORE_READY tcp://127.0.0.1:%d" % port, flush=True)
print("replicas", os.environ["KVSTORE_REPLICAS"], "servers", os.environ["KVSTORE_SERVERS"],
      file=sys.stderr, flush=True)
sys.stdin.read()  # until the launcher stops it
"""
"""A stand-in server: prints a READY line (port 40000 + rank the first time, then the port it
is given, or the next one with MOVE set) and what it got, then waits for its stdin to close."""


class FakeServers(LocalBackend):
    """Servers are :data:`FAKE_SERVER`, with ``env`` added to every child's environment."""

    def __init__(self, script: Path, env: dict[str, str] | None = None) -> None:
        super().__init__()
        self.script = script
        self.env = env or {}

    def server_python(self) -> str:
        return str(self.script)

    def child(self, role, rank, argv, env) -> ChildCommand:
        return super().child(role, rank, argv, {**env, **self.env})


def _supervise_fake_servers(tmp_path: Path, env: dict[str, str] | None = None, **options):
    """A supervisor of 2 fake servers and one sleeping worker, running in a thread, and its
    stderr; the caller kills servers by pid, the thread ends with the job's exit status."""
    script = tmp_path / "fake-server"
    script.write_text(FAKE_SERVER.format(python=PY))
    script.chmod(0o755)
    err = io.BytesIO()
    supervisor = Supervisor(
        FakeServers(script, env),
        1,
        2,
        [PY, "-c", "import time; time.sleep(120)"],
        replicas=2,
        restart_servers=True,
        auth=False,
        out=io.BytesIO(),
        err=err,
        **options,
    )
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()))
    thread.start()
    return supervisor, thread, result, err


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _running_server(supervisor: Supervisor, rank: int):
    children = [c for c in supervisor.children if c.role == "server" and c.rank == rank]
    return children[-1] if children and children[-1].process.poll() is None else None


def test_restarts_are_bounded_by_max_restarts(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvstore.deploy.supervisor")  # the rejoin is INFO
    supervisor, thread, result, err = _supervise_fake_servers(tmp_path, max_restarts=1)
    try:
        _wait_until(lambda: any(c.role == "worker" for c in supervisor.children), "no worker")
        first = _running_server(supervisor, 1)
        os.kill(first.process.pid, signal.SIGKILL)
        _wait_until(lambda: b"server 1 rejoined" in err.getvalue(), "no rejoin")
        second = _running_server(supervisor, 1)
        assert second is not first
        os.kill(second.process.pid, signal.SIGKILL)  # one restart too many
        thread.join(60)
        assert not thread.is_alive()
    finally:
        supervisor.stop_all()
        thread.join(30)
    assert result == [128 + signal.SIGKILL]
    text = err.getvalue().decode()
    assert "[server 0] replicas 2 servers \n" in text  # the first servers start empty
    servers = "tcp://127.0.0.1:40000,tcp://127.0.0.1:40001"
    assert f"[server 1] replicas 2 servers {servers}\n" in text  # the replacement does not
    assert "restarting it at tcp://127.0.0.1:40001 (restart 1 of 1)" in text
    assert (
        "server 1 was killed by SIGKILL while workers were running (restarted 1 time(s), "
        "--max-restarts 1); stopping the others" in text
    )
    assert supervisor.restarts == {1: 1}
    assert all(c.process.poll() is not None for c in supervisor.children)


def test_a_server_that_comes_back_elsewhere_fails_the_job(tmp_path):
    supervisor, thread, result, err = _supervise_fake_servers(tmp_path, env={"MOVE": "1"})
    try:
        _wait_until(lambda: any(c.role == "worker" for c in supervisor.children), "no worker")
        os.kill(_running_server(supervisor, 0).process.pid, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive()
    finally:
        supervisor.stop_all()
        thread.join(30)
    assert result == [1]
    text = err.getvalue().decode()
    assert (
        "server 0 came back at tcp://127.0.0.1:40001, not at tcp://127.0.0.1:40000; stopping "
        "the others" in text
    )
    assert all(c.process.poll() is not None for c in supervisor.children)
