"""The ``KVSTORE_*`` environment variables: one declaration each, and the parsers of their values.

:data:`ENV_VARS` declares each variable once: its row in the tables of README.md and
docs/operations.md (checked against it by a test), and everything needed to read it: the parser
that turns its text into a value and validates it, the config field it fills and which config
objects read that field, whether a worker cannot start without it, and the variable of PyTorch's
launcher that stands in for it. The config objects of :mod:`kvstore.config` read their fields by
walking the table (:func:`config_fields`); a setting read on its own goes through
:func:`env_value`. :data:`TORCHRUN_ENV_VARS` lists torchrun's variables.

A missing or malformed value raises :class:`~kvstore.errors.ConfigError` naming the variable and
the bad value; a missing job variable also points at ``kvstore-launch``, which sets it.

This module depends on nothing else in the package but :mod:`kvstore.errors`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

from kvstore.errors import ConfigError

LAUNCH_HINT = (
    "start workers with `kvstore-launch -n N -s S -- python your_script.py`, which sets it"
)

_ADDRESS_RE = re.compile(r"^(tcp://[^\s,:]+:\d{1,5}|inproc://[^\s,]+|ipc://[^\s,]+)$")
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)

MIN_HEARTBEAT_TIMEOUT = 0.1
"""Shorter timeouts are refused: pings every timeout / 6 would cost more than they tell."""
MIN_MESSAGE_BYTES = 64 * 1024
"""The smallest message size limit: a header alone may take 64 KiB (``wire.MAX_HEADER_BYTES``)."""
DEFAULT_MAX_CONNECTIONS = 1024
"""Connections a server accepts at once: each worker holds two, so enough for 512 workers."""
DEFAULT_RECEIVE_BUFFER_BYTES = 256 << 20
"""Bytes of received messages a server lets wait for it, over all connections."""
MIN_RECEIVE_BUFFER_BYTES = 1 << 20
"""The smallest ``KVSTORE_RECEIVE_BUFFER_BYTES``."""
Z85_KEY_LENGTH = 40
"""Characters of a CURVE key in Z85 text (32 bytes)."""
_Z85_ALPHABET = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)


def parse_int(
    name: str, raw: str, *, minimum: int | None = None, maximum: int | None = None, base: int = 10
) -> int:
    """Parse an integer setting, raising ConfigError that names the setting and the value.

    ``base=0`` also takes prefixed literals (``0x10``), as Python source does."""
    try:
        value = int(raw, base)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name}={raw!r} must be <= {maximum}")
    return value


def parse_float(name: str, raw: str, *, minimum: float | None = None) -> float:
    """Parse a float setting, raising ConfigError that names the setting and the value."""
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value != value or (minimum is not None and value < minimum):
        raise ConfigError(f"{name}={raw!r} must be a number >= {minimum}")
    return value


def parse_switch(name: str, raw: str) -> bool:
    """An on/off variable: 1/true/yes/on or 0/false/no/off (any case)."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} must be 0 or 1")


def parse_server_list(name: str, raw: str) -> tuple[str, ...]:
    """Parse a comma-separated list of ZeroMQ addresses (``tcp://host:port``)."""
    addresses = tuple(part.strip() for part in raw.split(","))
    if not addresses or any(not a for a in addresses):
        raise ConfigError(f"{name}={raw!r} has an empty entry; expected tcp://HOST:PORT,...")
    for address in addresses:
        if not _ADDRESS_RE.match(address):
            raise ConfigError(
                f"{name}={raw!r}: {address!r} is not an address of the form tcp://HOST:PORT"
            )
        if address.startswith("tcp://"):
            port = int(address.rsplit(":", 1)[1])
            if not 0 < port < 65536:
                raise ConfigError(f"{name}={raw!r}: port {port} of {address!r} is out of range")
    if len(set(addresses)) != len(addresses):
        raise ConfigError(f"{name}={raw!r} lists the same server twice")
    return addresses


def parse_host(name: str, raw: str) -> str:
    """A host name or an IPv4/IPv6 address to bind (no scheme, no port)."""
    value = raw.strip()
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if not _HOSTNAME_RE.match(value):
        raise ConfigError(
            f"{name}={raw!r} is not a host name or an IP address (e.g. 127.0.0.1 or 0.0.0.0)"
        )
    return value


def parse_text(name: str, raw: str) -> str:
    """A value taken as it is (a directory, say); the reader has already stripped it."""
    return raw


def parse_timeout(name: str, raw: str) -> float | None:
    """Seconds >= 0 of a whole blocking call; 0 means no timeout (None)."""
    value = parse_float(name, raw, minimum=0.0)
    return value if value > 0 else None


def check_heartbeat_timeout(value: float, name: str = "heartbeat_timeout") -> float:
    """``value`` if it is a valid heartbeat timeout in seconds (0: heartbeats off)."""
    if value != value or not (value == 0 or value >= MIN_HEARTBEAT_TIMEOUT):
        raise ConfigError(
            f"{name}={value!r} must be 0 (off) or at least {MIN_HEARTBEAT_TIMEOUT} seconds"
        )
    return value


def parse_heartbeat_timeout(name: str, raw: str) -> float:
    """Seconds of silence after which a peer is lost: 0 (heartbeats off) or at least
    :data:`MIN_HEARTBEAT_TIMEOUT`."""
    return check_heartbeat_timeout(parse_float(name, raw, minimum=0.0), name)


def check_z85_key(what: str, key: str) -> None:
    """Raise ConfigError unless ``key`` is a CURVE key in Z85 text. The message never shows
    the key (it may be a secret), only what is wrong with it."""
    if len(key) != Z85_KEY_LENGTH:
        raise ConfigError(
            f"{what} is not a CURVE key: expected {Z85_KEY_LENGTH} Z85 characters (as "
            f"`kvstore-keygen` writes them), got {len(key)} characters"
        )
    bad = sorted(set(key) - _Z85_ALPHABET)
    if bad:
        raise ConfigError(
            f"{what} is not a CURVE key: {len(bad)} character(s) outside the Z85 alphabet"
        )


def parse_z85_key(name: str, raw: str) -> str:
    """A CURVE key in Z85 text; an error names the variable, never the key."""
    check_z85_key(name, raw)
    return raw


@dataclass(frozen=True)
class Integer:
    """Parser of an integer within bounds (:func:`parse_int`); ``base=0`` also takes prefixed
    literals (``0x10``)."""

    minimum: int | None = None
    maximum: int | None = None
    base: int = 10

    def __call__(self, name: str, raw: str) -> int:
        return parse_int(name, raw, minimum=self.minimum, maximum=self.maximum, base=self.base)


@dataclass(frozen=True)
class Number:
    """Parser of a float of at least ``minimum`` (:func:`parse_float`)."""

    minimum: float | None = None

    def __call__(self, name: str, raw: str) -> float:
        return parse_float(name, raw, minimum=self.minimum)


class OneOf:
    """Parser of one of a few words, in any case; the value is the word in lower case."""

    def __init__(self, *words: str) -> None:
        self.words = words

    def __call__(self, name: str, raw: str) -> str:
        value = raw.lower()
        if value not in self.words:
            options = " or ".join(repr(word) for word in self.words)
            raise ConfigError(f"{name}={raw!r} must be {options}")
        return value

    def __repr__(self) -> str:
        return f"OneOf{self.words!r}"


Parser = Callable[[str, str], Any]
"""Turns a variable's text (stripped, never empty) into its value, or raises
:class:`~kvstore.errors.ConfigError` naming the variable (the first argument) and the text."""

# The config classes of kvstore.config that fill fields from the table, by name: this module
# cannot import them (they are built from it), and a test checks every declared field exists.
CLUSTER_CONFIG = "ClusterConfig"
WORKER_OPTIONS = "WorkerOptions"
SERVER_CONFIG = "ServerConfig"
METRICS_CONFIG = "MetricsConfig"


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its documentation, and how it is read.

    Attributes:
        name: the variable.
        type: what it holds, in words (the documentation tables' "type" column).
        default: its default, in words.
        role: the processes that read it (``worker``, ``server``, ``launcher``).
        meaning: what it does; docs/operations.md carries this text verbatim.
        parse: turns its text into its value, validating it; None where the module that uses it
            reads it itself (``KVSTORE_LOG_LEVEL``: :mod:`kvstore._logging` warns about a bad
            level instead of refusing to start) or where it is not ours (torchrun's).
        field: the config field its value fills; None where a function of its own reads it
            (``cpu_kernels_from_env``, the CURVE keys, ...).
        read_by: the config classes (by name) whose ``field`` it fills.
        required: what it must hold, for a variable a worker cannot start without; empty for an
            optional one, whose config field keeps its default while it is unset.
        fallback: torchrun's variable that stands in for it while it is unset.
    """

    name: str
    type: str
    default: str
    role: str
    meaning: str
    _: KW_ONLY
    parse: Parser | None = None
    field: str | None = None
    read_by: tuple[str, ...] = ()
    required: str = ""
    fallback: str | None = None


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "KVSTORE_SERVERS",
        "comma-separated addresses",
        "(required for dist_*)",
        "worker",
        "Server addresses in server-rank order, e.g. `tcp://10.0.0.1:9100,tcp://10.0.0.2:9100`. "
        "A server reads it too where it is set: one that replaces a lost server of a job with "
        "`KVSTORE_REPLICAS` > 1 needs it to be caught up.",
        parse=parse_server_list,
        field="servers",
        read_by=(CLUSTER_CONFIG,),
        required="the server addresses",
    ),
    EnvVar(
        "KVSTORE_RANK",
        "int",
        "(required for dist_*)",
        "worker",
        "This worker's rank, 0..N-1.",
        parse=Integer(minimum=0),
        field="rank",
        read_by=(CLUSTER_CONFIG,),
        required="this worker's rank",
        fallback="RANK",
    ),
    EnvVar(
        "KVSTORE_NUM_WORKERS",
        "int",
        "(required for dist_*)",
        "worker",
        "N, the number of workers in the job.",
        parse=Integer(minimum=1),
        field="num_workers",
        read_by=(CLUSTER_CONFIG,),
        required="the number of workers",
        fallback="WORLD_SIZE",
    ),
    EnvVar(
        "KVSTORE_LOCAL_RANK",
        "int",
        "0",
        "worker",
        "This worker's rank among the workers of its host, 0..k-1 (`kvstore-launch "
        "--workers-per-host k` sets it). The host's workers must be global ranks "
        "host x k .. host x k + k-1.",
        parse=Integer(minimum=0),
        field="local_rank",
        read_by=(CLUSTER_CONFIG,),
        fallback="LOCAL_RANK",
    ),
    EnvVar(
        "KVSTORE_LOCAL_SIZE",
        "int",
        "1",
        "worker",
        "k, the number of workers on this worker's host, the same on every host. With k > 1 "
        "the host's workers sum each push in shared memory, each pushes a 1/k share of the "
        "host's sum, and each pull is fetched once per host (`KVSTORE_HIERARCHY`).",
        parse=Integer(minimum=1),
        field="local_size",
        read_by=(CLUSTER_CONFIG,),
        fallback="LOCAL_WORLD_SIZE",
    ),
    EnvVar(
        "KVSTORE_BIGARRAY_BOUND",
        "int",
        "1000000",
        "worker",
        "Keys with at least this many elements are split over all servers "
        "(on 16-element boundaries); smaller keys live whole on one server. "
        "Must be equal on all workers.",
        parse=Integer(minimum=1),
        field="bigarray_bound",
        read_by=(WORKER_OPTIONS,),
    ),
    EnvVar(
        "KVSTORE_PARTITION_BYTES",
        "int",
        "4194304",
        "worker, server",
        "Largest chunk, in bytes of the uncompressed value. Each server's slice of a key is cut "
        "into 16 chunks of at most this size and at least a quarter of it (fewer where the "
        "slice is short), a slice of a key whose pushes carry at least 4 times this many bytes "
        "into 32 of at least an eighth, smaller at both ends where a slice is long enough, so that "
        "encoding, sending, server-side decoding and replies overlap; the "
        "send window is twice this. Smaller partitions bring a synchronous step closer to the "
        "wire floor where many workers share a server's link, at a CPU cost per chunk. Must be "
        "equal on all workers; servers derive their message size limit from it.",
        parse=Integer(minimum=64),
        field="partition_bytes",
        read_by=(WORKER_OPTIONS, SERVER_CONFIG),
    ),
    EnvVar(
        "KVSTORE_TIMEOUT",
        "float seconds",
        "0 (wait forever)",
        "worker",
        "Longest a blocking call (init, push, pull of any number of keys, barrier, "
        "set_optimizer, close) waits in all before raising `KVStoreTimeoutError`.",
        parse=parse_timeout,
        field="timeout",
        read_by=(WORKER_OPTIONS,),
    ),
    EnvVar(
        "KVSTORE_CONNECT_TIMEOUT",
        "float seconds",
        "60",
        "worker",
        "Longest `kvstore.create` waits for every server to answer its handshake.",
        parse=Number(minimum=0.001),
        field="connect_timeout",
        read_by=(WORKER_OPTIONS,),
    ),
    EnvVar(
        "KVSTORE_HEARTBEAT_TIMEOUT",
        "float seconds",
        "30",
        "worker, server",
        "A peer silent this long is lost: a server releases a worker's rank (a replacement may "
        "take it) and fails the requests that wait on it with `WorkerLostError`; a worker fails "
        "its requests to a server with `ServerLostError`. Workers ping every server every "
        "min(5 s, timeout / 6). 0 turns heartbeats off. Set it equal on servers and workers "
        "(`kvstore-launch` passes it on).",
        parse=parse_heartbeat_timeout,
        field="heartbeat_timeout",
        read_by=(WORKER_OPTIONS, SERVER_CONFIG),
    ),
    EnvVar(
        "KVSTORE_SERVER_THREADS",
        "int",
        "min(4, CPU count)",
        "server",
        "Threads that decode, aggregate and run the optimizer (the compiled kernels release "
        "the GIL, so different keys are processed in parallel).",
        parse=Integer(minimum=1),
        field="threads",
        read_by=(SERVER_CONFIG,),
    ),
    EnvVar(
        "KVSTORE_CPU_KERNELS",
        "`numba` or `numpy`",
        "numba",
        "worker, server",
        "Implementation of the CPU codec kernels: the compiled numba kernels, or the "
        "vectorised numpy reference (same bytes, slower).",
        parse=OneOf("numba", "numpy"),
    ),
    EnvVar(
        "KVSTORE_MALLOC_TUNING",
        "0 or 1",
        "1",
        "worker, server",
        "Let glibc keep large freed buffers (mallopt) so ZeroMQ's per-message receive buffers "
        "are reused instead of page-faulted back every message; 0 turns it off.",
        parse=parse_switch,
    ),
    EnvVar(
        "KVSTORE_NATIVE_SENDS",
        "0 or 1",
        "1",
        "worker, server",
        "Send large buffers without copies through libzmq with a compiled free function, which "
        "costs no Python work when a send completes; 0 uses pyzmq's zero-copy sends, whose "
        "completions go through its garbage-collector thread.",
        parse=parse_switch,
        field="native_sends",
        read_by=(WORKER_OPTIONS, SERVER_CONFIG),
    ),
    EnvVar(
        "KVSTORE_VALUE_PREFETCH",
        "0 or 1",
        "1",
        "worker",
        "In dist_sync, once a key's push was followed by a pull, send its later pushes as "
        "PUSHPULLs whose values the next pull takes (one request per chunk instead of two, "
        "values back as each round completes); 0 sends pushes and pulls apart.",
        parse=parse_switch,
        field="value_prefetch",
        read_by=(WORKER_OPTIONS,),
    ),
    EnvVar(
        "KVSTORE_INLINE_WORK",
        "0 or 1",
        "1",
        "server",
        "Run a push's work on the server's event loop until it must wait, and decode and sum "
        "chunks of up to 2^20 elements there, instead of a task per push and a thread hand-off "
        "per chunk; 0 gives every push a task and every chunk to the thread pool.",
        parse=parse_switch,
        field="inline_work",
        read_by=(SERVER_CONFIG,),
    ),
    EnvVar(
        "KVSTORE_ACKS_ON_PULLS",
        "0 or 1",
        "1",
        "server",
        "Acknowledge a push in the value reply of the same worker's pull that waited for it, "
        "instead of in a reply of its own; 0 acknowledges every push on its own.",
        parse=parse_switch,
        field="acks_on_pulls",
        read_by=(SERVER_CONFIG,),
    ),
    EnvVar(
        "KVSTORE_PUSH_LEAD",
        "int >= 0",
        "3 with 3+ workers, else 0",
        "worker",
        "Pushes per server connection sent and not yet answered, at most (0: no limit). Keeps "
        "the workers of a synchronous round in step where many share a server's link.",
        parse=Integer(minimum=0),
        field="push_lead",
        read_by=(WORKER_OPTIONS,),
    ),
    EnvVar(
        "KVSTORE_PUSH_TOS",
        "int 0-255",
        "16 (0x10, low delay) with 3+ workers, else 0",
        "worker",
        "IP TOS byte on the worker's connections: pushes are on every round's critical path, "
        "so where a host's queue honours TOS (Linux pfifo_fast) they pass the server replies "
        "that share its uplink; 0 leaves the packets unmarked.",
        parse=Integer(minimum=0, maximum=255, base=0),
        field="push_tos",
        read_by=(WORKER_OPTIONS,),
    ),
    EnvVar(
        "KVSTORE_SEND_QUEUE_MS",
        "float >= 0",
        "0",
        "worker",
        "Opt-in: size the pushes a worker hands to its connections to this many milliseconds "
        "of its send rate (within 1 MiB and twice KVSTORE_PARTITION_BYTES), with at most 128 "
        "KiB unsent in the kernel per connection to another host, so that a worker's pushes "
        "to several servers keep their submission order where its own uplink is the busiest "
        "link; 0 keeps a fixed window of twice KVSTORE_PARTITION_BYTES.",
        parse=Number(minimum=0.0),
        field="send_queue_ms",
        read_by=(WORKER_OPTIONS,),
    ),
    EnvVar(
        "KVSTORE_REPLICAS",
        "int >= 1",
        "1",
        "worker, server",
        "Keep every server's shard on R servers: its primary and the next R - 1 in rank order. "
        "Each round is forwarded to the backups before it is answered; a worker whose server is "
        "lost goes on with the next live replica, with nothing lost or applied twice, so the job "
        "survives R - 1 lost servers. Needs at least R servers; equal on servers and workers "
        "(`kvstore-launch --replicas` passes it on).",
        parse=Integer(minimum=1),
        field="replicas",
        read_by=(WORKER_OPTIONS, SERVER_CONFIG),
    ),
    EnvVar(
        "KVSTORE_HIERARCHY",
        "0 or 1",
        "1",
        "worker",
        "With several workers per host (`KVSTORE_LOCAL_SIZE` > 1), aggregate on the host first: "
        "one host's worth of bytes crosses its link whatever k is. 0: every worker pushes and "
        "pulls on its own, as if alone on its host. Must be equal on all workers.",
        parse=parse_switch,
        field="hierarchy",
        read_by=(WORKER_OPTIONS,),
    ),
    EnvVar(
        "KVSTORE_PULL_RELAY",
        "0 or 1",
        "1",
        "worker",
        "Without a server optimizer, let servers answer a pull of a 2-bit key with the round's "
        "pushes (N/16 of the bytes) that the worker sums itself, bit-identical to the dense "
        "value; 0 always pulls dense values.",
        parse=parse_switch,
        field="pull_relay",
        read_by=(WORKER_OPTIONS,),
    ),
    EnvVar(
        "KVSTORE_MAX_MESSAGE_BYTES",
        "int >= 65536",
        "the largest chunk of KVSTORE_PARTITION_BYTES (4 MiB + 120)",
        "server",
        "Largest frame a server accepts (ZeroMQ drops the connection of a peer that sends a "
        "larger one, before reading it); by default the largest chunk a worker with the "
        "server's KVSTORE_PARTITION_BYTES can send. A worker whose chunks could be larger is "
        "refused at connect with `ConfigError`, and so is an init of a larger chunk.",
        parse=Integer(minimum=MIN_MESSAGE_BYTES),
        field="max_message_bytes",
        read_by=(SERVER_CONFIG,),
    ),
    EnvVar(
        "KVSTORE_MAX_CONNECTIONS",
        "int >= 1",
        str(DEFAULT_MAX_CONNECTIONS),
        "server",
        "Connections a server accepts at once (each worker holds two); more are closed as they "
        "arrive, with a warning. Part of the bound on a server's memory (docs/operations.md, "
        "Limits).",
        parse=Integer(minimum=1),
        field="max_connections",
        read_by=(SERVER_CONFIG,),
    ),
    EnvVar(
        "KVSTORE_RECEIVE_BUFFER_BYTES",
        f"int >= {MIN_RECEIVE_BUFFER_BYTES}",
        "268435456 (256 MiB)",
        "server",
        "Bytes of received messages that a server lets wait for it, over all its connections; "
        "a connection whose next frame does not fit is not read until the server has taken "
        "enough (TCP holds its sender back, nothing is lost). Part of the bound on a server's "
        "memory (docs/operations.md, Limits).",
        parse=Integer(minimum=MIN_RECEIVE_BUFFER_BYTES),
        field="receive_buffer_bytes",
        read_by=(SERVER_CONFIG,),
    ),
    EnvVar(
        "KVSTORE_ADMISSION_GATE",
        "0 or 1",
        "1",
        "server",
        "1: a server on TCP accepts connections through its admission gate, which bounds what "
        "peers make it hold (docs/operations.md, Limits); 0: its ZeroMQ socket listens itself, "
        "which saves the relay's copy of every byte but leaves the frames of one message and the "
        "connections unbounded (for trusted networks only).",
        parse=parse_switch,
        field="admission_gate",
        read_by=(SERVER_CONFIG,),
    ),
    EnvVar(
        "KVSTORE_ALLOW_NONFINITE",
        "0 or 1",
        "0",
        "worker",
        "0: a push or pushpull of float values holding NaN or an infinity raises "
        "`NonFiniteError` naming the key, and sends nothing of it (residuals unchanged); 1: "
        "they are pushed as they are (and skip the check, one read of each value).",
        parse=parse_switch,
        field="allow_nonfinite",
        read_by=(WORKER_OPTIONS,),
    ),
    EnvVar(
        "KVSTORE_METRICS_PORT",
        "int 0-65535",
        "(unset: no endpoint)",
        "worker, server",
        'Serve Prometheus metrics over HTTP (needs `pip install "pskv[metrics]"`): with '
        "P set, server I listens on port P + I and worker R on P + S + R (S servers), so one "
        "value serves a whole job; 0: each process picks a free port and logs its URL at INFO.",
        parse=Integer(minimum=0, maximum=65535),
        field="port",
        read_by=(METRICS_CONFIG,),
    ),
    EnvVar(
        "KVSTORE_METRICS_ADDR",
        "host name or IP address",
        "127.0.0.1",
        "worker, server",
        "Interface the metrics endpoint binds; `0.0.0.0` lets a Prometheus on another host "
        "scrape it (the endpoint has no authentication).",
        parse=parse_host,
        field="addr",
        read_by=(METRICS_CONFIG,),
    ),
    EnvVar(
        "KVSTORE_METRICS_EVERY",
        "int >= 1",
        "10",
        "worker",
        "With metrics on, a key's residual norm relative to its gradient and the density it "
        "sent are measured on every K-th push of the key (the first included).",
        parse=Integer(minimum=1),
        field="every",
        read_by=(METRICS_CONFIG,),
    ),
    EnvVar(
        "KVSTORE_LOG_LEVEL",
        "DEBUG, INFO, WARNING, ERROR",
        "WARNING (servers and the launcher: INFO)",
        "worker, server, launcher",
        "Log level of the `kvstore` loggers; every process logs in one format (see Logs).",
    ),
    EnvVar(
        "KVSTORE_AUTH_DIR",
        "directory",
        "(unset)",
        "worker, server",
        "Directory of the job's CURVE key files, one key per file, as `kvstore-keygen DIR` "
        "writes them (`DIR/server`, `DIR/worker`) or a Kubernetes Secret mounts them: a server "
        "reads `server-secret-key` and `client-public-key`, a worker `client-secret-key` and "
        "`server-public-key`. A `KVSTORE_AUTH_*_KEY` variable wins over its file. A server "
        "without keys accepts any worker (and logs a warning saying so).",
        parse=parse_text,
    ),
    EnvVar(
        "KVSTORE_AUTH_SERVER_SECRET_KEY",
        "Z85 CURVE key (40 characters)",
        "(unset)",
        "server",
        "The job's server secret key; `kvstore-launch` sets it for its servers.",
        parse=parse_z85_key,
    ),
    EnvVar(
        "KVSTORE_AUTH_CLIENT_PUBLIC_KEY",
        "Z85 CURVE key (40 characters)",
        "(unset)",
        "server",
        "The job's client public key: the only worker key a server admits.",
        parse=parse_z85_key,
    ),
    EnvVar(
        "KVSTORE_AUTH_CLIENT_SECRET_KEY",
        "Z85 CURVE key (40 characters)",
        "(unset)",
        "worker",
        "The job's client secret key; `kvstore-launch` sets it for its workers.",
        parse=parse_z85_key,
    ),
    EnvVar(
        "KVSTORE_AUTH_SERVER_PUBLIC_KEY",
        "Z85 CURVE key (40 characters)",
        "(unset)",
        "worker",
        "The job's server public key: a worker talks only to servers that hold its secret key.",
        parse=parse_z85_key,
    ),
    EnvVar(
        "KVSTORE_AUTH",
        "0 or 1",
        "1",
        "launcher",
        "0: `kvstore-launch` starts the job without CURVE keys, as `--no-auth` does (no "
        "authentication, no encryption: for trusted networks only).",
        parse=parse_switch,
    ),
)

ENV_VAR_NAMES = frozenset(v.name for v in ENV_VARS)
_BY_NAME: dict[str, EnvVar] = {v.name: v for v in ENV_VARS}

TORCHRUN_ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "RANK",
        "int",
        "(set by torchrun)",
        "worker",
        "torchrun's global rank: this worker's rank where `KVSTORE_RANK` is not set.",
    ),
    EnvVar(
        "WORLD_SIZE",
        "int",
        "(set by torchrun)",
        "worker",
        "torchrun's world size: N where `KVSTORE_NUM_WORKERS` is not set.",
    ),
    EnvVar(
        "LOCAL_RANK",
        "int",
        "(set by torchrun)",
        "worker",
        "torchrun's rank within the node: this worker's local rank where `KVSTORE_LOCAL_RANK` "
        "is not set.",
    ),
    EnvVar(
        "LOCAL_WORLD_SIZE",
        "int",
        "(set by torchrun)",
        "worker",
        "torchrun's `--nproc-per-node`: k where `KVSTORE_LOCAL_SIZE` is not set.",
    ),
)
"""Variables that ``torchrun`` (and other PyTorch launchers) set and that a worker reads in place
of a missing ``KVSTORE_*`` job variable (:data:`TORCHRUN_FALLBACKS`); the ``KVSTORE_*`` one wins
where both are set. They are not ours, so they are listed apart from :data:`ENV_VARS`;
docs/operations.md and docs/torch.md document them."""

TORCHRUN_FALLBACKS: dict[str, str] = {v.name: v.fallback for v in ENV_VARS if v.fallback}
"""For each job variable a launcher of PyTorch can stand in for, the variable it sets."""


def _text(env: Mapping[str, str], name: str) -> str | None:
    """The variable's text, stripped; None where it is unset or blank."""
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _lookup(env: Mapping[str, str], var: EnvVar) -> tuple[str, str] | None:
    """The name that holds ``var``'s value in ``env`` (its fallback where it is unset) and the
    text; None where neither is set, unless the variable is required."""
    raw = _text(env, var.name)
    if raw is not None:
        return var.name, raw
    if var.fallback is not None:
        raw = _text(env, var.fallback)
        if raw is not None:
            return var.fallback, raw
    if var.required:
        nor = f" (nor torchrun's {var.fallback})" if var.fallback is not None else ""
        raise ConfigError(f"{var.name} is not set{nor}: it must hold {var.required}; {LAUNCH_HINT}")
    return None


def _parse(var: EnvVar, name: str, raw: str) -> Any:
    if var.parse is None:
        raise LookupError(f"{var.name} has no parser: it is read where it is used")
    return var.parse(name, raw)


def env_value(env: Mapping[str, str], name: str, default: Any) -> Any:
    """The value of declared variable ``name`` in ``env``, parsed and validated by its
    declaration; ``default`` where it is unset or blank."""
    var = _BY_NAME[name]
    found = _lookup(env, var)
    return default if found is None else _parse(var, *found)


def source_name(env: Mapping[str, str], name: str) -> str:
    """Which variable gave ``name``'s value: ``name`` itself, or torchrun's stand-in for it."""
    var = _BY_NAME[name]
    found = _lookup(env, var)
    return name if found is None else found[0]


def config_fields(env: Mapping[str, str], config: str) -> dict[str, Any]:
    """The fields of config class ``config`` (its name) that ``env`` sets, by walking
    :data:`ENV_VARS`: field name -> value parsed and validated by the variable's declaration.
    An unset optional variable is left out (the field keeps its default); the first malformed
    one, in the table's order, raises :class:`~kvstore.errors.ConfigError`."""
    fields: dict[str, Any] = {}
    for var in ENV_VARS:
        if config not in var.read_by or var.field is None:
            continue
        found = _lookup(env, var)
        if found is not None:
            fields[var.field] = _parse(var, *found)
    return fields
