"""Launcher backends: where each process runs and the local command line that starts it.

A backend only turns "run this argv with these variables as server 2 / worker 0" into a command
and environment for a local child process; the :mod:`~kvstore.deploy.supervisor` starts, watches
and stops those children. ``local`` runs everything on this machine; ``ssh`` runs each process
on a host from a hostfile through ``ssh`` (servers first, then workers, cycling through the
hosts like MXNet's launcher, see :func:`place`), quoting every word with :func:`shlex.quote`;
``slurm`` places them the same way on the nodes of the Slurm allocation it runs in (read by
:mod:`kvstore.deploy.slurm_env`) and starts each with ``srun``.
"""

from __future__ import annotations

import os
import shlex
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvstore.auth import SECRET_VARS
from kvstore.deploy.slurm_env import allocation_from_env
from kvstore.errors import ConfigError


@dataclass(frozen=True)
class ChildCommand:
    """A local child process to start: argv, the complete environment, and bytes to write to
    its stdin first (None: nothing; :class:`SSHBackend` sends secrets that way)."""

    argv: list[str]
    env: dict[str, str]
    stdin: bytes | None = None


class Backend(ABC):
    """How processes of a job are placed and started."""

    name: ClassVar[str]

    @abstractmethod
    def server_host(self, server_rank: int) -> str:
        """The ``--host`` server ``server_rank`` binds (and, by default, workers connect to)."""

    def server_address(self, server_rank: int, ready_address: str) -> str:
        """The address workers connect to, given the one the server printed when ready.

        The server's own: it names the host it bound. A backend whose servers bind every
        interface (``0.0.0.0``, where the server can only guess its name) puts the name that
        the workers' hosts know instead.
        """
        return ready_address

    @abstractmethod
    def server_python(self) -> str:
        """The Python interpreter that runs ``-m kvstore.server`` where servers run."""

    def where(self, role: str, rank: int) -> str:
        """Where ``role`` ``rank`` runs, for messages (``on host h1``; empty here)."""
        return ""

    def start_hint(self) -> str:
        """How to give the processes an interpreter that has kvstore, for messages."""
        return "install the package in the interpreter that runs the servers"

    def explain_start_failure(self, role: str, rank: int, code: int | None, stderr: str) -> str:
        """Why ``role`` ``rank`` could not start, from its exit code and the end of its stderr,
        when that is one of the usual causes; empty otherwise."""
        where = self.where(role, rank)
        where = f" {where}" if where else ""
        python = self.server_python() if role == "server" else "the worker command"
        if "No module named 'kvstore" in stderr or "No module named kvstore" in stderr:
            return f"{python}{where} cannot import kvstore: {self.start_hint()}"
        if code == 127:  # (the shell's "command not found")
            return f"{python} was not found{where}: {self.start_hint()}"
        return ""

    @abstractmethod
    def child(
        self, role: str, rank: int, argv: Sequence[str], env: Mapping[str, str]
    ) -> ChildCommand:
        """The local command that runs ``argv`` with the extra variables ``env``."""


class LocalBackend(Backend):
    """Every process on this machine; servers bind ``host`` (default 127.0.0.1)."""

    name = "local"

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host

    def server_host(self, server_rank: int) -> str:
        return self.host

    def server_python(self) -> str:
        return sys.executable

    def child(
        self, role: str, rank: int, argv: Sequence[str], env: Mapping[str, str]
    ) -> ChildCommand:
        return ChildCommand(list(argv), {**os.environ, **env})


def _remote_interpreter_hint(launcher: str, place: str) -> str:
    """The way out for a process that could not start on a remote ``place`` ("host", "node")
    of a launcher that runs its own interpreter there by its path."""
    return (
        f"the {launcher} launcher runs the launcher's own interpreter on every {place}, by its "
        f"path; keep the same environment at the same path there (a shared file system does), "
        f"or give --python the interpreter that has kvstore on the {place}s"
    )


def read_hostfile(path: str | Path) -> list[str]:
    """Hosts from a hostfile: one per line, ``#`` comments and blank lines ignored.

    A ``host slots=K`` or ``host:K`` suffix (MPI style) is accepted and the slot count ignored.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read hostfile {path}: {exc}") from None
    hosts = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host = line.split()[0]
        if host.count(":") == 1:
            host = host.split(":", 1)[0]
        hosts.append(host)
    if not hosts:
        raise ConfigError(f"hostfile {path} lists no hosts")
    return hosts


def place(
    hosts: Sequence[str], num_servers: int, role: str, rank: int, workers_per_host: int = 1
) -> str:
    """The host of ``role`` ``rank``: servers take hosts ``0..S-1``, workers the following ones,
    cycling through ``hosts`` (so with one host everything runs there); with
    ``workers_per_host`` k, workers ``h*k .. h*k+k-1`` share the h-th worker host."""
    slot = rank if role == "server" else num_servers + rank // workers_per_host
    return hosts[slot % len(hosts)]


class SSHBackend(Backend):
    """Processes on remote hosts through ``ssh``.

    Servers take hosts ``0..S-1`` of the hostfile (cycling), workers the following ones, so with
    5 hosts, 3 servers and 3 workers the servers run on hosts 1-3 and the workers on hosts 4, 5
    and 1. Remote commands run in the launcher's working directory (which must exist there,
    e.g. a shared file system), with the job variables and those named by ``forward_env``; the
    secret keys of the job's credentials go over ssh's stdin instead of the command line.

    The remote shell of ``ssh host command`` is not a login shell: its ``PATH`` is the system's,
    where ``python3`` is not the environment kvstore was installed in. So servers run
    ``python`` (default: the launcher's own interpreter, by its path), and every remote command
    gets that interpreter's directory first on its ``PATH``, so that ``python3`` and console
    scripts in the worker command are the same environment's: hosts need that environment at
    the same path (a shared file system, or the same virtualenv path everywhere). Forwarding
    ``PATH`` itself (``forward_env``) replaces that rule.

    Args:
        hosts: host names.
        ssh_command: the ssh client and its options.
        python: the interpreter on the hosts (None: this one's path).
        forward_env: names of local variables to pass on (``KVSTORE_*`` always are).
        num_servers: S, to place workers after servers.
        workers_per_host: k, consecutive worker ranks that share a host (:func:`place`).
    """

    name = "ssh"

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        num_servers: int,
        ssh_command: Sequence[str] = ("ssh", "-o", "BatchMode=yes"),
        python: str | None = None,
        forward_env: Sequence[str] = (),
        workers_per_host: int = 1,
    ) -> None:
        if not hosts:
            raise ConfigError("the ssh launcher needs at least one host (-H HOSTFILE)")
        self.hosts = list(hosts)
        self.num_servers = num_servers
        self.workers_per_host = workers_per_host
        self.ssh_command = list(ssh_command)
        self.python = python or sys.executable
        self.forward_env = list(forward_env)

    def _host(self, role: str, rank: int) -> str:
        return place(self.hosts, self.num_servers, role, rank, self.workers_per_host)

    def server_host(self, server_rank: int) -> str:
        return self._host("server", server_rank)

    def server_python(self) -> str:
        return self.python

    def where(self, role: str, rank: int) -> str:
        return f"on host {self._host(role, rank)}"

    def start_hint(self) -> str:
        return _remote_interpreter_hint(self.name, "host")

    def child(
        self, role: str, rank: int, argv: Sequence[str], env: Mapping[str, str]
    ) -> ChildCommand:
        remote_env = {k: v for k, v in os.environ.items() if k.startswith("KVSTORE_")}
        for name in self.forward_env:
            if name in os.environ:
                remote_env[name] = os.environ[name]
        remote_env.update(env)
        # Secret keys never go on the command line, which every user of either host can read
        # (ps): they travel over ssh's stdin, as NAME=VALUE lines up to an empty line, read by
        # a POSIX sh prelude that exports them and then runs the command with the rest of stdin.
        secrets = {k: v for k, v in remote_env.items() if k in SECRET_VARS and v}
        for name in SECRET_VARS:
            remote_env.pop(name, None)
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(remote_env.items()))
        if "PATH" not in remote_env:
            # The interpreter's directory first on the remote PATH ("$PATH": the remote one).
            bin_dir = os.path.dirname(self.python)
            if bin_dir:
                exports = f'PATH={shlex.quote(bin_dir)}:"$PATH" {exports}'
        command = " ".join(shlex.quote(a) for a in argv)
        run = f"env {exports} {command}"
        stdin = None
        if secrets:
            run = f"sh -c {shlex.quote(_READ_SECRETS)} kvstore-launch {run}"
            stdin = "".join(f"{k}={v}\n" for k, v in sorted(secrets.items())).encode() + b"\n"
        remote = f"cd {shlex.quote(os.getcwd())} && {run}"
        return ChildCommand(
            [*self.ssh_command, self._host(role, rank), remote], dict(os.environ), stdin
        )


_READ_SECRETS = 'while IFS= read -r kv && [ -n "$kv" ]; do export "$kv"; done; exec "$@"'
"""The remote prelude of :meth:`SSHBackend.child` (POSIX sh): export the NAME=VALUE lines of
stdin up to an empty one, then run the command (its arguments). ``read`` takes a pipe one byte
at a time, so the command's stdin starts right after the empty line."""


class SlurmBackend(Backend):
    """Processes on the nodes of the Slurm allocation the launcher runs in, one ``srun`` each.

    Placement is the ssh backend's (:func:`place`: servers on nodes ``0..S-1``, then workers,
    cycling). Each process is a job step of its own, started from the launcher's node with::

        srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap --chdir=CWD --export=ALL \
             --job-name=kvstore-ROLE-RANK ARGV...

    ``--overlap`` lets the steps on one node (a server and workers) share its CPUs, so that they
    all start whatever the allocation's shape (without it a second step on a node waits for
    CPUs no step gives back); there is no ``--exact``, which would confine each process to the
    one CPU its step asked for instead of the node's share of the allocation.
    ``--export=ALL`` (over a ``SLURM_EXPORT_ENV`` the user may have set) carries the
    launcher's environment, the job's ``KVSTORE_*`` variables included, to the process.

    Servers bind ``bind`` (default ``0.0.0.0``: every interface, whatever the node's own name
    resolves to there) and workers connect to ``tcp://NODE:PORT``, the node names being what
    Slurm and so the cluster's resolver know.

    Args:
        nodes: node names (see :func:`kvstore.deploy.slurm_env.allocation_from_env`).
        num_servers: S, to place workers after servers.
        srun: the ``srun`` to run.
        bind: the address servers bind on their node.
        python: the interpreter on the nodes (default: this one, as with a shared file system
            and the exported ``PATH``).
        job_id: ``SLURM_JOB_ID``, for messages.
        workers_per_host: k, consecutive worker ranks that share a node (:func:`place`).
    """

    name = "slurm"

    def __init__(
        self,
        nodes: Sequence[str],
        *,
        num_servers: int,
        srun: str = "srun",
        bind: str = "0.0.0.0",
        python: str | None = None,
        job_id: str | None = None,
        workers_per_host: int = 1,
    ) -> None:
        if not nodes:
            raise ConfigError("the slurm launcher needs at least one node")
        self.nodes = list(nodes)
        self.num_servers = num_servers
        self.workers_per_host = workers_per_host
        self.srun = srun
        self.bind = bind
        self.python = python or sys.executable
        self.job_id = job_id

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        num_servers: int,
        bind: str = "0.0.0.0",
        python: str | None = None,
        workers_per_host: int = 1,
    ) -> SlurmBackend:
        """The backend for the allocation described by Slurm's variables in ``env``.

        Raises:
            ConfigError: not inside an allocation, or no ``srun`` on ``PATH``.
        """
        allocation = allocation_from_env(os.environ if env is None else env)
        return cls(
            allocation.nodes,
            num_servers=num_servers,
            srun=allocation.srun,
            bind=bind,
            python=python,
            job_id=allocation.job_id,
            workers_per_host=workers_per_host,
        )

    def node(self, role: str, rank: int) -> str:
        """The node ``role`` ``rank`` runs on."""
        return place(self.nodes, self.num_servers, role, rank, self.workers_per_host)

    def server_host(self, server_rank: int) -> str:
        return self.bind

    def server_address(self, server_rank: int, ready_address: str) -> str:
        _, sep, port = ready_address.rpartition(":")
        if not sep or not port.isdigit():
            return ready_address
        return f"tcp://{self.node('server', server_rank)}:{port}"

    def server_python(self) -> str:
        return self.python

    def where(self, role: str, rank: int) -> str:
        return f"on node {self.node(role, rank)}"

    def start_hint(self) -> str:
        return _remote_interpreter_hint(self.name, "node")

    def child(
        self, role: str, rank: int, argv: Sequence[str], env: Mapping[str, str]
    ) -> ChildCommand:
        step = [
            self.srun,
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={self.node(role, rank)}",
            "--overlap",
            f"--chdir={os.getcwd()}",
            "--export=ALL",
            f"--job-name=kvstore-{role}-{rank}",
        ]
        return ChildCommand([*step, *argv], {**os.environ, **env})


BACKENDS: dict[str, type[Backend]] = {
    "local": LocalBackend,
    "ssh": SSHBackend,
    "slurm": SlurmBackend,
}
