"""Job credentials without sockets: making, reading, validating and handing out CURVE keys."""

from __future__ import annotations

import stat

import pytest

from kvstore.auth import ROLE_FILES, SECRET_VARS, JobKeys, ZapHandler, main, role_env
from kvstore.config import AUTH_VARS, CurveKeys, curve_keys_from_env, launcher_auth_from_env
from kvstore.deploy.backends import SSHBackend
from kvstore.errors import ConfigError


@pytest.fixture(scope="module")
def keys() -> JobKeys:
    return JobKeys.generate()


def test_fresh_keys_differ_and_secrets_never_show(keys):
    other = JobKeys.generate()
    assert len({keys.server_secret, keys.client_secret, other.server_secret}) == 3
    assert keys.server_secret not in repr(keys) and keys.client_secret not in repr(keys)
    assert keys.server_public in repr(keys)
    for role in ("server", "worker"):
        assert keys.for_role(role).secret_key not in repr(keys.for_role(role))


def test_each_role_gets_its_own_keys_and_nothing_of_the_other(keys):
    server, worker = role_env("server", keys), role_env("worker", keys)
    assert set(server) == set(worker) == set(AUTH_VARS)
    assert server["KVSTORE_AUTH_SERVER_SECRET_KEY"] == keys.server_secret
    assert server["KVSTORE_AUTH_CLIENT_PUBLIC_KEY"] == keys.client_public
    assert server["KVSTORE_AUTH_CLIENT_SECRET_KEY"] == ""
    assert worker["KVSTORE_AUTH_CLIENT_SECRET_KEY"] == keys.client_secret
    assert worker["KVSTORE_AUTH_SERVER_PUBLIC_KEY"] == keys.server_public
    assert worker["KVSTORE_AUTH_SERVER_SECRET_KEY"] == ""
    assert server["KVSTORE_AUTH_DIR"] == worker["KVSTORE_AUTH_DIR"] == ""
    # what a child reads back is exactly its role's keys
    assert curve_keys_from_env("server", server) == keys.for_role("server")
    assert curve_keys_from_env("worker", worker) == keys.for_role("worker")
    # without keys every credential variable is blanked, so none is inherited
    assert set(role_env("worker", None).values()) == {""}
    assert curve_keys_from_env("worker", role_env("worker", None)) is None


def test_no_keys_means_no_authentication():
    assert curve_keys_from_env("server", {}) is None
    assert curve_keys_from_env("worker", {"KVSTORE_AUTH_DIR": "  "}) is None  # blank = unset


def test_one_key_without_the_other_is_a_config_error(keys):
    with pytest.raises(ConfigError, match="KVSTORE_AUTH_CLIENT_PUBLIC_KEY"):
        curve_keys_from_env("server", {"KVSTORE_AUTH_SERVER_SECRET_KEY": keys.server_secret})
    with pytest.raises(ConfigError, match="client-secret-key"):
        curve_keys_from_env("worker", {"KVSTORE_AUTH_SERVER_PUBLIC_KEY": keys.server_public})


def test_a_malformed_key_is_named_and_never_echoed(keys):
    bad = keys.server_secret[:-1] + "\\"  # right length, one character outside Z85
    for value, match in ((bad, "outside the Z85 alphabet"), ("short", "got 5 characters")):
        env = {
            "KVSTORE_AUTH_SERVER_SECRET_KEY": value,
            "KVSTORE_AUTH_CLIENT_PUBLIC_KEY": keys.client_public,
        }
        with pytest.raises(ConfigError, match=match) as info:
            curve_keys_from_env("server", env)
        assert "KVSTORE_AUTH_SERVER_SECRET_KEY" in str(info.value)
        assert value not in str(info.value)
    with pytest.raises(ConfigError):
        CurveKeys("client", keys.client_secret, keys.server_public)


def test_keygen_writes_a_folder_per_role_readable_by_its_owner_only(tmp_path, keys, capsys):
    assert main([str(tmp_path / "job")]) == 0
    assert "KVSTORE_AUTH_DIR=" in capsys.readouterr().out
    for role, files in ROLE_FILES.items():
        folder = tmp_path / "job" / role
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert sorted(p.name for p in folder.iterdir()) == sorted(files)
        for path in folder.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        read = curve_keys_from_env(role, {"KVSTORE_AUTH_DIR": str(folder)})
        assert read is not None and read.role == role
    # the worker's folder holds no server secret, the server's no client secret
    assert not (tmp_path / "job" / "worker" / "server-secret-key").exists()
    assert not (tmp_path / "job" / "server" / "client-secret-key").exists()
    server = curve_keys_from_env("server", {"KVSTORE_AUTH_DIR": str(tmp_path / "job/server")})
    worker = curve_keys_from_env("worker", {"KVSTORE_AUTH_DIR": str(tmp_path / "job/worker")})
    assert server.peer_key == worker.public_key and worker.peer_key == server.public_key


def test_keygen_never_overwrites_a_jobs_keys_unless_forced(tmp_path, capsys):
    assert main([str(tmp_path)]) == 0
    before = (tmp_path / "worker" / "client-secret-key").read_text()
    assert main([str(tmp_path)]) == 1
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "worker" / "client-secret-key").read_text() == before
    assert main([str(tmp_path), "--force"]) == 0
    assert (tmp_path / "worker" / "client-secret-key").read_text() != before


def test_a_directory_without_the_roles_files_is_a_config_error(tmp_path):
    JobKeys.generate().write(tmp_path)
    with pytest.raises(ConfigError, match="holds no client-secret-key"):
        curve_keys_from_env("worker", {"KVSTORE_AUTH_DIR": str(tmp_path / "server")})


def test_a_variable_wins_over_its_file(tmp_path, keys):
    JobKeys.generate().write(tmp_path)
    env = {
        "KVSTORE_AUTH_DIR": str(tmp_path / "worker"),
        "KVSTORE_AUTH_SERVER_PUBLIC_KEY": keys.server_public,
    }
    assert curve_keys_from_env("worker", env).peer_key == keys.server_public


def test_k8s_secret_is_yaml_with_the_four_keys(keys):
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(keys.k8s_secret("pskv-job-keys"))
    assert doc["kind"] == "Secret" and doc["metadata"]["name"] == "pskv-job-keys"
    assert doc["stringData"] == {
        "server-secret-key": keys.server_secret,
        "server-public-key": keys.server_public,
        "client-secret-key": keys.client_secret,
        "client-public-key": keys.client_public,
    }


def test_launcher_switch():
    assert launcher_auth_from_env({}) is True
    assert launcher_auth_from_env({"KVSTORE_AUTH": "0"}) is False
    with pytest.raises(ConfigError, match="KVSTORE_AUTH"):
        launcher_auth_from_env({"KVSTORE_AUTH": "maybe"})


def test_ssh_puts_no_secret_on_the_command_line(keys, monkeypatch):
    # an inherited secret (the user's own shell) must not leak onto the command line either
    monkeypatch.setenv("KVSTORE_AUTH_SERVER_SECRET_KEY", "inherited-" + "x" * 30)
    backend = SSHBackend(["h1"], num_servers=1)
    command = backend.child("worker", 0, ["python", "train.py"], role_env("worker", keys))
    line = " ".join(command.argv)
    for secret in (keys.client_secret, keys.server_secret, "inherited-"):
        assert secret not in line
    assert keys.server_public in line  # public keys may be seen
    assert command.stdin is not None
    lines = command.stdin.decode().split("\n")
    assert lines[-2:] == ["", ""]  # an empty line ends them
    sent = dict(line.split("=", 1) for line in lines[:-2])
    assert sent == {"KVSTORE_AUTH_CLIENT_SECRET_KEY": keys.client_secret}
    assert set(sent) <= SECRET_VARS
    plain = backend.child("worker", 0, ["python", "train.py"], role_env("worker", None))
    assert plain.stdin is None  # nothing to hide: the command line is as it always was


def test_zap_handler_admits_only_the_jobs_client_key(keys):
    from zmq.utils import z85

    handler = ZapHandler(context=None, client_key=keys.client_public)  # type: ignore[arg-type]

    def request(mechanism: bytes, *credentials: bytes) -> list[bytes]:
        return [b"1.0", b"7", b"", b"10.0.0.9", b"", mechanism, *credentials]

    job = z85.decode(keys.client_public.encode())
    stranger = z85.decode(JobKeys.generate().client_public.encode())
    assert handler.answer(request(b"CURVE", job))[:3] == [b"1.0", b"7", b"200"]
    assert handler.answer(request(b"CURVE", stranger))[2] == b"400"
    assert handler.answer(request(b"NULL"))[2] == b"400"
    assert handler.answer(request(b"PLAIN", b"user", b"password"))[2] == b"400"
    assert handler.answer([b"1.0", b"8"])[:3] == [b"1.0", b"8", b"400"]  # malformed: refused
    assert handler.answer([b"2.0", *request(b"CURVE", job)[1:]])[2] == b"400"
    assert handler.refused == 5
