"""The ``KVSTORE_*`` environment variables: their declarations and the parsers of their values.

:data:`ENV_VARS` lists each variable with its type, default, the role that reads it and its
meaning; the tables of README.md and docs/operations.md are checked against it by a test.
:data:`TORCHRUN_ENV_VARS` lists the variables of PyTorch's launcher that stand in for missing job
variables. A malformed value raises :class:`~kvstore.errors.ConfigError` naming the variable and
the bad value.

This module depends on nothing else in the package but :mod:`kvstore.errors`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.errors import ConfigError

LAUNCH_HINT = (
    "start workers with `kvstore-launch -n N -s S -- python your_script.py`, which sets it"
)

_ADDRESS_RE = re.compile(r"^(tcp://[^\s,:]+:\d{1,5}|inproc://[^\s,]+|ipc://[^\s,]+)$")
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)


@dataclass(frozen=True)
class EnvVar:
    """One documented environment variable."""

    name: str
    type: str
    default: str
    role: str
    meaning: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "KVSTORE_SERVERS",
        "comma-separated addresses",
        "(required for dist_*)",
        "worker",
        "Server addresses in server-rank order, e.g. `tcp://10.0.0.1:9100,tcp://10.0.0.2:9100`.",
    ),
    EnvVar("KVSTORE_RANK", "int", "(required for dist_*)", "worker", "This worker's rank, 0..N-1."),
    EnvVar(
        "KVSTORE_NUM_WORKERS",
        "int",
        "(required for dist_*)",
        "worker",
        "N, the number of workers in the job.",
    ),
    EnvVar(
        "KVSTORE_BIGARRAY_BOUND",
        "int",
        "1000000",
        "worker",
        "Keys with at least this many elements are split over all servers "
        "(on 16-element boundaries); smaller keys live whole on one server. "
        "Must be equal on all workers.",
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
    ),
    EnvVar(
        "KVSTORE_TIMEOUT",
        "float seconds",
        "0 (wait forever)",
        "worker",
        "Longest a blocking call (init, push, pull of any number of keys, barrier, "
        "set_optimizer, close) waits in all before raising `KVStoreTimeoutError`.",
    ),
    EnvVar(
        "KVSTORE_CONNECT_TIMEOUT",
        "float seconds",
        "60",
        "worker",
        "Longest `kvstore.create` waits for every server to answer its handshake.",
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
    ),
    EnvVar(
        "KVSTORE_SERVER_THREADS",
        "int",
        "min(4, CPU count)",
        "server",
        "Threads that decode, aggregate and run the optimizer (the compiled kernels release "
        "the GIL, so different keys are processed in parallel).",
    ),
    EnvVar(
        "KVSTORE_CPU_KERNELS",
        "`numba` or `numpy`",
        "numba",
        "worker, server",
        "Implementation of the CPU codec kernels: the compiled numba kernels, or the "
        "vectorised numpy reference (same bytes, slower).",
    ),
    EnvVar(
        "KVSTORE_MALLOC_TUNING",
        "0 or 1",
        "1",
        "worker, server",
        "Let glibc keep large freed buffers (mallopt) so ZeroMQ's per-message receive buffers "
        "are reused instead of page-faulted back every message; 0 turns it off.",
    ),
    EnvVar(
        "KVSTORE_PUSH_LEAD",
        "int >= 0",
        "3 with 3+ workers, else 0",
        "worker",
        "Pushes per server connection sent and not yet answered, at most (0: no limit). Keeps "
        "the workers of a synchronous round in step where many share a server's link.",
    ),
    EnvVar(
        "KVSTORE_PUSH_TOS",
        "int 0-255",
        "16 (0x10, low delay) with 3+ workers, else 0",
        "worker",
        "IP TOS byte on the worker's connections: pushes are on every round's critical path, "
        "so where a host's queue honours TOS (Linux pfifo_fast) they pass the server replies "
        "that share its uplink; 0 leaves the packets unmarked.",
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
    ),
    EnvVar(
        "KVSTORE_PULL_RELAY",
        "0 or 1",
        "1",
        "worker",
        "Without a server optimizer, let servers answer a pull of a 2-bit key with the round's "
        "pushes (N/16 of the bytes) that the worker sums itself, bit-identical to the dense "
        "value; 0 always pulls dense values.",
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
    ),
    EnvVar(
        "KVSTORE_ALLOW_NONFINITE",
        "0 or 1",
        "0",
        "worker",
        "0: a push or pushpull of float values holding NaN or an infinity raises "
        "`NonFiniteError` naming the key, and sends nothing of it (residuals unchanged); 1: "
        "they are pushed as they are (and skip the check, one read of each value).",
    ),
    EnvVar(
        "KVSTORE_METRICS_PORT",
        "int 0-65535",
        "(unset: no endpoint)",
        "worker, server",
        'Serve Prometheus metrics over HTTP (needs `pip install "pskv[metrics]"`): with '
        "P set, server I listens on port P + I and worker R on P + S + R (S servers), so one "
        "value serves a whole job; 0: each process picks a free port and logs its URL at INFO.",
    ),
    EnvVar(
        "KVSTORE_METRICS_ADDR",
        "host name or IP address",
        "127.0.0.1",
        "worker, server",
        "Interface the metrics endpoint binds; `0.0.0.0` lets a Prometheus on another host "
        "scrape it (the endpoint has no authentication).",
    ),
    EnvVar(
        "KVSTORE_METRICS_EVERY",
        "int >= 1",
        "10",
        "worker",
        "With metrics on, a key's residual norm relative to its gradient and the density it "
        "sent are measured on every K-th push of the key (the first included).",
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
    ),
    EnvVar(
        "KVSTORE_AUTH_SERVER_SECRET_KEY",
        "Z85 CURVE key (40 characters)",
        "(unset)",
        "server",
        "The job's server secret key; `kvstore-launch` sets it for its servers.",
    ),
    EnvVar(
        "KVSTORE_AUTH_CLIENT_PUBLIC_KEY",
        "Z85 CURVE key (40 characters)",
        "(unset)",
        "server",
        "The job's client public key: the only worker key a server admits.",
    ),
    EnvVar(
        "KVSTORE_AUTH_CLIENT_SECRET_KEY",
        "Z85 CURVE key (40 characters)",
        "(unset)",
        "worker",
        "The job's client secret key; `kvstore-launch` sets it for its workers.",
    ),
    EnvVar(
        "KVSTORE_AUTH_SERVER_PUBLIC_KEY",
        "Z85 CURVE key (40 characters)",
        "(unset)",
        "worker",
        "The job's server public key: a worker talks only to servers that hold its secret key.",
    ),
    EnvVar(
        "KVSTORE_AUTH",
        "0 or 1",
        "1",
        "launcher",
        "0: `kvstore-launch` starts the job without CURVE keys, as `--no-auth` does (no "
        "authentication, no encryption: for trusted networks only).",
    ),
)

ENV_VAR_NAMES = frozenset(v.name for v in ENV_VARS)

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
)
"""Variables that ``torchrun`` (and other PyTorch launchers) set and that a worker reads in place
of a missing ``KVSTORE_*`` job variable (:data:`TORCHRUN_FALLBACKS`); the ``KVSTORE_*`` one wins
where both are set. They are not ours, so they are listed apart from :data:`ENV_VARS`;
docs/operations.md and docs/torch.md document them."""

TORCHRUN_FALLBACKS: dict[str, str] = {"KVSTORE_RANK": "RANK", "KVSTORE_NUM_WORKERS": "WORLD_SIZE"}
"""For each job variable a launcher of PyTorch can stand in for, the variable it sets."""


def env_text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def require_env_text(env: Mapping[str, str], name: str, what: str) -> str:
    value = env_text(env, name)
    if value is None:
        raise ConfigError(f"{name} is not set: it must hold {what}; {LAUNCH_HINT}")
    return value


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
