"""The few rtnetlink link settings the cluster harness needs that older iproute2 cannot set.

A link's largest TCP segmentation (GSO) and receive coalescing (GRO) units for IPv4 above 64
KiB ("BIG TCP", Linux 6.3) are the ``IFLA_GSO_IPV4_MAX_SIZE`` and ``IFLA_GRO_IPV4_MAX_SIZE``
attributes; ``ip link`` learned them in iproute2 6.3, and machines ship older ones. This module
sends the one ``RTM_NEWLINK`` request that sets them and reads them back with ``RTM_GETLINK``,
in the network namespace of the calling process.
"""

from __future__ import annotations

import socket
import struct

# linux/rtnetlink.h, linux/netlink.h, linux/if_link.h
RTM_NEWLINK = 16
RTM_GETLINK = 18
NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
IFLA_GSO_MAX_SIZE = 41
IFLA_GRO_MAX_SIZE = 58
IFLA_GSO_IPV4_MAX_SIZE = 63
IFLA_GRO_IPV4_MAX_SIZE = 64

_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port
_IFINFOMSG = struct.Struct("=BxHiII")  # family, device type, index, flags, change mask
_NLATTR = struct.Struct("=HH")  # length, type


def _request(kind: int, flags: int, ifname: str, attrs: dict[int, int]) -> bytes:
    """Send one link request for ``ifname`` and return the kernel's first reply message."""
    body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, socket.if_nametoindex(ifname), 0, 0)
    for attr, value in attrs.items():  # every attribute here is a u32
        body += _NLATTR.pack(_NLATTR.size + 4, attr) + struct.pack("=I", value)
    header = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, NLM_F_REQUEST | flags, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.bind((0, 0))
        sock.send(header + body)
        reply = sock.recv(65536)
    length, reply_kind, _flags, _seq, _port = _NLMSGHDR.unpack_from(reply)
    if reply_kind == NLMSG_ERROR:
        (error,) = struct.unpack_from("=i", reply, _NLMSGHDR.size)
        if error:
            raise OSError(-error, f"rtnetlink request for link {ifname!r} failed")
    return reply[:length]


def set_segment_sizes(ifname: str, max_bytes: int) -> None:
    """Let link ``ifname`` carry TCP segments and coalesced receives of up to ``max_bytes``.

    Sets the IPv4 and the generic GSO and GRO maximums. A kernel older than 6.3 ignores the
    IPv4 ones (see :func:`ipv4_segment_size`); one that refuses the size (above the device's
    ``tso_max_size``) raises ``OSError``.
    """
    attrs = {IFLA_GSO_MAX_SIZE: max_bytes, IFLA_GRO_MAX_SIZE: max_bytes,
             IFLA_GSO_IPV4_MAX_SIZE: max_bytes, IFLA_GRO_IPV4_MAX_SIZE: max_bytes}  # fmt: skip
    _request(RTM_NEWLINK, NLM_F_ACK, ifname, attrs)


def ipv4_segment_size(ifname: str) -> int | None:
    """Link ``ifname``'s largest IPv4 GSO unit, or None where the kernel has no such setting."""
    reply = _request(RTM_GETLINK, 0, ifname, {})
    offset = _NLMSGHDR.size + _IFINFOMSG.size
    while offset + _NLATTR.size <= len(reply):
        length, kind = _NLATTR.unpack_from(reply, offset)
        if length < _NLATTR.size:
            break
        if kind & 0x3FFF == IFLA_GSO_IPV4_MAX_SIZE:
            return struct.unpack_from("=I", reply, offset + _NLATTR.size)[0]
        offset += (length + 3) & ~3
    return None
