"""The admission gate's sockets: where it listens, the loopback addresses its relayed connections
come from, and the file limit its connections need (:mod:`kvstore.server.gate`)."""

from __future__ import annotations

import resource
import socket
from typing import Any

RELAY_NETWORK = (127 << 24) | (64 << 16)
"""127.64.0.0: the gate's relayed connections come from addresses of 127.64.0.0/10."""
RELAY_ADDRESSES = 1 << 22


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` as ZeroMQ binds one: the first address ``host``
    resolves to (``*`` and an empty host: every IPv4 interface; ``::``: every interface, IPv4
    included)."""
    if host in ("*", ""):
        host = "0.0.0.0"
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def relay_address(index: int) -> str:
    """The loopback address of the ``index``-th relayed connection (wrapping), skipping the
    addresses that end in 0 or 255."""
    index %= RELAY_ADDRESSES - (RELAY_ADDRESSES >> 7)
    # 254 usable last octets per /24: 1..254
    block, offset = divmod(index, 254)
    value = RELAY_NETWORK + (block << 8) + offset + 1
    return socket.inet_ntoa(value.to_bytes(4, "big"))


def relay_addresses_work() -> bool:
    """Whether this host can open connections from 127.64.0.0/10 (Linux routes all of
    127.0.0.0/8 to the loopback; other systems may not)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.bind((relay_address(0), 0))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def raise_file_limit(connections: int) -> None:
    """Raise this process's soft limit on open files, within its hard limit, so that
    ``connections`` relayed connections (two descriptors each, and libzmq's one) fit."""
    wanted = 3 * connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (OSError, ValueError):  # not allowed here: the accept errors will say so
                pass


def peer_text(peername: Any) -> str:
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peername)
