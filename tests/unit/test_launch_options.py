"""kvstore-launch's replication options: --replicas, --restart-servers and --max-restarts."""

from __future__ import annotations

import pytest

from kvstore.deploy import LocalBackend, Supervisor
from kvstore.deploy.__main__ import build_parser, check_replication
from kvstore.errors import ConfigError


def _check(*words: str, servers: int = 2) -> tuple[int, int]:
    parser = build_parser()
    args = parser.parse_args([*words, "-n", "1", "--", "true"])
    return check_replication(parser, args, servers)


@pytest.fixture(autouse=True)
def _no_replicas_in_the_environment(monkeypatch):
    monkeypatch.delenv("KVSTORE_REPLICAS", raising=False)


def test_defaults_and_accepted_values():
    assert _check() == (1, 3)
    assert _check("--replicas", "2") == (2, 3)
    assert _check("--replicas", "2", "--restart-servers") == (2, 3)
    assert _check("--replicas", "2", "--restart-servers", "--max-restarts", "0") == (2, 0)
    assert _check("--replicas", "3", "--restart-servers", servers=3) == (3, 3)


def test_replicas_default_to_the_environment(monkeypatch):
    monkeypatch.setenv("KVSTORE_REPLICAS", "2")
    assert _check("--restart-servers") == (2, 3)
    assert _check("--replicas", "1") == (1, 3)  # the option wins


@pytest.mark.parametrize(
    "words, message",
    [
        (("--replicas", "0"), "--replicas must be between 1 and -s 2, got 0"),
        (("--replicas", "3"), "--replicas must be between 1 and -s 2, got 3"),
        (("--restart-servers",), "--restart-servers needs --replicas >= 2 (got 1)"),
        (("--replicas", "1", "--restart-servers"), "--restart-servers needs --replicas >= 2"),
        (("--replicas", "2", "--max-restarts", "2"), "--max-restarts is for --restart-servers"),
        (
            ("--replicas", "2", "--restart-servers", "--max-restarts", "-1"),
            "--max-restarts must be >= 0, got -1",
        ),
    ],
)
def test_bad_values_are_usage_errors(capsys, words, message):
    with pytest.raises(SystemExit) as exit_:
        _check(*words)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_environment_value_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("KVSTORE_REPLICAS", "3")
    with pytest.raises(SystemExit):
        _check()
    assert "--replicas must be between 1 and -s 2, got 3" in capsys.readouterr().err
    monkeypatch.setenv("KVSTORE_REPLICAS", "two")
    with pytest.raises(SystemExit):
        _check()
    assert "KVSTORE_REPLICAS" in capsys.readouterr().err


def test_the_supervisor_refuses_them_too():
    with pytest.raises(ConfigError, match="replicas must be in 1..2"):
        Supervisor(LocalBackend(), 1, 2, ["true"], replicas=3, auth=False)
    with pytest.raises(ConfigError, match="restarting servers needs replicas >= 2"):
        Supervisor(LocalBackend(), 1, 2, ["true"], restart_servers=True, auth=False)
