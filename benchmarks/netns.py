"""A cluster of hosts made of Linux network namespaces, joined by a bridge, links shaped by tc.

Each host is a network namespace with one veth link to a bridge in the root namespace. Both
directions of every link are shaped to the same rate with a token bucket (``tbf``): the host's
end shapes what it sends (its uplink), the bridge's end shapes what it receives (its downlink),
so every host has a full-duplex link of ``rate`` like a NIC on a switch. Under each shaper the
queue is ``pfifo_fast``, which sends packets marked low-delay (IP TOS) first, like a Linux host.
Every host's TCP congestion control is pinned (``tcp_cc``, default ``cubic``, Linux's default),
so results do not depend on what the machine running the benchmark chose for itself.

Every host sends TCP in units of up to ``gso_max_bytes`` (default 192 KiB, "BIG TCP" where the
kernel has it, 6.3 and later; Linux's default is 64 KiB): each unit crosses the host's veth, its
shaper, the bridge, the peer's shaper and veth as one packet, so the emulated switch and NICs cost
the machine a third of the packets. A real NIC segments and coalesces in hardware; here that work
runs on the cores the job runs on. The shapers still pass the bytes at ``rate``; a unit is 1.6 ms
of a 1 Gbit/s link.
Processes run in a host with ``ip netns exec``. Everything is torn down on exit (processes by
pid, then namespaces, veths and the bridge), also when the benchmark fails.

With ``pin_cpus`` every host's processes run on the host's own share of the machine's cores
(:func:`host_cpus`), the way a real host's processes run on its own cores: where there are
fewer cores than hosts, each host gets one core and hosts take turns, so a host's processes
never move between cores (they keep their caches) and share their core only with the hosts
given the same one.

Needs root (``ip netns``); :func:`available` says whether this machine allows it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import REPO
from benchmarks.netlink import ipv4_segment_size, set_segment_sizes

_HEADROOM = 1024
"""Bytes of a shaper's bucket left for the headers of a largest TCP unit."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


DEFAULT_TCP_CC = "cubic"
"""Linux's default congestion control; some machine images pick another (e.g. ``bbr``)."""

LINUX_GSO_MAX_BYTES = 65536
"""Linux's default largest TCP segmentation unit, and the most a kernel before 6.3 allows."""
DEFAULT_GSO_MAX_BYTES = 192 * 1024
"""The hosts' largest TCP unit here: a third of the packets for the emulated links to handle."""

DEFAULT_BURST_BYTES = 256 * 1024
"""Token bucket depth of the shapers: 2 ms of a 1 Gbit/s link."""


def host_cpus(num_hosts: int, cpus: Iterable[int]) -> list[tuple[int, ...]]:
    """The cores each of ``num_hosts`` hosts runs on, out of ``cpus``.

    With at least as many cores as hosts, host ``i`` gets the ``i``-th of ``num_hosts``
    contiguous, equal shares (the cores left over go to the first hosts, one each); with fewer,
    host ``i`` gets the single core ``cpus[i % len(cpus)]``.
    """
    if num_hosts < 0:
        raise ValueError(f"num_hosts must be >= 0, got {num_hosts}")
    cores = sorted(set(cpus))
    if not cores:
        raise ValueError("no cores to run the hosts on")
    if len(cores) < num_hosts:
        return [(cores[i % len(cores)],) for i in range(num_hosts)]
    share, extra = divmod(len(cores), max(1, num_hosts))
    # host i starts after i shares and after the extra cores of the hosts before it
    starts = [i * share + min(i, extra) for i in range(num_hosts + 1)]
    return [tuple(cores[starts[i] : starts[i + 1]]) for i in range(num_hosts)]


def check_gso_max_bytes(gso_max_bytes: int, burst_bytes: int = DEFAULT_BURST_BYTES) -> None:
    """Raise ``ValueError`` unless TCP units of ``gso_max_bytes`` fit a shaper's bucket of
    ``burst_bytes`` with room for headers: a larger unit is cut into MTU-sized packets by the
    shaper (or dropped)."""
    if not 0 < gso_max_bytes <= burst_bytes - _HEADROOM:
        raise ValueError(
            f"gso_max_bytes={gso_max_bytes} must be positive and at most burst_bytes "
            f"({burst_bytes}) - {_HEADROOM}"
        )


_ALLOWED_CC = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
_AVAILABLE_CC = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
_DEFAULT_CC = Path("/proc/sys/net/ipv4/tcp_congestion_control")


def machine_tcp_cc() -> str:
    """The congestion control new namespaces inherit here (the machine's default)."""
    return _DEFAULT_CC.read_text().strip()


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"kvprobe{os.getpid() % 100000}"
    probe = _run("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


@dataclass
class Host:
    """One namespace: its name, address and the processes started in it."""

    index: int
    namespace: str
    address: str
    cpus: tuple[int, ...] | None = None
    """The cores its processes run on (None: wherever the machine's scheduler puts them)."""
    processes: list[subprocess.Popen] = field(default_factory=list)


class Cluster:
    """``num_hosts`` hosts on one bridge, every link shaped to ``rate_mbit`` in both directions.

    Args:
        num_hosts: hosts to create.
        rate_mbit: link rate, megabits per second; 0: links not shaped (veths at the
            machine's own speed).
        mtu: MTU of every link (1500 is standard Ethernet; 9000 jumbo frames).
        burst_bytes: token bucket depth of the shapers.
        queue_ms: how much queue (in time at the link rate) the shapers hold before dropping.
        gso_max_bytes: largest TCP unit a host sends (see the module doc); it must fit the
            shapers' bucket with room for headers. :attr:`gso_max_bytes` says what the kernel
            took: at most 64 KiB before Linux 6.3.
        tcp_cc: TCP congestion control of every host (``net.ipv4.tcp_congestion_control`` in
            its namespace); None keeps the machine's default. A namespace may only pick one
            the machine allows (``net.ipv4.tcp_allowed_congestion_control``, global): if
            ``tcp_cc`` is available but not allowed, it is added to that list for the
            cluster's lifetime and the list is restored on teardown.
        pin_cpus: run each host's processes on its own cores (:func:`host_cpus` of the cores
            this process may use); needs ``taskset`` (util-linux).
    """

    def __init__(
        self,
        num_hosts: int,
        rate_mbit: float = 1000.0,
        *,
        mtu: int = 1500,
        burst_bytes: int = DEFAULT_BURST_BYTES,
        queue_ms: float = 20.0,
        gso_max_bytes: int = DEFAULT_GSO_MAX_BYTES,
        tcp_cc: str | None = DEFAULT_TCP_CC,
        pin_cpus: bool = False,
    ) -> None:
        check_gso_max_bytes(gso_max_bytes, burst_bytes)
        if pin_cpus and shutil.which("taskset") is None:
            raise RuntimeError("pin_cpus needs taskset (util-linux), which is not installed")
        self.num_hosts = num_hosts
        self.rate_mbit = rate_mbit
        self.mtu = mtu
        self.burst_bytes = burst_bytes
        self.queue_ms = queue_ms
        self.requested_gso_max_bytes = gso_max_bytes
        self.gso_max_bytes = LINUX_GSO_MAX_BYTES  # what the kernel took, known once up
        self.tcp_cc = tcp_cc
        self._allowed_before: str | None = None  # the global list to restore, if we widened it
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"kvbr{tag}"
        cpus = host_cpus(num_hosts, os.sched_getaffinity(0)) if pin_cpus else None
        self.hosts = [
            Host(
                i,
                f"kvh{tag}-{i}",
                f"10.77.{i // 250}.{i % 250 + 1}",
                cpus[i] if cpus is not None else None,
            )
            for i in range(num_hosts)
        ]
        self._links: list[str] = []
        self._up = False

    def interface(self, host: int) -> str:
        """The name of host ``host``'s network interface (inside its namespace)."""
        return self._veths(host)[0]

    def bridge_port(self, host: int) -> str:
        """The name of the bridge's end of host ``host``'s link (in the root namespace): its
        counters in ``/sys/class/net`` are what the host sent and received."""
        return self._veths(host)[1]

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def _veths(self, i: int) -> tuple[str, str]:
        tag = self.bridge[4:]
        return f"kv{tag}h{i}", f"kv{tag}b{i}"

    def _pin_tcp_cc(self, netns: str) -> None:
        """Set the namespace's TCP congestion control to ``tcp_cc`` (see the class doc)."""
        if self.tcp_cc is None:
            return
        setting = f"net.ipv4.tcp_congestion_control={self.tcp_cc}"
        argv = ("ip", "netns", "exec", netns, "sysctl", "-qw", setting)
        if _run(*argv, check=False).returncode == 0:
            return
        allowed = _ALLOWED_CC.read_text().split()
        if self.tcp_cc not in allowed and self._allowed_before is None:
            # Outside the initial namespace only an allowed algorithm may become the default.
            self._allowed_before = " ".join(allowed)
            _ALLOWED_CC.write_text(" ".join([*allowed, self.tcp_cc]))
        result = _run(*argv, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"cannot set TCP congestion control {self.tcp_cc!r} in the hosts "
                f"({result.stderr.strip()}); available here: "
                f"{_AVAILABLE_CC.read_text().strip()}"
            )

    def _shape(self, netns: str | None, dev: str) -> None:
        """Token bucket at the link rate, queueing by TOS under it as Linux's pfifo_fast does.

        pfifo_fast (the classic default queue of a Linux NIC) keeps three bands picked by the
        packet's TOS, so a host's low-delay packets pass its bulk ones. Its length is the
        device's ``txqueuelen`` in packets, set here to hold ``queue_ms`` of full-size frames.
        """
        if self.rate_mbit <= 0:
            return  # links that cost nothing: a run's compute floor
        prefix = ["ip", "netns", "exec", netns] if netns else []
        queue_bytes = self.rate_bytes_per_s * self.queue_ms / 1000
        frames = str(max(16, int(queue_bytes // self.mtu)))
        _run(*prefix, "ip", "link", "set", dev, "txqueuelen", frames)
        _run(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf",
             "rate", f"{self.rate_mbit}mbit", "burst", str(self.burst_bytes),
             "latency", f"{self.queue_ms}ms")  # fmt: skip
        _run(*prefix, "tc", "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:",
             "pfifo_fast")  # fmt: skip

    def __enter__(self) -> Cluster:
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._links.append(self.bridge)
            _run("ip", "link", "set", self.bridge, "mtu", str(self.mtu), "up")
            for host in self.hosts:
                inner, outer = self._veths(host.index)
                _run("ip", "netns", "add", host.namespace)
                _run("ip", "link", "add", inner, "mtu", str(self.mtu), "type", "veth",
                     "peer", "name", outer, "mtu", str(self.mtu))  # fmt: skip
                self._links.append(outer)
                # Set while both ends are here: a link keeps them when it moves namespace.
                for end in (inner, outer):
                    set_segment_sizes(end, self.requested_gso_max_bytes)
                _run("ip", "link", "set", inner, "netns", host.namespace)
                _run("ip", "link", "set", outer, "master", self.bridge, "up")
                ns = ["ip", "-n", host.namespace]
                _run(*ns, "addr", "add", f"{host.address}/16", "dev", inner)
                _run(*ns, "link", "set", inner, "up")
                _run(*ns, "link", "set", "lo", "up")
                self._pin_tcp_cc(host.namespace)
                self._shape(host.namespace, inner)  # the host's uplink
                self._shape(None, outer)  # the host's downlink
            took = ipv4_segment_size(self.bridge_port(0)) if self.hosts else None  # all alike
            self.gso_max_bytes = min(self.requested_gso_max_bytes, took or LINUX_GSO_MAX_BYTES)
            self._up = True
            return self
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``host`` (on its cores, if pinned); stopped by
        :meth:`close` if still running. It runs in the repository's root unless ``kwargs`` name a
        ``cwd``: a benchmark's own processes run as ``python -m benchmarks.NAME``."""
        cpus = self.hosts[host].cpus
        # taskset sets the cores before it executes argv, so every thread the process starts
        # inherits them.
        pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus is not None else []
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host].namespace, *pin, *argv],
            start_new_session=True,
            **{"cwd": REPO, **kwargs},
        )
        self.hosts[host].processes.append(process)
        return process

    def stop_processes(self, grace: float = 10.0) -> None:
        """Stop every process started in the hosts (SIGTERM to its group, then SIGKILL)."""
        running = [p for h in self.hosts for p in h.processes if p.poll() is None]
        for process in running:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        for host in self.hosts:
            host.processes.clear()

    def close(self) -> None:
        """Stop the processes and delete the namespaces, links and bridge (idempotent)."""
        self.stop_processes()
        for host in self.hosts:
            _run("ip", "netns", "del", host.namespace, check=False)
        for link in reversed(self._links):
            _run("ip", "link", "del", link, check=False)
        self._links.clear()
        if self._allowed_before is not None:
            _ALLOWED_CC.write_text(self._allowed_before)
            self._allowed_before = None
        self._up = False
