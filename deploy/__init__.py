"""Launchers: ``kvstore-launch`` and its backends (``local``, ``ssh``)."""

from kvstore.deploy.backends import Backend, LocalBackend, SSHBackend
from kvstore.deploy.supervisor import Supervisor

__all__ = ["Backend", "LocalBackend", "SSHBackend", "Supervisor"]
