"""Launchers: ``kvstore-launch`` and its backends (``local``, ``ssh``, ``slurm``).

The deployment files beside this package (``Dockerfile``, ``k8s/``, ``slurm/job.sbatch``) are
repository files, not package data: docs/operations.md says how to use them.
"""

from kvstore.deploy.backends import Backend, LocalBackend, SlurmBackend, SSHBackend
from kvstore.deploy.supervisor import Supervisor

__all__ = ["Backend", "LocalBackend", "SSHBackend", "SlurmBackend", "Supervisor"]
