"""``kvstore-server``: run one shard server until SIGTERM or SIGINT.

Once bound it prints exactly one line on stdout (:func:`ready_line`): ``KVSTORE_READY
tcp://HOST:PORT`` where stdout is not a terminal (a launcher reads it from a pipe), a sentence
with the same address at a terminal; HOST is the host's name for a server bound to every
interface (``--host 0.0.0.0``). With
``--stop-on-stdin-eof`` (``kvstore-launch`` passes it, with a pipe that only it holds open as
stdin) it also stops when its stdin reaches end of file: after the launcher's stop request
(:mod:`kvstore.launch_protocol`) when the job is done, without it when the launcher is gone, so
that even a launcher killed with SIGKILL leaves no orphan servers. With
``KVSTORE_METRICS_PORT`` set it also serves Prometheus metrics (:mod:`kvstore.metrics`; server I
on port ``P + I``) and logs their URL at INFO. With the job's CURVE keys (``KVSTORE_AUTH_DIR``
or ``KVSTORE_AUTH_*_KEY``, :mod:`kvstore.auth`) it admits only the job's workers, encrypted;
without them it accepts any worker and logs a warning saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import textwrap
from collections.abc import Sequence

from kvstore import _logging
from kvstore._malloc import tune_malloc
from kvstore.auth import credentials_help
from kvstore.config import AUTH_VARS, ServerConfig
from kvstore.envvars import ENV_VARS
from kvstore.errors import ConfigError
from kvstore.launch_protocol import READY_PREFIX, STOP_REQUEST
from kvstore.server.server import ShardServer


def parse_args(argv: Sequence[str] | None = None) -> ServerConfig:
    return parse_command_line(argv)[0]


HELP_WIDTH = 79
"""Width of the lines of ``--help``'s variable list."""


def _environment_help() -> str:
    """The variables a server reads besides its keys, with their defaults, from the table that
    docs/operations.md documents (:data:`kvstore.envvars.ENV_VARS`)."""
    lines = ["environment (docs/operations.md describes each variable):"]
    for var in ENV_VARS:
        if "server" in var.role and var.name not in AUTH_VARS:
            text = f"{var.type}; default: {var.default}"
            lines += textwrap.wrap(
                text, HELP_WIDTH, initial_indent=f"  {var.name:<27} ", subsequent_indent=" " * 30
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """``kvstore-server``'s command line; its ``--help`` gives every default, how to give the
    server the job's keys and the variables it reads."""
    parser = argparse.ArgumentParser(
        prog="kvstore-server",
        description="Run one kvstore shard server until SIGTERM or SIGINT.\n"
        "Once it serves, it prints where workers reach it on stdout: a sentence at a\n"
        f"terminal, else (a pipe, which a launcher or a script reads) `{READY_PREFIX} ADDRESS`.",
        epilog=f"{credentials_help(('server',))}\n\n{_environment_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind: an address or a host name; 0.0.0.0 binds every interface and "
        "gives workers this host's name (default: %(default)s)",
    )
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: 0, a free port)")
    parser.add_argument(
        "--server-rank",
        type=int,
        default=0,
        metavar="I",
        help="this server's rank I (default: %(default)s)",
    )
    parser.add_argument(
        "--num-servers",
        type=int,
        default=1,
        metavar="S",
        help="number of servers S (default: %(default)s)",
    )
    parser.add_argument(
        "--num-workers", type=int, required=True, metavar="N", help="number of workers N (required)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="T",
        help="decode/aggregate/optimizer threads (default: KVSTORE_SERVER_THREADS, else "
        "min(4, CPUs))",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="R",
        help="servers that hold each shard: a backup of the R-1 servers before this one, and "
        "this one's rounds forwarded to the R-1 after it (default: KVSTORE_REPLICAS, else 1)",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="largest frame accepted (default: KVSTORE_MAX_MESSAGE_BYTES, else the largest "
        "chunk of KVSTORE_PARTITION_BYTES)",
    )
    parser.add_argument(
        "--stop-on-stdin-eof",
        action="store_true",
        help="stop when stdin reaches end of file (kvstore-launch passes a pipe that it "
        "holds and writes 'stop' to at the job's end: its servers stop then, or when it is "
        "gone; default: off)",
    )
    return parser


def parse_command_line(argv: Sequence[str] | None = None) -> tuple[ServerConfig, bool]:
    """The server's settings, and whether it stops when its stdin reaches end of file."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return ServerConfig.from_env(
            host=args.host,
            port=args.port,
            server_rank=args.server_rank,
            num_servers=args.num_servers,
            num_workers=args.num_workers,
            threads=args.threads,
            max_message_bytes=args.max_message_bytes,
            replicas=args.replicas,
        ), args.stop_on_stdin_eof
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _watch_stdin(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Set ``stop`` when stdin reaches end of file: after :data:`STOP_REQUEST`, the launcher
    stopping its job; without it, its writer (the launcher) is gone."""
    fd = 0  # (not sys.stdin, which may hold a buffered read of it)
    received = bytearray()

    def readable() -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            # (the request is all a launcher writes; anything longer is kept no further)
            received.extend(data[: max(0, len(STOP_REQUEST) - len(received))])
            return
        loop.remove_reader(fd)
        log = logging.getLogger("kvstore.server")
        if received.startswith(STOP_REQUEST):
            log.info("the launcher asked this server to stop: the job is done")
        else:
            log.warning("stdin closed: the launcher that started this server is gone; stopping")
        stop.set()

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)


def ready_line(config: ServerConfig, address: str, terminal: bool) -> str:
    """What a server that serves at ``address`` prints on stdout: for a program reading a pipe
    (``terminal`` False: a launcher, a script, a test), the line ``KVSTORE_READY ADDRESS``; for
    a person at a terminal, a sentence saying how workers reach it."""
    if not terminal:
        return f"{READY_PREFIX} {address}"
    rank, servers = config.server_rank, config.num_servers
    where = f"kvstore-server: server {rank}/{servers} ready at {address}; "
    if servers == 1:
        return f"{where}start the workers with KVSTORE_SERVERS={address}"
    return (
        f"{where}the workers' KVSTORE_SERVERS lists the {servers} servers' addresses in rank "
        f"order, this one at position {rank} (counting from 0)"
    )


async def serve(config: ServerConfig, *, stop_on_stdin_eof: bool = False) -> int:
    """Serve until SIGTERM/SIGINT (or, with ``stop_on_stdin_eof``, until stdin is closed);
    print the READY line once bound."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if stop_on_stdin_eof:
        _watch_stdin(loop, stop)
    server = ShardServer(config)
    try:
        address = await server.start()
    except (OSError, ConfigError) as exc:  # (ConfigError: the metrics extra is missing)
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return 1
    # Everything allocated so far (modules, numba, numpy, the server's state) lives as long as
    # the process. Frozen, those tens of thousands of objects are no longer re-scanned by every
    # full collection, each of which would otherwise stall the event loop for milliseconds while
    # it serves. Reference counting still frees frozen objects; only the cyclic collector skips
    # them.
    gc.freeze()
    print(ready_line(config, address, sys.stdout.isatty()), flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    config, stop_on_stdin_eof = parse_command_line(argv)
    _logging.configure(f"server {config.server_rank}", default_level="INFO")
    tune_malloc()
    try:
        import uvloop  # noqa: PLC0415

        return uvloop.run(serve(config, stop_on_stdin_eof=stop_on_stdin_eof))
    except ImportError:  # uvloop is not available on every platform
        return asyncio.run(serve(config, stop_on_stdin_eof=stop_on_stdin_eof))


if __name__ == "__main__":
    sys.exit(main())
