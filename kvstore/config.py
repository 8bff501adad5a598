"""Configuration: the per-role config objects, read from the ``KVSTORE_*`` environment variables.

Each variable is declared once, in :data:`kvstore.envvars.ENV_VARS`, with its parser and the
config field it fills: ``from_env()`` walks that table (:func:`kvstore.envvars.config_fields`)
and adds only what is composed of several variables (the metrics endpoint, the CURVE keys).
Nothing reads the environment at import time: configs are built once per process with
``from_env()``, and explicit arguments take precedence over the environment.

A missing or malformed variable raises :class:`~kvstore.errors.ConfigError` naming the variable,
the bad value, and pointing at ``kvstore-launch``, which sets the job variables for you.

This module depends on nothing else in the package but :mod:`kvstore.errors` and
:mod:`kvstore.envvars`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kvstore.envvars import (
    CLUSTER_CONFIG,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_RECEIVE_BUFFER_BYTES,
    METRICS_CONFIG,
    MIN_MESSAGE_BYTES,
    MIN_RECEIVE_BUFFER_BYTES,
    SERVER_CONFIG,
    WORKER_OPTIONS,
    check_heartbeat_timeout,
    check_z85_key,
    config_fields,
    env_value,
    source_name,
)
from kvstore.envvars import parse_server_list as parse_server_list  # config's API as well
from kvstore.errors import ConfigError

DEFAULT_BIGARRAY_BOUND = 1_000_000
DEFAULT_PARTITION_BYTES = 4 * 1024 * 1024
"""Default ``KVSTORE_PARTITION_BYTES``. Each chunk costs CPU on the worker and the server, and
a step trails its transfer by about one chunk's round, so the best size is where the two
balance; on a grid of 4 workers and 4 servers over 1 Gbit/s links that was 4 MiB, with 2 MiB
and 8 MiB a few percent slower and 16 MiB far slower."""
DEFAULT_CONNECT_TIMEOUT = 60.0
DEFAULT_HEARTBEAT_TIMEOUT = 30.0
MAX_HEARTBEAT_INTERVAL = 5.0
DEFAULT_METRICS_ADDR = "127.0.0.1"
"""Default ``KVSTORE_METRICS_ADDR``. The endpoint has no authentication and names the job's keys,
so, like ``kvstore-server --host``, it stays on the host unless asked: a Prometheus on another
host needs ``KVSTORE_METRICS_ADDR=0.0.0.0`` (or the host's address)."""
DEFAULT_METRICS_EVERY = 10
# IPTOS_LOWDELAY: Linux maps it to TC_PRIO_INTERACTIVE, the first band of pfifo_fast, so a
# host whose queue honours TOS sends pushes ahead of the bulk server replies sharing its uplink.
DEFAULT_PUSH_TOS = 0x10


@dataclass(frozen=True)
class ClusterConfig:
    """A worker's place in the job: the servers, its rank and the number of workers.

    Attributes:
        servers: server addresses in server-rank order.
        rank: this worker's rank, ``0 <= rank < num_workers``.
        num_workers: the number of workers N.
    """

    servers: tuple[str, ...]
    rank: int
    num_workers: int
    local_rank: int = 0
    local_size: int = 1

    def __post_init__(self) -> None:
        if not self.servers:
            raise ConfigError("the server list is empty")
        if self.num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.rank < self.num_workers:
            raise ConfigError(
                f"rank {self.rank} is out of range for {self.num_workers} workers "
                f"(KVSTORE_RANK must be in 0..{self.num_workers - 1})"
            )
        if self.local_size < 1 or not 0 <= self.local_rank < self.local_size:
            raise ConfigError(
                f"local rank {self.local_rank} is out of range for {self.local_size} workers per "
                f"host (KVSTORE_LOCAL_RANK must be in 0..KVSTORE_LOCAL_SIZE-1)"
            )
        if self.local_size > 1 and (
            self.num_workers % self.local_size or self.rank % self.local_size != self.local_rank
        ):
            raise ConfigError(
                f"rank {self.rank} of {self.num_workers} workers cannot be local rank "
                f"{self.local_rank} of {self.local_size} per host: every host must run "
                f"KVSTORE_LOCAL_SIZE workers, with consecutive ranks (host h: ranks "
                f"h*{self.local_size}..h*{self.local_size}+{self.local_size - 1})"
            )

    @property
    def host_index(self) -> int:
        """Which host this worker is on, counting hosts in rank order (``rank // local_size``)."""
        return self.rank // self.local_size

    @property
    def num_servers(self) -> int:
        return len(self.servers)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClusterConfig:
        """Read ``KVSTORE_SERVERS``, ``KVSTORE_RANK`` and ``KVSTORE_NUM_WORKERS``; where one of
        the last two is not set, torchrun's ``RANK`` / ``WORLD_SIZE`` stand in for it
        (:data:`kvstore.envvars.TORCHRUN_FALLBACKS`)."""
        env = os.environ if env is None else env
        values = config_fields(env, CLUSTER_CONFIG)
        rank, num_workers = values["rank"], values["num_workers"]
        if rank >= num_workers:
            rank_var = source_name(env, "KVSTORE_RANK")
            size_var = source_name(env, "KVSTORE_NUM_WORKERS")
            raise ConfigError(f"{rank_var}={rank} is out of range for {size_var}={num_workers}")
        return cls(**values)


@dataclass(frozen=True)
class MetricsConfig:
    """Settings of the Prometheus endpoint (see :mod:`kvstore.metrics` for the port rule).

    Attributes:
        port: the base port P; server I listens on ``P + I``, worker R on ``P + S + R``. 0:
            every process picks a free port.
        addr: interface to bind.
        every: a worker measures a key's residual norm and density on every ``every``-th push
            of it.
    """

    port: int = 0
    addr: str = DEFAULT_METRICS_ADDR
    every: int = DEFAULT_METRICS_EVERY

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"metrics port {self.port} is out of range 0..65535")
        if not self.addr:
            raise ConfigError("the metrics address is empty")
        if self.every < 1:
            raise ConfigError(f"metrics every must be >= 1, got {self.every}")


def metrics_config_from_env(env: Mapping[str, str] | None = None) -> MetricsConfig | None:
    """``KVSTORE_METRICS_PORT``, ``_ADDR`` and ``_EVERY``; None (no endpoint) while the port is
    unset. The other two are validated whenever they are set, so a typo never waits for the day
    the port is."""
    env = os.environ if env is None else env
    values = config_fields(env, METRICS_CONFIG)
    return MetricsConfig(**values) if "port" in values else None


AUTH_DIR_VAR = "KVSTORE_AUTH_DIR"
AUTH_KEY_FILES: dict[str, str] = {
    "server-secret-key": "KVSTORE_AUTH_SERVER_SECRET_KEY",
    "server-public-key": "KVSTORE_AUTH_SERVER_PUBLIC_KEY",
    "client-secret-key": "KVSTORE_AUTH_CLIENT_SECRET_KEY",
    "client-public-key": "KVSTORE_AUTH_CLIENT_PUBLIC_KEY",
}
"""Key file name in ``KVSTORE_AUTH_DIR`` -> the variable that may hold the key instead."""
AUTH_VARS: tuple[str, ...] = (AUTH_DIR_VAR, *AUTH_KEY_FILES.values())
"""Every variable that carries credentials (the launcher sets or blanks them all per child)."""
AUTH_ROLE_FILES: dict[str, tuple[str, str, str]] = {
    "server": ("server-secret-key", "server-public-key", "client-public-key"),
    "worker": ("client-secret-key", "client-public-key", "server-public-key"),
}
"""The key files of each role: its own secret key, its own public key (optional: derived from
the secret one) and the other side's public key."""


class KeyOrigin(NamedTuple):
    """Where a process read one of its keys: a ``KVSTORE_AUTH_*_KEY`` variable, or the key's file
    in ``KVSTORE_AUTH_DIR`` (then ``directory`` is that folder)."""

    variable: str
    directory: str | None = None

    def __str__(self) -> str:
        return self.variable if self.directory is None else f"{self.variable}={self.directory}"


@dataclass(frozen=True)
class CurveKeys:
    """One process's CURVE credentials, Z85 text (see :mod:`kvstore.auth`).

    Attributes:
        role: ``"server"`` or ``"worker"``.
        secret_key: this process's secret key: the job's server secret key on a server, its
            client secret key on a worker. Never shown by ``repr``.
        peer_key: the other side's public key: on a server the job's client public key (the
            only client key it admits), on a worker the job's server public key.
        public_key: this process's public key where it was given (checked against the secret
            key when the keys are applied); None: derived from the secret key.
        origins: where each key was read (key file name -> :class:`KeyOrigin`), for messages;
            empty for keys handed over in code.
    """

    role: str
    secret_key: str = field(repr=False)
    peer_key: str
    public_key: str | None = None
    origins: Mapping[str, KeyOrigin] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.role not in AUTH_ROLE_FILES:
            raise ConfigError(f"role must be 'server' or 'worker', got {self.role!r}")
        own_secret, own_public, peer = AUTH_ROLE_FILES[self.role]
        check_z85_key(own_secret, self.secret_key)
        check_z85_key(peer, self.peer_key)
        if self.public_key is not None:
            check_z85_key(own_public, self.public_key)


def curve_keys_from_env(role: str, env: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The CURVE credentials of a ``role`` (``"server"`` or ``"worker"``) process, or None.

    Each key comes from its ``KVSTORE_AUTH_*_KEY`` variable if set, else from its file in
    ``KVSTORE_AUTH_DIR`` (see :data:`AUTH_KEY_FILES`). None when neither gives any key of the
    role: the process runs without authentication. A role's keys are all or nothing: a
    ``KVSTORE_AUTH_DIR`` without the role's files, or one key without the other, raises
    :class:`ConfigError` naming what is missing.
    """
    env = os.environ if env is None else env
    if role not in AUTH_ROLE_FILES:
        raise ConfigError(f"role must be 'server' or 'worker', got {role!r}")
    directory = env_value(env, AUTH_DIR_VAR, None)
    found: dict[str, str] = {}
    origins: dict[str, KeyOrigin] = {}
    for name in AUTH_ROLE_FILES[role]:
        value = env_value(env, AUTH_KEY_FILES[name], None)
        origin = KeyOrigin(AUTH_KEY_FILES[name])
        if value is None and directory is not None:
            value = _read_key_file(directory, name)
            origin = KeyOrigin(AUTH_DIR_VAR, directory)
        if value is not None:
            found[name] = value
            origins[name] = origin
    own_secret, own_public, peer = AUTH_ROLE_FILES[role]
    if own_secret not in found and peer not in found:
        if directory is not None:
            raise ConfigError(
                f"{AUTH_DIR_VAR}={directory} holds no {own_secret} and no {peer}: a {role} "
                f"reads those two files (`kvstore-keygen DIR` writes them to DIR/{role})"
            )
        return None
    for name in (own_secret, peer):
        if name not in found:
            other = own_secret if name == peer else peer
            if directory is not None:
                raise ConfigError(
                    f"{AUTH_DIR_VAR}={directory} holds no {name}: a {role} reads {own_secret} "
                    f"and {peer} (`kvstore-keygen DIR` writes them to DIR/{role}; is this "
                    f"another role's folder?)"
                )
            raise ConfigError(
                f"a {role} has the job's {other} but not its {name}: set "
                f"{AUTH_KEY_FILES[name]}, or {AUTH_DIR_VAR} to a directory holding both files "
                f"(`kvstore-keygen DIR` writes them to DIR/{role})"
            )
    return CurveKeys(role, found[own_secret], found[peer], found.get(own_public), origins)


def _read_key_file(directory: str, name: str) -> str | None:
    """The CURVE key in file ``name`` of ``directory``, checked; None where there is no such
    file."""
    where = f"{AUTH_DIR_VAR}={directory}: {name}"
    try:
        with open(os.path.join(directory, name), encoding="ascii") as f:
            value = f.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {where}: {exc}") from None
    check_z85_key(where, value)
    return value


def launcher_auth_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``KVSTORE_AUTH``: whether ``kvstore-launch`` makes CURVE keys for its job (default 1)."""
    env = os.environ if env is None else env
    return env_value(env, "KVSTORE_AUTH", True)


@dataclass(frozen=True)
class WorkerOptions:
    """Worker tunables (all have defaults; see :data:`ENV_VARS`).

    Attributes:
        bigarray_bound: keys with at least this many elements are split over all servers.
        partition_bytes: largest uncompressed payload of one message.
        timeout: longest wait of a blocking call in seconds; ``None`` waits forever.
        connect_timeout: longest wait for the servers' handshake replies, in seconds.
        pull_relay: offer to take relayed pulls (a round's compressed pushes, summed here).
        hierarchy: with several workers per host (``ClusterConfig.local_size`` > 1), sum each
            push on the host first and fetch each pull once per host
            (:mod:`kvstore.worker.host_group`); False: every worker exchanges on its own.
        allow_nonfinite: push NaN and infinities as they are, unchecked; False: a push of float
            values holding any raises :class:`~kvstore.errors.NonFiniteError` and sends nothing.
        push_lead: unanswered pushes per server connection, at most (0: no limit; None: the
            default for the job's size, see :func:`default_push_lead`).
        push_tos: IP TOS byte of the worker's packets (0: unmarked; None: the default for the
            job's size, see :func:`default_push_tos`).
        send_queue_ms: pushes queued for the connections, in milliseconds of the measured
            send rate (0: a fixed ``2 * partition_bytes``; see
            :class:`kvstore.worker.send_window.SendWindow`).
        heartbeat_timeout: seconds without a message from a server after which it is lost
            (:class:`~kvstore.errors.ServerLostError`); 0: never.
        metrics: the Prometheus endpoint's settings; None: no endpoint.
        curve: the worker's CURVE credentials (``KVSTORE_AUTH_*``); None: it connects without
            authentication or encryption.
        native_sends: send large buffers through the compiled free function
            (:mod:`kvstore.zerocopy`); False: pyzmq's zero-copy sends.
        value_prefetch: in dist_sync, pushes followed by pulls ask for the round's value
            (:mod:`kvstore.worker.prefetch`); False: pushes and pulls are separate requests.
        replicas: R, the servers that hold each shard (``KVSTORE_REPLICAS``): its primary and
            the next R - 1 in rank order; a lost server's requests go to the next live one
            (:mod:`kvstore.server.replication`). 1: no replication.
    """

    bigarray_bound: int = DEFAULT_BIGARRAY_BOUND
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    timeout: float | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    pull_relay: bool = True
    hierarchy: bool = True
    push_lead: int | None = None
    push_tos: int | None = None
    send_queue_ms: float = 0.0
    allow_nonfinite: bool = False
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    metrics: MetricsConfig | None = None
    curve: CurveKeys | None = None
    native_sends: bool = True
    value_prefetch: bool = True
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.bigarray_bound < 1:
            raise ConfigError(f"bigarray_bound must be >= 1, got {self.bigarray_bound}")
        if self.partition_bytes < 64:
            raise ConfigError(f"partition_bytes must be >= 64, got {self.partition_bytes}")
        if self.timeout is not None and not self.timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds or None, got {self.timeout}")
        if not self.connect_timeout > 0:
            raise ConfigError(f"connect_timeout must be > 0 seconds, got {self.connect_timeout}")
        if self.push_lead is not None and self.push_lead < 0:
            raise ConfigError(f"push_lead must be >= 0, got {self.push_lead}")
        if self.push_tos is not None and not 0 <= self.push_tos <= 255:
            raise ConfigError(f"push_tos must be a TOS byte in 0-255, got {self.push_tos}")
        if not self.send_queue_ms >= 0:
            raise ConfigError(f"send_queue_ms must be >= 0, got {self.send_queue_ms}")
        check_heartbeat_timeout(self.heartbeat_timeout)
        check_replicas(self.replicas)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> WorkerOptions:
        """Read the worker tunables; keyword ``overrides`` (not None) win over the environment."""
        env = os.environ if env is None else env
        values = config_fields(env, WORKER_OPTIONS)
        values["metrics"] = metrics_config_from_env(env)
        values["curve"] = curve_keys_from_env("worker", env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def for_job(self, num_workers: int) -> WorkerOptions:
        """These options with every "default by job size" (None) setting filled in for a job
        of ``num_workers`` workers (:func:`default_push_lead`, :func:`default_push_tos`)."""
        return replace(
            self,
            push_lead=default_push_lead(num_workers) if self.push_lead is None else self.push_lead,
            push_tos=default_push_tos(num_workers) if self.push_tos is None else self.push_tos,
        )


def default_push_lead(num_workers: int) -> int:
    """Unanswered pushes per server connection a worker allows by default (0: no limit).

    The limit keeps the workers of a synchronous round in step when many of them share one
    server's link (TCP shares it unevenly and a round waits for the slowest); with two workers
    there is no such crowd and it only adds pipeline bubbles, so small jobs run without it.
    """
    return 3 if num_workers >= 3 else 0


def default_push_tos(num_workers: int) -> int:
    """IP TOS byte a worker marks its packets with by default (0: unmarked).

    Where a worker shares its host with a server, its pushes leave through the uplink that
    carries that server's replies to the other N - 1 workers; TCP gives the push flow 1/N of it,
    the worker straggles and every round waits for it. Marked low-delay, the pushes pass the
    replies in a queue that honours TOS (Linux pfifo_fast). With 2 workers there is no such
    crowd, and holding replies back behind pushes only delays them, so small jobs leave packets
    unmarked.
    """
    return DEFAULT_PUSH_TOS if num_workers >= 3 else 0


def default_server_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class ServerConfig:
    """A shard server's settings (from ``kvstore-server`` flags).

    Attributes:
        host: interface to bind (``127.0.0.1``, ``0.0.0.0``, a hostname).
        port: TCP port; 0 picks a free one.
        server_rank: this server's rank, ``0 <= server_rank < num_servers``.
        num_servers: S.
        num_workers: N; a ``dist_sync`` round completes when all N workers pushed.
        threads: executor threads for decode, aggregation and optimizer work.
        bind: explicit ZeroMQ endpoint that overrides host and port (``inproc://...``).
        partition_bytes: the workers' ``KVSTORE_PARTITION_BYTES``, from which the default
            message size limit is derived (:func:`kvstore.topology.max_payload_bytes`).
        max_message_bytes: the largest frame accepted (``KVSTORE_MAX_MESSAGE_BYTES``); None:
            derived from ``partition_bytes``. In-process (``inproc://``) servers have none.
        heartbeat_timeout: seconds without a message from a worker after which its rank is
            lost and released (``KVSTORE_HEARTBEAT_TIMEOUT``, which ``kvstore-server``
            reads); 0, the default here (an in-process server): never.
        metrics: the Prometheus endpoint's settings; None: no endpoint.
        curve: the server's CURVE credentials (``KVSTORE_AUTH_*``): it then admits only
            workers holding the job's client key; None: it accepts any worker.
        native_sends: send large values through the compiled free function
            (:mod:`kvstore.zerocopy`); False: pyzmq's zero-copy sends.
        inline_work: run pushes' work on the event loop until it waits and small chunks'
            work there (:mod:`kvstore.server.work`); False: a task per push, the thread pool
            for every chunk.
        acks_on_pulls: acknowledge a push in the value reply of the worker's waiting pull
            (:meth:`kvstore.server.rounds.Rounds._ack_with_pull`); False: an ack per push.
        max_connections: connections the server's admission gate accepts at once
            (``KVSTORE_MAX_CONNECTIONS``; :mod:`kvstore.server.gate`).
        receive_buffer_bytes: bytes of received messages that the server has not yet taken
            from its socket, over all connections (``KVSTORE_RECEIVE_BUFFER_BYTES``).
        admission_gate: on TCP, accept connections through the admission gate, which bounds
            what peers can make the server hold; False: the ZeroMQ socket listens itself (for
            measuring the gate's cost).
        replicas: R (``KVSTORE_REPLICAS``): the server keeps a backup of the shards of the
            R - 1 servers before it in rank order and forwards each round of its own shard to
            the R - 1 after it (:mod:`kvstore.server.replication`); 1: no replication.
        peers: the job's server addresses in rank order (``KVSTORE_SERVERS``), where the
            server is told them at start: a server that replaces a lost one needs them to be
            caught up. None: learnt from the workers' handshakes.
    """

    host: str = "127.0.0.1"
    port: int = 0
    server_rank: int = 0
    num_servers: int = 1
    num_workers: int = 1
    threads: int = field(default_factory=default_server_threads)
    bind: str | None = None
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    max_message_bytes: int | None = None
    heartbeat_timeout: float = 0.0
    metrics: MetricsConfig | None = None
    curve: CurveKeys | None = None
    native_sends: bool = True
    inline_work: bool = True
    acks_on_pulls: bool = True
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    receive_buffer_bytes: int = DEFAULT_RECEIVE_BUFFER_BYTES
    admission_gate: bool = True
    replicas: int = 1
    peers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port {self.port} is out of range 0..65535")
        if self.num_servers < 1:
            raise ConfigError(f"--num-servers must be >= 1, got {self.num_servers}")
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.server_rank < self.num_servers:
            raise ConfigError(
                f"--server-rank {self.server_rank} is out of range for "
                f"--num-servers {self.num_servers}"
            )
        if self.threads < 1:
            raise ConfigError(f"server threads must be >= 1, got {self.threads}")
        if self.partition_bytes < 64:
            raise ConfigError(f"partition_bytes must be >= 64, got {self.partition_bytes}")
        if self.max_message_bytes is not None and self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ConfigError(
                f"max_message_bytes must be >= {MIN_MESSAGE_BYTES} (a header may take that "
                f"much), got {self.max_message_bytes}"
            )
        check_heartbeat_timeout(self.heartbeat_timeout)
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.receive_buffer_bytes < MIN_RECEIVE_BUFFER_BYTES:
            raise ConfigError(
                f"receive_buffer_bytes must be >= {MIN_RECEIVE_BUFFER_BYTES}, got "
                f"{self.receive_buffer_bytes}"
            )
        check_replicas(self.replicas, self.num_servers)
        if self.peers is not None and len(self.peers) != self.num_servers:
            raise ConfigError(
                f"KVSTORE_SERVERS lists {len(self.peers)} servers but --num-servers is "
                f"{self.num_servers}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ServerConfig:
        """A ``kvstore-server`` process's settings from the environment; keyword ``overrides``
        (not None: its command line) win over it. Unlike an in-process server, such a process
        has heartbeats on unless ``KVSTORE_HEARTBEAT_TIMEOUT`` is 0 (default 30 seconds)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {"heartbeat_timeout": DEFAULT_HEARTBEAT_TIMEOUT}
        values.update(config_fields(env, SERVER_CONFIG))
        values["metrics"] = metrics_config_from_env(env)
        values["curve"] = curve_keys_from_env("server", env)
        if env.get("KVSTORE_SERVERS"):
            values["peers"] = parse_server_list("KVSTORE_SERVERS", env["KVSTORE_SERVERS"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def check_replicas(replicas: int, num_servers: int | None = None) -> None:
    """Refuse a replica count below 1, or above the job's servers (``num_servers``)."""
    if replicas < 1:
        raise ConfigError(f"KVSTORE_REPLICAS must be >= 1, got {replicas}")
    if num_servers is not None and replicas > num_servers:
        raise ConfigError(
            f"KVSTORE_REPLICAS={replicas} needs at least {replicas} servers, the job has "
            f"{num_servers}"
        )


def heartbeat_interval(timeout: float) -> float:
    """How often a worker pings each server (and a server checks on its workers) for a
    heartbeat timeout of ``timeout`` seconds: a sixth of it, at most
    :data:`MAX_HEARTBEAT_INTERVAL`, so that one late ping never looks like a lost peer."""
    return min(MAX_HEARTBEAT_INTERVAL, timeout / 6)


def malloc_tuning_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``KVSTORE_MALLOC_TUNING``: True (default) unless set to 0/false/no/off."""
    env = os.environ if env is None else env
    return env_value(env, "KVSTORE_MALLOC_TUNING", True)


def cpu_kernels_from_env(env: Mapping[str, str] | None = None) -> str:
    """``KVSTORE_CPU_KERNELS``: ``"numba"`` (default) or ``"numpy"``."""
    env = os.environ if env is None else env
    return env_value(env, "KVSTORE_CPU_KERNELS", "numba")
