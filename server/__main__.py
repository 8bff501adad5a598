"""``kvstore-server``: run one shard server until SIGTERM or SIGINT.

Once bound it prints exactly one line, ``KVSTORE_READY tcp://HOST:PORT``, on stdout. With
``--stop-on-stdin-eof`` (``kvstore-launch`` passes it, with a pipe that only it holds open as
stdin) it also stops when its stdin reaches end of file: when the launcher is gone, even killed
with SIGKILL, its servers do not run on as orphans. With
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
from collections.abc import Sequence

from kvstore import _logging
from kvstore._malloc import tune_malloc
from kvstore.config import ServerConfig
from kvstore.errors import ConfigError
from kvstore.launch_protocol import READY_PREFIX, STOP_REQUEST
from kvstore.server.server import ShardServer


def parse_args(argv: Sequence[str] | None = None) -> ServerConfig:
    return parse_command_line(argv)[0]


def parse_command_line(argv: Sequence[str] | None = None) -> tuple[ServerConfig, bool]:
    """The server's settings, and whether it stops when its stdin reaches end of file."""
    parser = argparse.ArgumentParser(
        prog="kvstore-server", description="Run one kvstore shard server."
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one")
    parser.add_argument("--server-rank", type=int, default=0, help="this server's rank I")
    parser.add_argument("--num-servers", type=int, default=1, help="number of servers S")
    parser.add_argument("--num-workers", type=int, required=True, help="number of workers N")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="decode/aggregate/optimizer threads (default: KVSTORE_SERVER_THREADS or min(4, CPUs))",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=None,
        help="largest frame accepted (default: KVSTORE_MAX_MESSAGE_BYTES, or the largest chunk "
        "of KVSTORE_PARTITION_BYTES)",
    )
    parser.add_argument(
        "--stop-on-stdin-eof",
        action="store_true",
        help="stop when stdin reaches end of file (kvstore-launch passes a pipe that it "
        "holds: its servers stop when it is gone)",
    )
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
    print(f"{READY_PREFIX} {address}", flush=True)
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
