"""Authentication against real servers: only a job's workers (its CURVE keys) can join it, push
into it or hold a rank; everyone else gets no answer and changes nothing.

Every stranger here is a bare DEALER socket speaking the wire protocol (built with
``kvstore.wire``), either without keys or with CURVE keys of another job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq
from kvtest import connect, run_ranks, start_servers, stop_processes

import kvstore
from kvstore import wire
from kvstore.auth import JobKeys, role_env
from kvstore.errors import AuthenticationError, ConfigError

pytestmark = pytest.mark.integration

PY = sys.executable
NO_ANSWER_S = 2.0
"""How long a stranger waits for an answer that must not come (a hang guard, not a timing)."""


class Stranger:
    """A bare DEALER that says what it likes, with another job's keys or none."""

    def __init__(self, address: str, server_public: str | None, keys: JobKeys | None = None):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if keys is not None:  # a well-formed CURVE client, but not of this job
            self.socket.setsockopt(zmq.CURVE_SERVERKEY, (server_public or "").encode())
            self.socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public.encode())
            self.socket.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret.encode())
        self.socket.connect(address)
        self.rid = 5000

    def send(self, op: wire.Op, fields: dict, payloads: tuple = ()) -> None:
        self.rid += 1
        try:
            self.socket.send_multipart(wire.encode(op, self.rid, fields, payloads), zmq.NOBLOCK)
        except zmq.Again:  # libzmq dropped the connection it could not secure: nowhere to queue
            pass

    def hello(self, rank: int, num_workers: int, lane: int = 0) -> None:
        fields = {"r": rank, "nw": num_workers, "ns": 1, "si": 0, "m": "dist_sync", "ln": lane}
        self.send(wire.Op.HELLO, fields)

    def push_ones(self, key: str, n: int) -> None:
        value = np.full(n, 1e6, np.float32)
        fields = {"k": key, "c": 0, "dt": "float32", "sh": [n], "o": 0, "n": n, "cd": "none",
                  "cp": {}, "nb": [value.nbytes]}  # fmt: skip
        try:
            self.send(wire.Op.PUSH, fields, (value,))
        except Exception:  # (a schema this test does not know: the HELLO is what matters)
            pass

    def answered(self, timeout: float | None = NO_ANSWER_S) -> bool:
        """Whether an answer came within ``timeout`` seconds (None: :data:`NO_ANSWER_S`)."""
        timeout = NO_ANSWER_S if timeout is None else timeout
        return bool(self.socket.poll(int(timeout * 1000)))

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def strangers(address: str, job: JobKeys) -> list[Stranger]:
    other = JobKeys.generate()
    return [
        Stranger(address, None),  # no keys at all
        Stranger(address, job.server_public, other),  # the server's public key, its own pair
        # the job's client public key, but not its secret (a CURVE client must prove it)
        Stranger(
            address,
            job.server_public,
            JobKeys(
                other.server_public, other.server_secret, job.client_public, other.client_secret
            ),
        ),
    ]


@pytest.fixture
def job_keys(monkeypatch) -> JobKeys:
    """Fresh keys; this process's stores (the workers) hold the job's worker keys."""
    keys = JobKeys.generate()
    for name, value in role_env("worker", keys).items():
        monkeypatch.setenv(name, value)
    return keys


def test_strangers_cannot_join_push_or_lock_a_rank(job_keys):
    servers = start_servers(1, 2, env=job_keys.env("server"))
    address = servers[0].address
    outsiders = strangers(address, job_keys)
    try:
        # Before the job: each stranger says HELLO as rank 0 and 1 on both lanes (and never
        # BYE, which once locked a rank for good), then pushes a huge value into the key.
        for stranger in outsiders:
            for rank in (0, 1):
                for lane in (0, 1):
                    stranger.hello(rank, 2, lane)
            stranger.push_ones("w", 4)
        # (they all asked at once: the first waits the whole window, the others' answers
        # would have come within it too)
        assert not outsiders[0].answered(), "a stranger got an answer"
        for stranger in outsiders[1:]:
            assert not stranger.answered(0.0), "a stranger got an answer"

        def worker(rank: int) -> np.ndarray:
            with connect([address], rank=rank, num_workers=2) as kv:
                kv.init("w", np.zeros(4, np.float32))
                for stranger in outsiders:  # mid-job, too
                    stranger.hello(rank, 2)
                    stranger.push_ones("w", 4)
                kv.push("w", np.ones(4, np.float32))
                out = np.empty(4, np.float32)
                kv.pull("w", out=out)
                kv.barrier()
                return out

        for out in run_ranks(2, worker):  # both ranks were free, and the sum is exact
            np.testing.assert_array_equal(out, np.full(4, 2.0, np.float32))
        for stranger in outsiders:
            assert not stranger.answered(0.2)
    finally:
        for stranger in outsiders:
            stranger.close()
        stop_processes([s.process for s in servers])


def test_a_worker_with_the_keys_takes_its_rank_back_after_closing(job_keys):
    servers = start_servers(1, 2, env=job_keys.env("server"))
    address = servers[0].address
    try:
        stays = connect([address], rank=1, num_workers=2, mode="dist_async")
        leaves = connect([address], rank=0, num_workers=2, mode="dist_async")
        by_rank = (leaves, stays)

        def setup(rank: int) -> None:  # collectives: every rank at once
            by_rank[rank].set_optimizer("sgd", learning_rate=1.0)
            by_rank[rank].init("w", np.zeros(4, np.float32))

        run_ranks(2, setup)
        leaves.push("w", np.full(4, -1.0, np.float32))  # w = 1
        leaves.close()
        # rank 0 is free now: a stranger who says HELLO as rank 0 gets nothing ...
        outsiders = strangers(address, job_keys)
        for stranger in outsiders:
            stranger.hello(0, 2)
            stranger.push_ones("w", 4)
        for i, stranger in enumerate(outsiders):  # one window for all (see above)
            assert not stranger.answered(None if i == 0 else 0.0)
            stranger.close()
        # ... and the job's own replacement takes it, and sees the weights the job made
        back = connect([address], rank=0, num_workers=2, mode="dist_async")
        try:
            out = np.empty(4, np.float32)
            stays.pull("w", out=out)
            np.testing.assert_array_equal(out, np.ones(4, np.float32))
            run_ranks(2, lambda r: (back, stays)[r].barrier())
        finally:
            back.close()
            stays.close()
    finally:
        stop_processes([s.process for s in servers])


def test_wrong_or_missing_keys_fail_at_create_naming_the_cause(job_keys, monkeypatch):
    servers = start_servers(1, 1, env=job_keys.env("server"))
    plain = start_servers(1, 1, env=role_env("server", None))
    address = servers[0].address
    other = JobKeys.generate()
    try:
        cases = [
            ({"KVSTORE_AUTH_CLIENT_SECRET_KEY": other.client_secret,
              "KVSTORE_AUTH_CLIENT_PUBLIC_KEY": other.client_public}, address, "refused"),
            ({"KVSTORE_AUTH_SERVER_PUBLIC_KEY": other.server_public}, address, "not the server's"),
            (role_env("worker", None), address, "requires the job's CURVE keys"),
            ({}, plain[0].address, "does not use CURVE keys|has no keys"),
        ]  # fmt: skip
        for env, where, match in cases:
            with monkeypatch.context() as patch:
                for name, value in env.items():
                    patch.setenv(name, value)
                start = time.monotonic()
                with pytest.raises(AuthenticationError, match=match):
                    connect([where], connect_timeout=60)
                assert time.monotonic() - start < 30  # said at once, not after the 60 s wait
        # the job's worker still gets in
        with connect([address]) as kv:
            kv.init("w", np.zeros(2, np.float32))
    finally:
        stop_processes([s.process for s in servers + plain])


def test_mismatched_key_files_are_a_config_error(job_keys, monkeypatch):
    monkeypatch.setenv("KVSTORE_AUTH_CLIENT_PUBLIC_KEY", JobKeys.generate().client_public)
    with pytest.raises(ConfigError, match="different `kvstore-keygen` runs"):
        connect(["tcp://127.0.0.1:9"], connect_timeout=1)


def test_local_mode_ignores_keys(job_keys):
    with kvstore.create("local") as kv:  # in-process: nothing to authenticate
        kv.init("w", np.zeros(2, np.float32))
        kv.push("w", np.ones(2, np.float32))
        out = np.empty(2, np.float32)
        kv.pull("w", out=out)
    np.testing.assert_array_equal(out, np.ones(2, np.float32))


def _server_process(env: dict[str, str], *flags: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [
            PY,
            "-m",
            "kvstore.server",
            "--port",
            "0",
            "--num-workers",
            "1",
            "--threads",
            "1",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **role_env("server", None), "KVSTORE_LOG_LEVEL": "INFO", **env},
    )
    line = process.stdout.readline()
    assert line.startswith("KVSTORE_READY"), line
    return process, line.split()[1]


def _stop(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    return err


def test_a_server_without_keys_warns_that_it_accepts_anyone():
    process, _ = _server_process({})
    err = _stop(process)
    assert "WARNING" in err and "accepts any worker" in err


def test_a_server_with_keys_says_so_and_logs_who_it_refused(tmp_path):
    assert subprocess.run(["kvstore-keygen", str(tmp_path)], capture_output=True).returncode == 0
    process, address = _server_process({"KVSTORE_AUTH_DIR": str(tmp_path / "server")})
    try:
        server_public = (tmp_path / "server" / "server-public-key").read_text().strip()
        stranger = Stranger(address, server_public, JobKeys.generate())
        stranger.hello(0, 1)
        assert not stranger.answered()
        stranger.close()
    finally:
        err = _stop(process)
    assert "accepts any worker" not in err
    assert "admits only workers with the job's CURVE keys" in err
    assert "refused a connection from 127.0.0.1" in err


def test_handshakes_refused_before_the_key_check_are_logged_too(tmp_path):
    """A client without keys, and one holding another server's key, fail the handshake before
    the server's ZAP handler sees them; the server still logs each kind of refusal, once per
    interval however often it is retried (libzmq does not tell the peer's address then)."""
    assert subprocess.run(["kvstore-keygen", str(tmp_path)], capture_output=True).returncode == 0
    process, address = _server_process({"KVSTORE_AUTH_DIR": str(tmp_path / "server")})
    other = JobKeys.generate()
    try:
        strangers = [Stranger(address, None), Stranger(address, other.server_public, other)]
        for stranger in strangers:  # libzmq retries each connection, every 0.1 s
            stranger.hello(0, 1)
        deadline = time.monotonic() + NO_ANSWER_S
        assert not any(s.answered(max(0.0, deadline - time.monotonic())) for s in strangers)
        for stranger in strangers:
            stranger.close()
    finally:
        err = _stop(process)
    refusals = [line for line in err.splitlines() if "refused a connection" in line]
    unencrypted = [line for line in refusals if "an unencrypted handshake" in line]
    other_key = [line for line in refusals if "a handshake for another server key" in line]
    assert len(unencrypted) == 1 and len(other_key) == 1, err  # one per kind per interval
    vague = [line for line in refusals if "failed without detail" in line]
    assert len(refusals) == 2 + len(vague) and len(vague) <= 1, err


def test_keygen_output_runs_a_hand_started_job(tmp_path):
    """``kvstore-keygen DIR``, then servers and workers started by hand with KVSTORE_AUTH_DIR."""
    result = subprocess.run(["kvstore-keygen", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    env = {**os.environ, **role_env("server", None)}
    servers = start_servers(
        2, 2, env={**role_env("server", None), "KVSTORE_AUTH_DIR": str(tmp_path / "server")}
    )
    code = (
        "import sys, numpy as np, kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init('w', np.zeros(3, np.float32)); kv.push('w', np.ones(3, np.float32))\n"
        "out = np.empty(3, np.float32); kv.pull('w', out=out); print(out.sum()); kv.close()\n"
    )
    try:
        job = {"KVSTORE_SERVERS": ",".join(s.address for s in servers), "KVSTORE_NUM_WORKERS": "2"}
        workers = [
            subprocess.Popen(
                [PY, "-c", code],
                env={
                    **env,
                    **job,
                    "KVSTORE_RANK": str(rank),
                    "KVSTORE_AUTH_DIR": str(tmp_path / "worker"),
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        for worker in workers:
            out, err = worker.communicate(timeout=120)
            assert worker.returncode == 0, err
            assert out.strip() == "6.0"
        # the server's folder is not a worker's
        wrong = subprocess.run(
            [PY, "-c", code],
            env={**env, **job, "KVSTORE_RANK": "0", "KVSTORE_AUTH_DIR": str(tmp_path / "server")},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert wrong.returncode != 0 and "holds no client-secret-key" in wrong.stderr
    finally:
        stop_processes([s.process for s in servers])


# the launcher ---------------------------------------------------------------------------------

# A worker of a launched job: says whether it holds keys, whether a stranger on its host (no
# keys) gets an answer from a server, checks a sum, then waits for the test's go-ahead file
# (argv[1]) so the test can look at the job's processes meanwhile.
_LAUNCHED_WORKER = """
import os, sys, time, numpy as np, zmq, kvstore
from kvstore import wire
kv = kvstore.create("dist_sync")
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
s.connect(os.environ["KVSTORE_SERVERS"].split(",")[0])
hello = {"r": 0, "nw": 99, "ns": 1, "si": 0, "m": "dist_sync", "ln": 0}  # refused if heard
try:
    s.send_multipart(wire.encode(wire.Op.HELLO, 1, hello), zmq.NOBLOCK)
except zmq.Again:
    pass
print("keys", bool(os.environ.get("KVSTORE_AUTH_CLIENT_SECRET_KEY")),
      "stranger answered", bool(s.poll(1500)), flush=True)
s.close(0); ctx.term()
kv.init("w", np.zeros(4, np.float32)); kv.push("w", np.ones(4, np.float32))
out = np.empty(4, np.float32); kv.pull("w", out=out); print("sum", out[0], flush=True)
deadline = time.monotonic() + 60
while len(sys.argv) > 1 and not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
kv.close()
"""


def _environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _cmdline(pid: int) -> str:
    return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()


def test_launcher_jobs_are_authenticated_and_each_role_holds_only_its_keys(tmp_path):
    import io
    import threading

    from kvstore.deploy import LocalBackend, Supervisor

    go = tmp_path / "go"
    out = io.BytesIO()
    supervisor = Supervisor(LocalBackend(), 2, 2, [PY, "-c", _LAUNCHED_WORKER, str(go)],
                            out=out, err=io.BytesIO())  # fmt: skip
    keys = supervisor.keys
    assert keys is not None
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while out.getvalue().count(b"sum") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.getvalue().count(b"sum") == 2, out.getvalue()
        children = {(c.role, c.rank): c.process.pid for c in supervisor.children}
        assert len(children) == 4
        for (role, _), pid in children.items():
            env = _environ(pid)
            if role == "server":
                assert env["KVSTORE_AUTH_SERVER_SECRET_KEY"] == keys.server_secret
                assert env["KVSTORE_AUTH_CLIENT_PUBLIC_KEY"] == keys.client_public
                assert env["KVSTORE_AUTH_CLIENT_SECRET_KEY"] == ""
            else:
                assert env["KVSTORE_AUTH_CLIENT_SECRET_KEY"] == keys.client_secret
                assert env["KVSTORE_AUTH_SERVER_PUBLIC_KEY"] == keys.server_public
                assert env["KVSTORE_AUTH_SERVER_SECRET_KEY"] == ""
            command = _cmdline(pid)
            assert keys.server_secret not in command and keys.client_secret not in command
    finally:
        go.touch()
        thread.join(60)
        supervisor.stop_all()
    assert result == [0]
    text = out.getvalue().decode()
    for rank in (0, 1):
        assert f"[worker {rank}] keys True stranger answered False" in text
        assert f"[worker {rank}] sum 2.0" in text
    # a new job, new keys
    assert Supervisor(LocalBackend(), 1, 1, ["true"]).keys != keys


@pytest.mark.parametrize("switch", [["--no-auth"], []], ids=["--no-auth", "KVSTORE_AUTH=0"])
def test_launcher_switch_for_trusted_networks(switch, monkeypatch):
    if not switch:
        monkeypatch.setenv("KVSTORE_AUTH", "0")
    monkeypatch.delenv("KVSTORE_LOG_LEVEL", raising=False)  # the warnings show by default
    # keys in the launcher's own environment are not passed on either
    for name, value in role_env("worker", JobKeys.generate()).items():
        monkeypatch.setenv(name, value)
    result = subprocess.run(
        [PY, "-m", "kvstore.deploy", "-n", "2", "-s", "1", *switch, "--", PY, "-c",
         _LAUNCHED_WORKER],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"[worker {rank}] keys False stranger answered True" in result.stdout
        assert f"[worker {rank}] sum 2.0" in result.stdout
    assert "no authentication (--no-auth)" in result.stderr
    assert "accepts any worker" in result.stderr  # and each server says so


def test_ssh_launcher_sends_secrets_over_stdin_not_the_command_line(tmp_path):
    """The stand-in ssh records its arguments, then runs the remote command here."""
    record = tmp_path / "ssh-args"
    fake_ssh = tmp_path / "fake-ssh"
    fake_ssh.write_text(f'#!/bin/bash\necho "$@" >> {record}\nshift\nexec bash -c "$1"\n')
    fake_ssh.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n127.0.0.1\n")
    result = subprocess.run(
        [PY, "-m", "kvstore.deploy", "-n", "2", "-s", "1", "--launcher", "ssh", "-H",
         str(hostfile), "--ssh-command", str(fake_ssh), "--python", PY, "--", PY, "-c",
         _LAUNCHED_WORKER],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"[worker {rank}] keys True stranger answered False" in result.stdout
        assert f"[worker {rank}] sum 2.0" in result.stdout
    arguments = record.read_text()
    assert arguments.count("127.0.0.1 cd ") == 3  # a server, two workers
    assert arguments.count("KVSTORE_AUTH_CLIENT_PUBLIC_KEY=") == 3
    assert "SECRET_KEY=" not in arguments


def test_the_frame_limit_is_the_same_with_keys(job_keys):
    """ZMQ_MAXMSGSIZE counts a CURVE frame with its encryption overhead: a server with keys
    still takes frames of exactly its limit (and drops the connection of a larger one)."""
    limit = 65536
    process, address = _server_process(
        {**job_keys.env("server"), "KVSTORE_LOG_LEVEL": "ERROR"}, "--max-message-bytes", str(limit)
    )
    try:
        for size, answered in ((limit, True), (limit + 1, False)):
            # the job's own keys: a worker as far as the handshake goes
            peer = Stranger(address, job_keys.server_public, job_keys)
            hello = {"r": 0, "nw": 1, "ns": 1, "si": 0, "m": "dist_sync", "ln": 0}
            frames = [*wire.encode(wire.Op.HELLO, 1, hello), b"\0" * size]  # one frame too many
            peer.socket.send_multipart(frames)
            assert peer.answered(10.0 if answered else NO_ANSWER_S) is answered, size
            if answered:
                reply = wire.decode(peer.socket.recv_multipart())
                assert reply.op is wire.Op.ERROR  # refused as malformed, but it arrived
            peer.close()
    finally:
        _stop(process)


def test_a_socket_with_keys_but_no_zap_handler_admits_nobody():
    """Fails closed: were the ZAP handler gone, even the job's own client would be refused
    (libzmq's default would admit anyone who knows the server's public key)."""
    from kvstore.auth import ZapHandler, secure_client, secure_server

    keys = JobKeys.generate()
    for with_handler in (True, False):
        context = zmq.Context()
        handler = ZapHandler(context, keys.client_public) if with_handler else None
        if handler is not None:
            handler.start()
        server = context.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        secure_server(server, keys.for_role("server"))
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = context.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        secure_client(client, keys.for_role("worker"))
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hello", zmq.NOBLOCK)
        timeout = 10.0 if with_handler else NO_ANSWER_S
        assert bool(server.poll(int(timeout * 1000))) is with_handler
        client.close(0)
        server.close(0)
        if handler is not None:
            handler.stop()
        context.term()
