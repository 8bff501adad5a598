"""Launcher backends: where each process runs and the local command line that starts it.

A backend only turns "run this argv with these variables as server 2 / worker 0" into a command
and environment for a local child process; the :mod:`~kvstore.deploy.supervisor` starts, watches
and stops those children. ``local`` runs everything on this machine; ``ssh`` runs each process
on a host from a hostfile through ``ssh`` (servers first, then workers, cycling through the
hosts like MXNet's launcher), quoting every word with :func:`shlex.quote`.
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

from kvstore.errors import ConfigError


@dataclass(frozen=True)
class ChildCommand:
    """A local child process to start: argv and the complete environment."""

    argv: list[str]
    env: dict[str, str]


class Backend(ABC):
    """How processes of a job are placed and started."""

    name: ClassVar[str]

    @abstractmethod
    def server_host(self, server_rank: int) -> str:
        """The host server ``server_rank`` binds to and workers connect to."""

    @abstractmethod
    def server_python(self) -> str:
        """The Python interpreter that runs ``-m kvstore.server`` where servers run."""

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


class SSHBackend(Backend):
    """Processes on remote hosts through ``ssh``.

    Servers take hosts ``0..S-1`` of the hostfile (cycling), workers the following ones, so with
    5 hosts, 3 servers and 3 workers the servers run on hosts 1-3 and the workers on hosts 4, 5
    and 1. Remote commands run in the launcher's working directory (which must exist there,
    e.g. a shared file system), with the job variables and those named by ``forward_env``.

    Args:
        hosts: host names.
        ssh_command: the ssh client and its options.
        python: the interpreter on the hosts.
        forward_env: names of local variables to pass on (``KVSTORE_*`` always are).
        num_servers: S, to place workers after servers.
    """

    name = "ssh"

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        num_servers: int,
        ssh_command: Sequence[str] = ("ssh", "-o", "BatchMode=yes"),
        python: str = "python3",
        forward_env: Sequence[str] = (),
    ) -> None:
        if not hosts:
            raise ConfigError("the ssh launcher needs at least one host (-H HOSTFILE)")
        self.hosts = list(hosts)
        self.num_servers = num_servers
        self.ssh_command = list(ssh_command)
        self.python = python
        self.forward_env = list(forward_env)

    def _host(self, role: str, rank: int) -> str:
        slot = rank if role == "server" else self.num_servers + rank
        return self.hosts[slot % len(self.hosts)]

    def server_host(self, server_rank: int) -> str:
        return self._host("server", server_rank)

    def server_python(self) -> str:
        return self.python

    def child(
        self, role: str, rank: int, argv: Sequence[str], env: Mapping[str, str]
    ) -> ChildCommand:
        remote_env = {k: v for k, v in os.environ.items() if k.startswith("KVSTORE_")}
        for name in self.forward_env:
            if name in os.environ:
                remote_env[name] = os.environ[name]
        remote_env.update(env)
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(remote_env.items()))
        command = " ".join(shlex.quote(a) for a in argv)
        remote = f"cd {shlex.quote(os.getcwd())} && env {exports} {command}"
        return ChildCommand([*self.ssh_command, self._host(role, rank), remote], dict(os.environ))


BACKENDS: dict[str, type[Backend]] = {"local": LocalBackend, "ssh": SSHBackend}
