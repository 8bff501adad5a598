"""Job credentials: CURVE keys that let a job's workers, and only them, talk to its servers.

A job has two CURVE key pairs (ZeroMQ's CurveZMQ: Curve25519 key exchange, then every message
encrypted and authenticated with XSalsa20-Poly1305), each key 40 characters of Z85 text:

* the *server* pair: every server of the job holds its secret key; workers hold its public key
  and talk only to a server that proves it has the secret one;
* the *client* pair: every worker holds its secret key; servers hold its public key, and their
  ZAP handler (:class:`ZapHandler`) admits a connection only when the client proved it has the
  matching secret key. A connection without the job's client key never completes its handshake:
  its messages are never delivered, so it gets no answer, takes no rank and changes nothing.

This module makes (:meth:`JobKeys.generate`), encodes (:meth:`JobKeys.env`,
:meth:`JobKeys.write`, :meth:`JobKeys.k8s_secret`) and applies (:func:`secure_server`,
:func:`secure_client`, :class:`ZapHandler`) job credentials; processes load theirs with
:func:`kvstore.config.curve_keys_from_env`, which validates them. ``kvstore-keygen``
(:func:`main`) writes a job's keys for jobs started by hand.
``kvstore-launch`` makes fresh keys for every job and hands each process only its role's keys.

Credentials only cost during a connection's handshake; encryption costs CPU on every byte (see
docs/operations.md, "Security", for the measured cost and the switch for trusted networks).

This module depends only on :mod:`kvstore.errors` and :mod:`kvstore.config` (and pyzmq).
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvstore.config import (
    AUTH_DIR_VAR,
    AUTH_KEY_FILES,
    AUTH_ROLE_FILES,
    AUTH_VARS,
    CurveKeys,
    KeyOrigin,
    check_z85_key,
)
from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler about every handshake (RFC 27)."""
_ZAP_VERSION = b"1.0"
ZAP_DOMAIN = b"kvstore"
WORKER_USER_ID = b"kvstore-worker"
"""The ZAP user id of a connection that proved it holds the job's client key."""
SERVER_USER_ID = b"kvstore-server"
"""The ZAP user id of a connection that proved it holds the job's server key (another server of
the job); each message's ``User-Id`` property says it."""
"""The ZAP domain of a server socket with keys (any name would do: it makes libzmq ask)."""
DENIAL_LOG_INTERVAL = 10.0
"""Seconds between two warnings about refused connections (the rest are counted)."""

ROLE_FILES = AUTH_ROLE_FILES
"""The key files each role's directory holds (those of the Kubernetes Secret's items)."""


def curve_available() -> bool:
    """Whether this pyzmq's libzmq can do CURVE (pyzmq's wheels can)."""
    return bool(zmq.has("curve"))


def _require_curve() -> None:
    if not curve_available():
        raise ConfigError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE: install pyzmq's wheel "
            f"(`pip install --force-reinstall pyzmq`), or run on a trusted network without "
            f"keys (`kvstore-launch --no-auth`)"
        )


@dataclass(frozen=True)
class JobKeys:
    """The four keys of one job (Z85 text); ``repr`` never shows the secret ones."""

    server_public: str
    server_secret: str = field(repr=False)
    client_public: str
    client_secret: str = field(repr=False)

    def __post_init__(self) -> None:
        for name in AUTH_KEY_FILES:
            check_z85_key(name, self._key(name))

    @classmethod
    def generate(cls) -> JobKeys:
        """Fresh keys (from libsodium's random generator, through libzmq)."""
        _require_curve()
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(
            server_public.decode(),
            server_secret.decode(),
            client_public.decode(),
            client_secret.decode(),
        )

    def _key(self, file_name: str) -> str:
        return {
            "server-secret-key": self.server_secret,
            "server-public-key": self.server_public,
            "client-secret-key": self.client_secret,
            "client-public-key": self.client_public,
        }[file_name]

    def for_role(self, role: str) -> CurveKeys:
        """What a process of ``role`` (``"server"`` or ``"worker"``) holds."""
        if role == "server":
            return CurveKeys("server", self.server_secret, self.client_public, self.server_public)
        if role == "worker":
            return CurveKeys("worker", self.client_secret, self.server_public, self.client_public)
        raise ConfigError(f"role must be 'server' or 'worker', got {role!r}")

    def env(self, role: str) -> dict[str, str]:
        """The credential variables of a ``role`` process: see :func:`role_env`."""
        return role_env(role, self)

    def write(self, directory: str | os.PathLike[str], *, force: bool = False) -> None:
        """Write ``directory/server`` and ``directory/worker`` (mode 0700), one key per file
        (mode 0600), each holding what its role reads (:data:`ROLE_FILES`).

        Raises:
            ConfigError: a key file exists already (unless ``force``), or cannot be written.
        """
        root = Path(directory)
        try:
            for role, names in ROLE_FILES.items():
                folder = root / role
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(folder, 0o700)
                for name in names:
                    _write_private(folder / name, self._key(name) + "\n", force)
        except OSError as exc:
            raise ConfigError(f"cannot write the keys to {root}: {exc}") from None

    def k8s_secret(self, name: str) -> str:
        """A Kubernetes Secret manifest named ``name`` holding the four keys under their file
        names (what ``deploy/k8s`` mounts at ``/etc/pskv/keys``)."""
        lines = [
            "apiVersion: v1",
            "kind: Secret",
            "metadata:",
            f"  name: {json.dumps(name)}",
            "  labels:",
            "    app.kubernetes.io/name: pskv",
            "type: Opaque",
            "stringData:",
        ]
        # JSON strings are YAML strings; Z85 has no quote or backslash to escape.
        lines += [f"  {file}: {json.dumps(self._key(file))}" for file in AUTH_KEY_FILES]
        return "\n".join(lines) + "\n"


def _write_private(path: Path, text: str, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (0 if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists: pass --force to replace the job's keys") from None
    with os.fdopen(fd, "w", encoding="ascii") as f:
        os.fchmod(f.fileno(), 0o600)  # an existing file replaced with --force keeps no wider mode
        f.write(text)


def role_env(role: str, keys: JobKeys | None) -> dict[str, str]:
    """Every credential variable for a child process of ``role``: its role's keys from
    ``keys``, and every other one blank, so that it inherits no key of the other role (nor,
    with ``keys=None``, any key at all) from the environment it is started in. A blank
    variable counts as unset."""
    env = dict.fromkeys(AUTH_VARS, "")
    if keys is not None:
        own = keys.for_role(role)
        secret, public, peer = ROLE_FILES[role]
        env[AUTH_KEY_FILES[secret]] = own.secret_key
        env[AUTH_KEY_FILES[public]] = own.public_key or ""
        env[AUTH_KEY_FILES[peer]] = own.peer_key
    return env


SECRET_VARS: frozenset[str] = frozenset(
    var for name, var in AUTH_KEY_FILES.items() if "secret" in name
)
"""The variables that hold secret keys: never on a command line."""


# applying keys to sockets --------------------------------------------------------------------


def _own_public(keys: CurveKeys) -> bytes:
    public = zmq.curve_public(keys.secret_key.encode())
    if keys.public_key is not None and not hmac.compare_digest(public, keys.public_key.encode()):
        mine = "server" if keys.role == "server" else "client"
        raise ConfigError(
            f"the {mine}-public-key given to this {keys.role} does not belong to its "
            f"{mine}-secret-key: the two come from different `kvstore-keygen` runs"
        )
    return public


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE server with the job's server secret key (before it binds).

    Clients are checked by the context's ZAP handler (:class:`ZapHandler`), which must run
    before the socket binds. The socket fails closed: with a ZAP domain and
    ``ZMQ_ZAP_ENFORCE_DOMAIN`` set, a handshake that finds no handler is refused (by default
    libzmq would admit any client that knows the server's public key).
    """
    _require_curve()
    _own_public(keys)  # a mismatched pair is a configuration error, not a silent lock-out
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret_key.encode())


def server_public_key(keys: CurveKeys) -> str:
    """The job's server public key, from a server's credentials (Z85 text)."""
    return _own_public(keys).decode()


def secure_server_peer(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE client of another server of the job, authenticated by the job's
    server key pair (which only servers hold; their ZAP handlers admit it as
    :data:`SERVER_USER_ID`), before it connects."""
    _require_curve()
    public = _own_public(keys)
    sock.setsockopt(zmq.CURVE_SERVERKEY, public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret_key.encode())


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE client with the job's client keys, talking only to a server that
    holds the job's server secret key (before it connects)."""
    _require_curve()
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.peer_key.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, _own_public(keys))
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret_key.encode())


CURVE_MESSAGE_OVERHEAD = 33
"""Bytes a CURVE connection adds to every frame on the wire (the ``MESSAGE`` command's name, 8;
its nonce, 8; the authenticator, 16; the flags byte, 1), which ``ZMQ_MAXMSGSIZE`` counts: a
server with keys raises its frame limit by this much."""


HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Socket monitor events of a handshake that failed (libzmq >= 4.3)."""
_MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
_CRYPTOGRAPHIC = 0x11000001  # ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC
_REFUSED_BEFORE_ZAP = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
"""A CURVE server's handshake failures that happen before its ZAP handler is asked (the ZAP
handler logs its own refusals, ``EVENT_HANDSHAKE_FAILED_AUTH``)."""


def _why_refused(event: int, value: int) -> str:
    """Why a CURVE server refused a handshake, from its socket monitor's event and value."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
        return "an unencrypted handshake (a client without the job's keys)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _CRYPTOGRAPHIC:
        return "a handshake for another server key (a client with another job's keys)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"a malformed handshake (ZMTP protocol error {value:#x})"
    return "a handshake that failed without detail"


_ZAP_DENIED = 400  # the status of a ZAP reply that refuses the client (500: the handler failed)


def _worker_key_fix(origin: KeyOrigin | None, file_name: str) -> str:
    """What a worker whose key ``file_name`` (from ``origin``) is not its job's should do."""
    if origin is None:
        return f"give the workers the {file_name} of the servers' job (same `kvstore-keygen` run)"
    if origin.directory is not None:
        return (
            f"give the workers {AUTH_DIR_VAR}=DIR/worker of the `kvstore-keygen DIR` run whose "
            f"DIR/server the servers read"
        )
    return (
        f"set {origin.variable} to the job's {file_name}, from the `kvstore-keygen` run (or the "
        f"launcher) that gave the servers their keys"
    )


def _from(origin: KeyOrigin | None) -> str:
    return "" if origin is None else f" (from {origin})"


def describe_handshake_failure(
    event: int,
    value: int,
    server: str,
    secured: bool,
    origins: Mapping[str, KeyOrigin] | None = None,
) -> str:
    """Why a worker's handshake with ``server`` (its rank and address) failed, and what to do,
    from its socket monitor's ``event`` and ``value``; ``secured``: whether the worker has CURVE
    keys.

    The text names ``server`` once, and where the worker's keys came from as the user set them
    (``KVSTORE_AUTH_DIR=PATH`` or a ``KVSTORE_AUTH_*_KEY`` variable): ``origins``, the
    worker's :attr:`~kvstore.config.CurveKeys.origins` (None or empty: keys handed over in
    code)."""
    origins = origins or {}
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if value != _ZAP_DENIED:
            return f"{server} could not check this worker's keys (ZAP status {value}): see its log"
        origin = origins.get("client-secret-key")
        return (
            f"{server} refused this worker's client key{_from(origin)}: it is not the job's; "
            f"{_worker_key_fix(origin, 'client-secret-key')}"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
        if secured:
            origin = origins.get("client-secret-key")
            return (
                f"{server} does not use CURVE keys but this worker does{_from(origin)}: start "
                f"the servers with the job's keys ({AUTH_DIR_VAR}=DIR/server), or the workers "
                f"without"
            )
        return f"{server} requires the job's CURVE keys and {_NO_KEYS_FIX}"
    if secured:
        origin = origins.get("server-public-key")
        return (
            f"the CURVE handshake with {server} failed: this worker's server public key"
            f"{_from(origin)} is not the server's (keys of another job or another "
            f"`kvstore-keygen` run), or the server has no keys; "
            f"{_worker_key_fix(origin, 'server-public-key')}"
        )
    # (No detail: libzmq reports a plain worker's refusal by a CURVE server so too, depending
    # on how the two ends' steps interleave, as they do differently on a busy machine.)
    return (
        f"the handshake with {server} failed: it probably requires the job's CURVE keys, "
        f"and {_NO_KEYS_FIX}"
    )


_NO_KEYS_FIX = (
    f"this worker has none: set {AUTH_DIR_VAR}=DIR/worker of the `kvstore-keygen DIR` run "
    f"whose DIR/server the servers read (or the KVSTORE_AUTH_*_KEY variables), or start it with "
    f"kvstore-launch"
)


# the server's ZAP handler --------------------------------------------------------------------


class ZapHandler:
    """Answers the ZAP requests of one ZeroMQ context: admits CURVE clients whose public key is
    ``client_key`` (Z85 text), refuses everything else.

    A thread of its own, outside the server's event loop: it runs once per connection
    handshake, never per message. A request it cannot parse is refused: the handler fails
    closed.

    Refusals are logged at WARNING, each kind at most once per :data:`DENIAL_LOG_INTERVAL` (a
    stranger retrying in a loop does not flood the log), with the number of that kind refused
    since its last warning. A client key that is not the job's reaches this handler, and its
    warning names the peer's address. Handshakes that fail before they reach it (a client
    without keys, or one that holds a server key that is not this server's, whose first
    message cannot be decrypted) are seen through a monitor of the ``watch`` socket, the
    server's; libzmq reports those without the peer's address.

    Start it before the server socket binds and stop it before the context terminates.
    """

    def __init__(
        self,
        context: zmq.Context,
        client_key: str,
        name: str = "server",
        watch: zmq.Socket | None = None,
        server_key: str | None = None,
    ) -> None:
        self._allowed = z85.decode(client_key.encode())
        # The job's server public key: another server of the job (a replica's link,
        # kvstore.server.replication) authenticates with the server pair it holds.
        self._server = z85.decode(server_key.encode()) if server_key is not None else None
        self._name = name
        self.describe_address: Callable[[str], str | None] | None = None
        """Maps the address libzmq reports to the peer's own (a server behind its admission
        gate sees the gate's relay addresses); None: shown as reported."""
        self._context = context
        self._stop_endpoint = f"inproc://kvstore-zap-stop-{id(self)}"
        self._watched = watch
        self._monitor_endpoint = f"inproc://kvstore-zap-monitor-{id(self)}"
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop_sock: zmq.Socket | None = None
        self.refused = 0
        """Connections refused so far."""
        self._unreported: dict[str, int] = {}  # per kind of refusal
        self._last_warning: dict[str, float] = {}
        self._refusals_lock = threading.Lock()  # the gate reports from the server's loop
        self.mismatches_reported = False
        """True while the server's admission gate reports unencrypted handshakes
        (:meth:`refuse_unencrypted`), with the peer's address: the monitor's reports of them,
        without it, are then left out."""
        self._thread = threading.Thread(target=self._run, name="kvstore-zap", daemon=True)

    def start(self) -> None:
        """Bind the context's ZAP endpoint and start answering.

        Raises:
            OSError: another ZAP handler serves this context already.
        """
        self._stop_sock = self._context.socket(zmq.PAIR)
        self._stop_sock.setsockopt(zmq.LINGER, 0)
        self._stop_sock.bind(self._stop_endpoint)
        if self._watched is not None:
            self._watched.monitor(self._monitor_endpoint, _REFUSED_BEFORE_ZAP)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._stop_sock.close(0)
            self._stop_sock = None
            raise OSError(f"cannot start the ZAP handler: {self._error}") from self._error

    def stop(self) -> None:
        """Stop answering and close the handler's sockets (the context may then terminate)."""
        if self._stop_sock is None:
            return
        if self._thread.is_alive():
            self._stop_sock.send(b"")
            self._thread.join()
        self._stop_sock.close(0)
        self._stop_sock = None
        if self._watched is not None and not self._watched.closed:
            self._watched.disable_monitor()

    def _run(self) -> None:
        try:
            zap = self._context.socket(zmq.REP)
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind(ZAP_ENDPOINT)
            stop = self._context.socket(zmq.PAIR)
            stop.setsockopt(zmq.LINGER, 0)
            stop.connect(self._stop_endpoint)
            monitor = None
            if self._watched is not None:
                monitor = self._context.socket(zmq.PAIR)
                monitor.setsockopt(zmq.LINGER, 0)
                monitor.connect(self._monitor_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if stop in events:
                    return
                if monitor is not None and monitor in events:
                    self._on_monitor(monitor)
                if zap in events:
                    request = zap.recv_multipart()
                    try:
                        reply = self.answer(request)
                    except Exception:  # never let the handler die: answer "no"
                        logger.exception("%s: cannot answer a ZAP request", self._name)
                        reply = [_ZAP_VERSION, request[1] if len(request) > 1 else b"", b"500",
                                 b"internal error", b"", b""]  # fmt: skip
                    zap.send_multipart(reply)
        finally:
            zap.close(0)
            stop.close(0)
            if monitor is not None:
                monitor.close(0)

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        """Log the handshakes the watched socket refused before they reached this handler."""
        while True:
            try:
                event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if not event["event"] & _REFUSED_BEFORE_ZAP:
                continue
            mismatch = (
                event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                and event["value"] == _MECHANISM_MISMATCH
            )
            if not (mismatch and self.mismatches_reported):
                self._refuse(b"", None, _why_refused(event["event"], event["value"]))

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to ``request`` (RFC 27: version, request id, domain, address,
        identity, mechanism, credentials...)."""
        request_id = request[1] if len(request) > 1 else b""
        address = request[3].decode("ascii", "replace") if len(request) > 3 else "?"
        if self.describe_address is not None:
            address = self.describe_address(address) or address
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            return self._refuse(request_id, address, "a malformed ZAP request")
        mechanism, credentials = request[5], request[6:]
        if mechanism != b"CURVE" or len(credentials) != 1:
            return self._refuse(request_id, address, f"a {mechanism!r} handshake (not CURVE)")
        if self._server is not None and hmac.compare_digest(credentials[0], self._server):
            return [_ZAP_VERSION, request_id, b"200", b"OK", SERVER_USER_ID, b""]
        if not hmac.compare_digest(credentials[0], self._allowed):
            return self._refuse(request_id, address, "a client key that is not the job's")
        return [_ZAP_VERSION, request_id, b"200", b"OK", WORKER_USER_ID, b""]

    def refuse_unencrypted(self, address: str) -> None:
        """Count and log (rate-limited) a client at ``address`` that offered no encryption,
        which libzmq refuses."""
        self._refuse(
            b"", address, _why_refused(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, _MECHANISM_MISMATCH)
        )

    def _refuse(self, request_id: bytes, address: str | None, why: str) -> list[bytes]:
        """Count a refusal and log it (rate-limited per kind, ``why``); the ZAP reply that
        refuses the request ``request_id``."""
        with self._refusals_lock:
            return self._count_refusal(request_id, address, why)

    def _count_refusal(self, request_id: bytes, address: str | None, why: str) -> list[bytes]:
        self.refused += 1
        unreported = self._unreported.get(why, 0) + 1
        now = time.monotonic()
        if now - self._last_warning.get(why, -DENIAL_LOG_INTERVAL) >= DENIAL_LOG_INTERVAL:
            earlier = unreported - 1
            source = f" from {address}" if address is not None else ""
            logger.warning(
                "%s refused a connection%s: %s%s",
                self._name,
                source,
                why,
                f" ({earlier} more refused so since the last warning)" if earlier else "",
            )
            self._last_warning[why] = now
            unreported = 0
        self._unreported[why] = unreported
        return [_ZAP_VERSION, request_id, b"400", b"not a worker of this job", b"", b""]


# kvstore-keygen ------------------------------------------------------------------------------


_ROLE_COMMANDS = {"server": "kvstore-server ...", "worker": "python train.py"}


def credentials_help(roles: Sequence[str] = ("server", "worker")) -> str:
    """How a process of each of ``roles`` gets the job's keys, in lines for a command's
    ``--help`` (``kvstore-keygen``, ``kvstore-server``): the ``KVSTORE_AUTH_DIR`` folder that
    ``kvstore-keygen DIR`` writes, or the variables that hold the keys themselves."""
    lines = ["credentials (a key's variable wins over its file in KVSTORE_AUTH_DIR):"]
    for role in roles:
        secret, public, peer = ROLE_FILES[role]
        keys = f"{AUTH_KEY_FILES[secret]} and {AUTH_KEY_FILES[peer]}"
        lines += [
            f"  {role}s: {AUTH_DIR_VAR}=DIR/{role} {_ROLE_COMMANDS[role]}",
            f"       or: {keys}",
            f"           ({AUTH_KEY_FILES[public]} optional: checked against the secret key)",
        ]
    lines.append("  a server without keys accepts any worker (it logs a warning saying so)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore-keygen",
        description="Make the CURVE keys of one kvstore job started by hand\n"
        "(kvstore-launch makes its own for every job).",
        epilog=credentials_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "directory",
        nargs="?",
        metavar="DIR",
        help="write DIR/server (for servers) and DIR/worker (for workers), mode 0700, one key "
        "per file, mode 0600",
    )
    what.add_argument(
        "--k8s-secret",
        metavar="NAME",
        help="print a Kubernetes Secret manifest NAME with the four keys instead of writing "
        "files (e.g. `kvstore-keygen --k8s-secret pskv-job-keys | kubectl apply -f -`)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace existing key files (default: refuse)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``kvstore-keygen``: see :func:`build_parser`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        keys = JobKeys.generate()
        if args.k8s_secret is not None:
            sys.stdout.write(keys.k8s_secret(args.k8s_secret))
            return 0
        keys.write(args.directory, force=args.force)
    except ConfigError as exc:
        print(f"kvstore-keygen: {exc}", file=sys.stderr)
        return 1
    root = Path(args.directory)
    print(f"wrote the job's keys to {root / 'server'} (servers) and {root / 'worker'} (workers)")
    print(f"  servers: {AUTH_DIR_VAR}={root / 'server'} kvstore-server ...")
    print(f"  workers: {AUTH_DIR_VAR}={root / 'worker'} python train.py ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
