"""Starts a job's servers and workers, forwards their output, and stops them all on failure.

The sequence:

1. start S servers (``python -m kvstore.server --port 0 ...``) and wait for each one's
   ``KVSTORE_READY tcp://HOST:PORT`` line;
2. start N workers running the user's command with ``KVSTORE_SERVERS``, ``KVSTORE_RANK``,
   ``KVSTORE_NUM_WORKERS`` and ``KVSTORE_NUM_SERVERS`` set;
3. forward every line each child prints, prefixed with ``[server I]`` or ``[worker R]``;
   the launcher's own messages are log records of role ``launch`` in the format every kvstore
   process uses (:data:`kvstore._logging.FORMAT`), shown at ``KVSTORE_LOG_LEVEL`` (INFO by
   default under ``kvstore-launch``);
4. when all workers exit 0, stop the servers and return 0. When any child fails first (a
   worker exits non-zero, a server exits at all, or a server never gets ready), say which one,
   stop all the others, and return its exit code (``128 + signal`` for a child killed by a
   signal).

Every server and worker gets ``KVSTORE_REPLICAS`` (``replicas``): each shard is then held by
its server and the next R - 1, and the job survives the loss of R - 1 servers. With
``restart_servers``, a server that exits while the workers run (any exit but the launcher's
stop at the end) is not a failure of the job but is started again (:meth:`Supervisor._restart`):
the same rank, host, port, arguments and environment through the same backend (a new
``ssh`` command or ``srun`` step), plus ``KVSTORE_SERVERS``, every server's address, from
which it catches itself up from a live replica. It must print its READY line within
``startup_timeout`` at the address it had; otherwise, or once a server has been restarted
``max_restarts`` times, its exit fails the job as above. (The first servers get
``KVSTORE_SERVERS`` blank: they start empty, and a value left in the launcher's environment
must not make them look for replicas.)

A server is stopped through its own shutdown: the launcher asks it on its stdin
(:meth:`Supervisor.stop_all`). Every child runs in a session of its own, and one that does not
stop is signalled through its process-group id, which is its pid (SIGTERM, then SIGKILL after a
grace period): never by name, and its own children (data loader processes) go with it.

A server's stdin is a pipe whose writing end only the launcher holds, and the server runs with
``--stop-on-stdin-eof``: if the launcher dies without stopping it (SIGKILL, a crash), the pipe
closes and the server stops at once instead of running on as an orphan (through ``ssh`` and
``srun`` too, which pass stdin on). Its workers then lose their servers
(:class:`~kvstore.errors.ServerLostError`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from kvstore import _logging
from kvstore.auth import JobKeys, role_env
from kvstore.deploy.backends import Backend
from kvstore.errors import ConfigError
from kvstore.launch_protocol import READY_PREFIX, STOP_REQUEST

logger = logging.getLogger(__name__)
_FORMATTER = _logging.formatter("launch")


@dataclass
class Child:
    """One started process."""

    role: str
    rank: int
    process: subprocess.Popen[bytes]
    ready: threading.Event = field(default_factory=threading.Event)
    address: str | None = None
    threads: list[threading.Thread] = field(default_factory=list)
    last_errors: deque[bytes] = field(default_factory=lambda: deque(maxlen=20))
    """The last lines it wrote to stderr, to tell why it failed (decoded only then)."""
    asked_to_stop: bool = False
    """Whether :meth:`Supervisor.stop_all` asked it to stop through its stdin."""

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank}"

    def describe_exit(self) -> str:
        code = self.process.returncode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by {name}"
        return f"exited with code {code}"


def exit_status(code: int | None) -> int:
    """A shell-style exit status: the code, or 128 + N for a child killed by signal N."""
    if code is None:
        return 1
    return 128 - code if code < 0 else code


class Supervisor:
    """Runs one job; see the module docstring.

    Args:
        backend: where and how processes start.
        num_workers: N.
        num_servers: S.
        command: the worker command (argv).
        startup_timeout: seconds to wait for the servers' READY lines.
        stop_timeout: grace period of each step of a stop (:meth:`stop_all`).
        server_threads: ``--threads`` of each server (None: the server's default).
        workers_per_host: k: worker ``r`` is local rank ``r % k`` of its host's k workers
            (``KVSTORE_LOCAL_RANK``, ``KVSTORE_LOCAL_SIZE``), which aggregate there first.
        auth: make fresh CURVE keys for the job (:class:`~kvstore.auth.JobKeys`) and give
            servers the server's secret key and workers the client's: only this job's workers
            can then talk to its servers, encrypted. False: no keys (trusted networks only);
            either way no child inherits credential variables from the launcher's environment.
        replicas: R, given to every server and worker as ``KVSTORE_REPLICAS``: the servers
            that hold each shard (1 <= R <= S; 1: no replication).
        restart_servers: start a server that exits while the workers run again, at the same
            address (see the module docstring; needs R >= 2, else it would come back empty).
        max_restarts: how many times one server rank may be restarted; its next exit fails
            the job.
        out, err: where to forward output (default: this process's stdout and stderr).
    """

    def __init__(
        self,
        backend: Backend,
        num_workers: int,
        num_servers: int,
        command: Sequence[str],
        *,
        startup_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        server_threads: int | None = None,
        workers_per_host: int = 1,
        auth: bool = True,
        replicas: int = 1,
        restart_servers: bool = False,
        max_restarts: int = 3,
        out: IO[bytes] | None = None,
        err: IO[bytes] | None = None,
    ) -> None:
        if not 1 <= replicas <= num_servers:
            raise ConfigError(f"replicas must be in 1..{num_servers} (the servers), got {replicas}")
        if restart_servers and replicas < 2:
            raise ConfigError("restarting servers needs replicas >= 2: one would come back empty")
        self.backend = backend
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.command = list(command)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.server_threads = server_threads
        self.workers_per_host = workers_per_host
        self.keys: JobKeys | None = JobKeys.generate() if auth else None
        """The job's credentials (None: a job without authentication)."""
        self.replicas = replicas
        self.restart_servers = restart_servers
        self.max_restarts = max_restarts
        self.restarts: dict[int, int] = {}
        """Server rank -> how many times it was restarted."""
        self.addresses: list[str] = []
        """The address workers reach each server at (``KVSTORE_SERVERS``), once all are ready."""
        self._out = out if out is not None else sys.stdout.buffer
        self._err = err if err is not None else sys.stderr.buffer
        self._write_lock = threading.Lock()
        self.children: list[Child] = []
        self._interrupted: int | None = None

    # output ------------------------------------------------------------------------------------

    def _emit(self, stream: IO[bytes], prefix: bytes, line: bytes) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        with self._write_lock:
            stream.write(prefix + line)
            stream.flush()

    def say(self, message: str, level: int = logging.ERROR) -> None:
        """A message of the launcher's own: a record of this module's logger at ``level``.

        Formatted here and written to ``err`` (not through the logger's handlers) so that it
        goes where the children's output goes, under the same lock, whole lines only; the
        logger's level (``KVSTORE_LOG_LEVEL``) still decides whether it shows.
        """
        if not logger.isEnabledFor(level):
            return
        record = logger.makeRecord(logger.name, level, __file__, 0, message, (), None)
        self._emit(self._err, b"", _FORMATTER.format(record).encode())

    def _pump(self, child: Child, source: IO[bytes], sink: IO[bytes], watch_ready: bool) -> None:
        prefix = f"[{child.label}] ".encode()
        for line in iter(source.readline, b""):
            if watch_ready and not child.ready.is_set():
                text = line.decode("utf-8", "replace").strip()
                if text.startswith(READY_PREFIX):
                    child.address = text[len(READY_PREFIX) :].strip()
                    child.ready.set()
                    continue
            if sink is self._err:
                child.last_errors.append(line)
            self._emit(sink, prefix, line)
        source.close()

    # processes ---------------------------------------------------------------------------------

    def _start(self, role: str, rank: int, argv: Sequence[str], env: dict[str, str]) -> Child:
        spec = self.backend.child(role, rank, argv, env)
        process = subprocess.Popen(
            spec.argv,
            env=spec.env,
            # A server stops when this pipe closes: when the launcher is gone (module docstring).
            stdin=subprocess.PIPE if role == "server" or spec.stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: stopped as a whole by its pid
        )
        if spec.stdin and process.stdin is not None:
            # Secrets for the remote end, not on a command line (SSHBackend): a few hundred
            # bytes, far below a pipe's buffer, so this never blocks.
            try:
                process.stdin.write(spec.stdin)
                process.stdin.flush()
                if role != "server":  # a worker's stdin ends there (DEVNULL otherwise)
                    process.stdin.close()
            except BrokenPipeError:  # it died at once: its exit is reported as any other
                pass
        child = Child(role, rank, process)
        for source, sink, watch in (
            (process.stdout, self._out, role == "server"),
            (process.stderr, self._err, False),
        ):
            thread = threading.Thread(
                target=self._pump, args=(child, source, sink, watch), daemon=True
            )
            thread.start()
            child.threads.append(thread)
        self.children.append(child)
        return child

    def _start_server(self, rank: int, port: int = 0, peers: Sequence[str] = ()) -> Child:
        """Start server ``rank`` on ``port`` (0: one the system picks) with ``KVSTORE_SERVERS``
        set to ``peers`` (blank: none; a replacement gets every server's address)."""
        env = {
            **role_env("server", self.keys),
            "KVSTORE_REPLICAS": str(self.replicas),
            "KVSTORE_SERVERS": ",".join(peers),
        }
        return self._start("server", rank, self._server_argv(rank, port), env)

    def _server_argv(self, rank: int, port: int = 0) -> list[str]:
        argv = [
            self.backend.server_python(),
            "-m",
            "kvstore.server",
            "--host",
            self.backend.server_host(rank),
            "--port",
            str(port),
            "--server-rank",
            str(rank),
            "--num-servers",
            str(self.num_servers),
            "--num-workers",
            str(self.num_workers),
            "--stop-on-stdin-eof",
        ]
        if self.server_threads is not None:
            argv += ["--threads", str(self.server_threads)]
        return argv

    def stop_all(self) -> None:
        """Stop every child still running, servers through their own shutdown.

        A server is asked first: the launcher writes :data:`STOP_REQUEST` to its stdin and
        closes it, and the server stops as it does on SIGTERM. That request reaches it through
        ``srun`` and ``ssh`` too, which pass stdin on but turn signals into something else
        (``srun`` answers SIGTERM by killing its tasks with SIGKILL). Workers, still running only
        when the job failed, get SIGTERM to their group. Whatever still runs after
        ``stop_timeout`` gets the next step: SIGTERM if it was only asked, else SIGKILL; and
        what still runs ``stop_timeout`` later, SIGKILL.
        """
        running = [c for c in self.children if c.process.poll() is None]
        for child in running:
            child.asked_to_stop = self._ask_to_stop(child)
            if not child.asked_to_stop:
                self._signal(child, signal.SIGTERM)
        late = self._wait_for(running, self.stop_timeout)
        for child in late:  # the next step: a signal for the asked, the last one for the others
            self._signal(child, signal.SIGTERM if child.asked_to_stop else signal.SIGKILL)
        for child in self._wait_for(late, self.stop_timeout):
            self._signal(child, signal.SIGKILL)
            child.process.wait()
        for child in self.children:
            for thread in child.threads:
                thread.join(timeout=5.0)
            if child.process.stdin is not None and not child.process.stdin.closed:
                child.process.stdin.close()

    @staticmethod
    def _ask_to_stop(child: Child) -> bool:
        """Ask a server to stop through its stdin; False if it cannot be asked (not a server,
        or its stdin is already gone)."""
        stdin = child.process.stdin
        if child.role != "server" or stdin is None or stdin.closed:
            return False
        try:
            stdin.write(STOP_REQUEST)
            stdin.close()
        except (BrokenPipeError, OSError):
            return False
        return True

    @staticmethod
    def _wait_for(children: list[Child], timeout: float) -> list[Child]:
        """Wait until ``children`` exit or ``timeout`` passes; the ones still running."""
        deadline = time.monotonic() + timeout
        late = []
        for child in children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                late.append(child)
        return late

    def _why_it_failed(self, child: Child) -> str:
        """``": REASON"`` when the backend recognises why ``child`` failed to start, else ""."""
        reason = self.backend.explain_start_failure(
            child.role,
            child.rank,
            child.process.returncode,
            b"".join(child.last_errors).decode("utf-8", "replace"),
        )
        return f": {reason}" if reason else ""

    @staticmethod
    def _signal(child: Child, sig: int) -> None:
        try:
            os.killpg(child.process.pid, sig)
        except ProcessLookupError:
            pass

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._interrupted = signum

    # the job -----------------------------------------------------------------------------------

    def run(self) -> int:
        """Run the job to completion; returns the launcher's exit status."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            return self._run()
        finally:
            self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        self.say(
            f"starting {self.num_servers} server(s) and {self.num_workers} worker(s) "
            f"({self.backend.name} launcher)",
            logging.INFO,
        )
        if self.keys is None:
            self.say(
                "no authentication (--no-auth): the servers accept any process that reaches "
                "them, unencrypted; run on a trusted network only",
                logging.WARNING,
            )
        servers = [self._start_server(rank) for rank in range(self.num_servers)]
        status = self._wait_ready(servers)
        if status is not None:
            return status
        self.addresses = [self.backend.server_address(s.rank, s.address or "") for s in servers]
        addresses = ",".join(self.addresses)
        self.say(f"servers ready: {addresses}", logging.INFO)
        workers = []
        for rank in range(self.num_workers):
            env = {
                "KVSTORE_SERVERS": addresses,
                "KVSTORE_RANK": str(rank),
                "KVSTORE_NUM_WORKERS": str(self.num_workers),
                "KVSTORE_NUM_SERVERS": str(self.num_servers),
                "KVSTORE_LOCAL_RANK": str(rank % self.workers_per_host),
                "KVSTORE_LOCAL_SIZE": str(self.workers_per_host),
                "KVSTORE_REPLICAS": str(self.replicas),
                "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1"),
                **role_env("worker", self.keys),
            }
            try:
                workers.append(self._start("worker", rank, self.command, env))
            except OSError as exc:
                self.say(f"cannot start worker {rank} ({self.command[0]}): {exc}")
                return 127
        return self._watch(servers, workers)

    def _wait_ready(self, servers: list[Child]) -> int | None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._interrupted is not None:
                return 128 + self._interrupted
            for server in servers:
                if not server.ready.is_set() and server.process.poll() is not None:
                    # Let its output arrive before saying why it failed.
                    for thread in server.threads:
                        thread.join(timeout=2.0)
                    self.say(
                        f"{server.label} {server.describe_exit()} before it was ready"
                        + self._why_it_failed(server)
                    )
                    return exit_status(server.process.returncode) or 1
            if all(s.ready.is_set() for s in servers):
                return None
            if time.monotonic() > deadline:
                late = [s.label for s in servers if not s.ready.is_set()]
                self.say(f"{', '.join(late)} not ready after {self.startup_timeout:.0f} s")
                return 1
            time.sleep(0.02)

    def _watch(self, servers: list[Child], workers: list[Child]) -> int:
        while True:
            if self._interrupted is not None:
                name = signal.Signals(self._interrupted).name
                self.say(f"interrupted by {name}; stopping", logging.WARNING)
                return 128 + self._interrupted
            for worker in workers:
                code = worker.process.poll()
                if code is not None and code != 0:
                    for thread in worker.threads:  # its last words, to say why
                        thread.join(timeout=2.0)
                    self.say(
                        f"{worker.label} {worker.describe_exit()}{self._why_it_failed(worker)}; "
                        f"stopping the others"
                    )
                    return exit_status(code)
            for server in servers:
                if server.process.poll() is not None:
                    status = self._server_exited(servers, server)
                    if status is not None:
                        return status
            if all(w.process.poll() == 0 for w in workers):
                self.say("all workers finished; stopping the servers", logging.INFO)
                return 0
            time.sleep(0.05)

    def _server_exited(self, servers: list[Child], server: Child) -> int | None:
        """``server`` exited while the workers run: restart it where allowed (None once it
        rejoined), else say so and return the job's exit status (its own, at least 1)."""
        what = f"{server.label} {server.describe_exit()} while workers were running"
        done = self.restarts.get(server.rank, 0)
        if not self.restart_servers or done >= self.max_restarts:
            limit = f" (restarted {done} time(s), --max-restarts {self.max_restarts})"
            self.say(f"{what}{limit if self.restart_servers else ''}; stopping the others")
            return exit_status(server.process.returncode) or 1
        self.restarts[server.rank] = done + 1
        where = self.backend.where("server", server.rank)
        self.say(
            f"{what}; restarting it{f' {where}' if where else ''} at "
            f"{self.addresses[server.rank]} (restart {done + 1} of {self.max_restarts})",
            logging.WARNING,
        )
        return self._restart(servers, server.rank)

    def _restart(self, servers: list[Child], rank: int) -> int | None:
        """Start a replacement of server ``rank`` (which exited), wait until it is ready and put
        it in its place in ``servers``; None once it rejoined, else the job's exit status.

        The replacement has the same rank and so the same host (backends place by role and
        rank), the port of the address the server had, the same arguments and environment, and
        ``KVSTORE_SERVERS`` listing every server's address. It is ready once it prints its
        READY line, and has rejoined if the address workers reach it at (through
        :meth:`Backend.server_address`) is the one they had. The restart fails, and so the job,
        if it cannot start, exits or is not ready within ``startup_timeout``, or comes up at
        another address.
        """
        address = self.addresses[rank]
        _, _, port = address.rpartition(":")
        try:
            replacement = self._start_server(rank, int(port), self.addresses)
        except (OSError, ValueError) as exc:
            self.say(f"cannot restart server {rank} at {address}: {exc}; stopping the others")
            return 1
        status = self._wait_ready([replacement])
        if status is not None:
            return status
        now = self.backend.server_address(rank, replacement.address or "")
        if now != address:
            self.say(f"server {rank} came back at {now}, not at {address}; stopping the others")
            return 1
        servers[rank] = replacement
        self.say(f"server {rank} rejoined at {address}", logging.INFO)
        return None
