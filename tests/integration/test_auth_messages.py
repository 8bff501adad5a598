"""What a worker whose keys do not fit its servers is told: the server and its address once, the
variable the user set (``KVSTORE_AUTH_DIR`` with its path, or the ``KVSTORE_AUTH_*_KEY``
variable), and what to do. Against a real server started with a ``kvstore-keygen`` folder."""

from __future__ import annotations

import pytest
from kvtest import connect, start_servers, stop_processes

from kvstore.auth import JobKeys, role_env
from kvstore.errors import AuthenticationError

pytestmark = pytest.mark.integration

CONNECT_TIMEOUT = 60
"""The handshake's limit: the error must come before it, from the failed handshake itself."""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job's keys in a ``kvstore-keygen DIR`` folder, and a server started with DIR/server."""
    root = tmp_path_factory.mktemp("job")
    keys = JobKeys.generate()
    keys.write(root)
    env = {**role_env("server", None), "KVSTORE_AUTH_DIR": str(root / "server")}
    servers = start_servers(1, 1, env=env)
    try:
        yield keys, servers[0].address
    finally:
        stop_processes([s.process for s in servers])


def _refusal(monkeypatch, address: str, env: dict[str, str]) -> str:
    """The message of the AuthenticationError a worker with ``env`` gets from ``address``."""
    for name, value in {**role_env("worker", None), **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(AuthenticationError) as raised:
        connect([address], connect_timeout=CONNECT_TIMEOUT)
    return str(raised.value)


def test_wrong_key_folder_is_named_with_its_path(job, monkeypatch, tmp_path):
    _, address = job
    JobKeys.generate().write(tmp_path)  # another `kvstore-keygen` run
    message = _refusal(monkeypatch, address, {"KVSTORE_AUTH_DIR": str(tmp_path / "worker")})
    assert f"KVSTORE_AUTH_DIR={tmp_path / 'worker'}" in message
    assert "KVSTORE_AUTH_SERVER_PUBLIC_KEY" not in message  # the user did not set it
    assert message.count(address) == 1
    assert "server 0" in message and "DIR/server the servers read" in message


def test_wrong_server_public_key_variable_is_named(job, monkeypatch, tmp_path):
    keys, address = job
    keys.write(tmp_path)  # the job's own folder: only the variable's key is wrong
    env = {
        "KVSTORE_AUTH_DIR": str(tmp_path / "worker"),
        "KVSTORE_AUTH_SERVER_PUBLIC_KEY": JobKeys.generate().server_public,
    }
    message = _refusal(monkeypatch, address, env)
    assert "(from KVSTORE_AUTH_SERVER_PUBLIC_KEY)" in message
    assert "KVSTORE_AUTH_DIR" not in message
    assert "set KVSTORE_AUTH_SERVER_PUBLIC_KEY to the job's server-public-key" in message
    assert message.count(address) == 1


def test_refused_client_key_names_where_it_came_from(job, monkeypatch, tmp_path):
    keys, address = job
    other = JobKeys.generate()
    # The job's server public key (so the server proves itself), another run's client pair.
    mixed = JobKeys(
        keys.server_public, keys.server_secret, other.client_public, other.client_secret
    )
    mixed.write(tmp_path)
    folder = tmp_path / "worker"
    message = _refusal(monkeypatch, address, {"KVSTORE_AUTH_DIR": str(folder)})
    assert f"refused this worker's client key (from KVSTORE_AUTH_DIR={folder})" in message
    assert message.count(address) == 1

    variables = {**other.env("worker"), "KVSTORE_AUTH_SERVER_PUBLIC_KEY": keys.server_public}
    message = _refusal(monkeypatch, address, variables)
    assert "refused this worker's client key (from KVSTORE_AUTH_CLIENT_SECRET_KEY)" in message
    assert "KVSTORE_AUTH_DIR" not in message
    assert message.count(address) == 1


def test_a_worker_without_keys_is_told_how_to_get_them(job, monkeypatch):
    _, address = job
    message = _refusal(monkeypatch, address, {})
    # (with or without the handshake's detail, which a busy machine may not deliver)
    assert "requires the job's CURVE keys" in message and "this worker has none" in message
    assert "KVSTORE_AUTH_DIR=DIR/worker" in message
    assert message.count(address) == 1
