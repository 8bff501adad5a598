"""``kvstore-launch``: start servers and workers of a job and supervise them.

Usage::

    kvstore-launch -n N [-s S] [--workers-per-host K] [--launcher local|ssh|slurm]
        [-H HOSTFILE] [--replicas R [--restart-servers [--max-restarts M]]] -- COMMAND ARGS...

``--launcher slurm`` runs inside a Slurm allocation (an ``sbatch`` script or an ``salloc``
shell) and starts every process on the allocation's nodes with ``srun``; see
:class:`~kvstore.deploy.backends.SlurmBackend`. The launcher logs (role ``launch``) in the
format of every kvstore process, at ``KVSTORE_LOG_LEVEL`` (default INFO).

``--replicas R`` (1 <= R <= S; default ``KVSTORE_REPLICAS``, else 1) gives every server and
worker ``KVSTORE_REPLICAS=R``: each server's shard is also held by the next R - 1 servers, and
the job survives the loss of R - 1 of them. With ``--restart-servers`` (R >= 2) a server that
exits while the workers run is started again, at most ``--max-restarts`` times (default 3) per
server: the same rank on the same host and port, with ``KVSTORE_SERVERS`` naming every server,
so that it catches up from a live replica (see :mod:`kvstore.deploy.supervisor`). Without it, a
server that exits fails the job.

Every job gets fresh CURVE keys (:mod:`kvstore.auth`): its servers admit only its workers, and
their connections are encrypted. ``--no-auth`` (or ``KVSTORE_AUTH=0``) starts a job without
them, for trusted networks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvstore import _logging
from kvstore.config import launcher_auth_from_env
from kvstore.deploy.backends import (
    Backend,
    LocalBackend,
    SlurmBackend,
    SSHBackend,
    read_hostfile,
)
from kvstore.deploy.supervisor import Supervisor
from kvstore.envvars import env_value
from kvstore.errors import ConfigError

DEFAULT_MAX_RESTARTS = 3
"""``--max-restarts``: how many times one server may be restarted (``--restart-servers``)."""

EPILOG = """\
launchers:
  local   every process on this machine
  ssh     each process on a host of -H HOSTFILE through ssh (servers on the first S hosts,
          then workers, cycling); remote processes run this launcher's interpreter by its path
          (or --python) with its directory first on PATH, in this working directory
  slurm   inside an allocation (sbatch, salloc): each process is a job step (srun) on the
          allocation's nodes, placed as with ssh

environment:
  KVSTORE_LOG_LEVEL   the launcher's and its processes' log level (default here: INFO)
  KVSTORE_AUTH=0      the same as --no-auth
  KVSTORE_REPLICAS=R  the default of --replicas
  KVSTORE_*           the other KVSTORE_ variables reach servers and workers (but credentials:
                      each job gets keys of its own)

examples:
  kvstore-launch -n 2 -s 2 -- python3 examples/mnist/train.py --epochs 3
  kvstore-launch -n 8 -s 2 --workers-per-host 4 --launcher ssh -H hosts -- python3 train.py
  kvstore-launch -n 4 -s 3 --replicas 2 --restart-servers -- python3 train.py
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore-launch",
        description="Start S kvstore servers and N copies of COMMAND as workers, and supervise\n"
        "them: when one fails, the others are stopped and the launcher exits with its code.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="workers N (required)")
    parser.add_argument(
        "-s", "--num-servers", type=int, default=None, help="servers S (default: N)"
    )
    parser.add_argument(
        "--workers-per-host",
        type=int,
        default=1,
        metavar="K",
        help="workers on each host (one per GPU): consecutive ranks share a host, and its K "
        "workers sum each push there first, so the host's link carries one worker's bytes "
        "(KVSTORE_LOCAL_RANK, KVSTORE_LOCAL_SIZE; N must be a multiple of K; default: 1)",
    )
    parser.add_argument(
        "--launcher",
        choices=("local", "ssh", "slurm"),
        default="local",
        help="where processes run, see below (default: local)",
    )
    parser.add_argument(
        "-H", "--hostfile", help="(ssh) hosts, one per line; required with --launcher ssh"
    )
    parser.add_argument(
        "--host",
        default=None,
        help="(local, slurm) address servers bind (default: 127.0.0.1 for local; 0.0.0.0 on "
        "each node for slurm, where workers connect to NODE:PORT)",
    )
    parser.add_argument(
        "--server-threads",
        type=int,
        default=None,
        help="threads per server (default: KVSTORE_SERVER_THREADS, else min(4, CPUs))",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the servers to be ready (default: %(default)s)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="VAR",
        help="(ssh) pass this local environment variable on to remote processes; repeatable "
        "(default: only KVSTORE_* variables)",
    )
    parser.add_argument(
        "--python",
        default=None,
        help=f"(ssh, slurm) interpreter that runs the servers on the hosts (default: this "
        f"launcher's, {sys.executable})",
    )
    parser.add_argument(
        "--ssh-command",
        default="ssh -o BatchMode=yes",
        help="(ssh) ssh client and its options (default: %(default)s)",
    )
    parser.add_argument(
        "--no-auth",
        action="store_true",
        help="start the job without CURVE keys (also KVSTORE_AUTH=0): servers then accept "
        "any process that reaches them, unencrypted; for trusted networks only (default: "
        "fresh keys for every job)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="R",
        help="servers that hold each shard: its own and the next R-1, so that the job survives "
        "the loss of R-1 servers; passed to every server and worker as KVSTORE_REPLICAS "
        "(1 <= R <= S; default: KVSTORE_REPLICAS, else 1)",
    )
    parser.add_argument(
        "--restart-servers",
        action="store_true",
        help="start a server that exits while the workers run again, with the same rank, host "
        "and port, and KVSTORE_SERVERS naming every server, so that it catches up from a live "
        "replica (needs --replicas >= 2; default: a server that exits fails the job)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="M",
        help="(--restart-servers) restarts of one server, at most; its next exit fails the job "
        f"(default: {DEFAULT_MAX_RESTARTS})",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after --")
    return parser


def check_replication(
    parser: argparse.ArgumentParser, args: argparse.Namespace, num_servers: int
) -> tuple[int, int]:
    """The job's replicas R and restarts per server from ``--replicas``, ``--restart-servers``
    and ``--max-restarts``; a parser error (exit 2) for R outside 1..S, ``--restart-servers``
    with R < 2, ``--max-restarts`` below 0 or without ``--restart-servers``."""
    replicas = args.replicas
    if replicas is None:
        try:
            replicas = env_value(os.environ, "KVSTORE_REPLICAS", 1)
        except ConfigError as exc:
            parser.error(str(exc))
    if not 1 <= replicas <= num_servers:
        parser.error(f"--replicas must be between 1 and -s {num_servers}, got {replicas}")
    if args.restart_servers and replicas < 2:
        parser.error(
            f"--restart-servers needs --replicas >= 2 (got {replicas}): a restarted server "
            f"without replicas would come back empty"
        )
    if args.max_restarts is not None and not args.restart_servers:
        parser.error("--max-restarts is for --restart-servers")
    max_restarts = DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts
    if max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {max_restarts}")
    return replicas, max_restarts


# Not __name__: run as ``python -m kvstore.deploy`` that is "__main__", outside the kvstore tree.
logger = logging.getLogger("kvstore.deploy")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _logging.configure("launch", default_level="INFO")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("give the worker command after --, e.g. -- python train.py")
    if args.num_workers < 1:
        parser.error(f"-n must be >= 1, got {args.num_workers}")
    num_servers = args.num_servers if args.num_servers is not None else args.num_workers
    if num_servers < 1:
        parser.error(f"-s must be >= 1, got {num_servers}")
    k = args.workers_per_host
    if k < 1 or args.num_workers % k:
        parser.error(f"--workers-per-host must be >= 1 and divide -n {args.num_workers}, got {k}")
    if args.hostfile and args.launcher != "ssh":
        parser.error("-H is for --launcher ssh")
    replicas, max_restarts = check_replication(parser, args, num_servers)
    backend: Backend
    try:
        auth = not args.no_auth and launcher_auth_from_env()
        if args.launcher == "ssh":
            if not args.hostfile:
                parser.error("--launcher ssh needs -H HOSTFILE")
            backend = SSHBackend(
                read_hostfile(args.hostfile),
                num_servers=num_servers,
                ssh_command=args.ssh_command.split(),
                python=args.python,
                forward_env=args.env,
                workers_per_host=k,
            )
        elif args.launcher == "slurm":
            backend = SlurmBackend.from_env(
                num_servers=num_servers,
                bind=args.host or "0.0.0.0",
                python=args.python,
                workers_per_host=k,
            )
            _describe_slurm(backend, args.num_workers, num_servers)
        else:
            backend = LocalBackend(args.host or "127.0.0.1")
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        supervisor = Supervisor(
            backend,
            args.num_workers,
            num_servers,
            command,
            startup_timeout=args.startup_timeout,
            server_threads=args.server_threads,
            workers_per_host=k,
            auth=auth,
            replicas=replicas,
            restart_servers=args.restart_servers,
            max_restarts=max_restarts,
        )
    except ConfigError as exc:  # (a libzmq without CURVE)
        parser.error(str(exc))
    return supervisor.run()


def _describe_slurm(backend: SlurmBackend, num_workers: int, num_servers: int) -> None:
    def hosts(role: str, count: int) -> str:
        return " ".join(backend.node(role, r) for r in range(count))

    logger.info(
        "slurm job %s, %d node(s): servers on %s; workers on %s",
        backend.job_id or "?",
        len(backend.nodes),
        hosts("server", num_servers),
        hosts("worker", num_workers),
    )


if __name__ == "__main__":
    sys.exit(main())
