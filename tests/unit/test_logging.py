"""KVSTORE_LOG_LEVEL and one log format for servers, workers and the launcher."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
from kvtest import launch

from kvstore import _logging

PY = sys.executable

# time, level, [role], logger: message -- behind the launcher's [server I] / [worker R] prefix
LINE = re.compile(
    r"^(?:\[(?P<source>server \d+|worker \d+)\] )?"
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"\[(?P<role>launch|server \d+|worker \d+)\] (?P<logger>kvstore(?:\.\w+)*): (?P<message>.+)$"
)


def _env(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_LOG_LEVEL"}
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_worker(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A worker in the ``local`` mode (no launcher needed): ``code`` runs after kvstore.create."""
    prelude = "import logging, kvstore\nkv = kvstore.create('local')\n"
    epilogue = "\nkv.close()\n"
    return subprocess.run(
        [PY, "-c", prelude + code + epilogue],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


WORKER = (
    "import logging, kvstore\n"
    "kv = kvstore.create('dist_sync')\n"
    "log = logging.getLogger('kvstore.something')\n"
    "log.debug('debug from the worker'); log.info('info from the worker')\n"
    "kv.barrier(); kv.close()\n"
)


@pytest.mark.integration
def test_server_worker_and_launcher_lines_have_one_format():
    env = _env(KVSTORE_LOG_LEVEL="INFO")
    result = launch("-n", "2", "-s", "1", "--", PY, "-c", WORKER, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    bad = [line for line in lines if not LINE.match(line)]
    assert not bad, f"lines not in the format: {bad}"
    matches = [LINE.match(line) for line in lines]
    roles = {m["role"] for m in matches}
    assert {"launch", "server 0", "worker 0", "worker 1"} <= roles, roles
    for m in matches:  # a forwarded line's own role is the child the launcher says it is from
        assert m["source"] is None if m["role"] == "launch" else m["source"] == m["role"]
    assert {(m["role"], m["message"]) for m in matches if m["logger"] == "kvstore.something"} == {
        ("worker 0", "info from the worker"),
        ("worker 1", "info from the worker"),
    }  # INFO shows, DEBUG does not
    launcher = [m for m in matches if m["role"] == "launch"]
    assert any(m["message"].startswith("starting 1 server(s) and 2 worker(s)") for m in launcher)


@pytest.mark.integration
def test_the_launchers_own_messages_follow_the_format():
    code = "import sys; sys.exit(3)"
    result = launch("-n", "1", "-s", "1", "--", PY, "-c", code, env=_env())
    assert result.returncode == 3
    ours = [LINE.match(line) for line in result.stderr.splitlines() if "[launch]" in line]
    assert ours and all(ours), result.stderr
    failure = [m for m in ours if "worker 0 exited with code 3" in m["message"]]
    assert failure and failure[0]["level"] == "ERROR"
    assert failure[0]["logger"] == "kvstore.deploy.supervisor"
    # INFO by default: the launcher says what it starts
    assert any(m["level"] == "INFO" for m in ours)


@pytest.mark.integration
def test_the_launchers_level_hides_its_info_lines():
    code = "import sys; sys.exit(3)"
    result = launch("-n", "1", "-s", "1", "--", PY, "-c", code, env=_env(KVSTORE_LOG_LEVEL="ERROR"))
    assert result.returncode == 3
    ours = [line for line in result.stderr.splitlines() if "[launch]" in line]
    assert len(ours) == 1 and " ERROR [launch] " in ours[0], result.stderr


def test_a_worker_honours_the_level():
    code = "log = logging.getLogger('kvstore.t')\nlog.debug('D-line'); log.info('I-line')"
    debug = run_worker(code, _env(KVSTORE_LOG_LEVEL="DEBUG"))
    assert debug.returncode == 0, debug.stderr
    assert re.search(r" DEBUG \[worker 0\] kvstore\.t: D-line$", debug.stderr, re.M)
    assert re.search(r" INFO \[worker 0\] kvstore\.t: I-line$", debug.stderr, re.M)

    default = run_worker(code + "\nlog.warning('W-line')", _env())
    assert default.returncode == 0, default.stderr
    assert "D-line" not in default.stderr and "I-line" not in default.stderr
    assert LINE.match(default.stderr.strip())  # the warning, in the format
    assert default.stderr.strip().endswith("WARNING [worker 0] kvstore.t: W-line")


def test_an_unknown_level_is_reported_and_the_default_used():
    code = "log = logging.getLogger('kvstore.t')\nlog.info('I-line'); log.warning('W-line')"
    result = run_worker(code, _env(KVSTORE_LOG_LEVEL="LOUD"))
    assert result.returncode == 0, result.stderr
    assert "KVSTORE_LOG_LEVEL='LOUD' is not a log level; levels: DEBUG, " in result.stderr
    assert "; using WARNING" in result.stderr
    assert "I-line" not in result.stderr and "W-line" in result.stderr
    result = run_worker(code, _env(KVSTORE_LOG_LEVEL="warnig"))
    assert "KVSTORE_LOG_LEVEL='WARNIG' is not a log level (did you mean 'WARNING'?)" in (
        result.stderr
    )


APP_LOGGING = (
    "logging.basicConfig(format='APP %(levelname)s %(name)s %(message)s', level='DEBUG')\n"
)


def test_a_worker_keeps_the_applications_logging():
    code = "log = logging.getLogger('kvstore.t')\nlog.info('I-line'); log.warning('W-line')"
    app_first = APP_LOGGING + "kv0 = kvstore.create('local'); kv0.close()\n" + code
    result = run_worker(app_first, _env())
    assert result.returncode == 0, result.stderr
    # through the application's handler, at WARNING: the app's DEBUG is not kvstore's
    ours = [line for line in result.stderr.splitlines() if "kvstore" in line]
    assert ours == ["APP WARNING kvstore.t W-line"]


def test_the_application_may_set_the_kvstore_level():
    code = (
        APP_LOGGING + "logging.getLogger('kvstore').setLevel(logging.INFO)\n"
        "kv0 = kvstore.create('local'); kv0.close()\n"
        "logging.getLogger('kvstore.t').info('I-line')"
    )
    result = run_worker(code, _env())
    assert result.returncode == 0, result.stderr
    assert "APP INFO kvstore.t I-line" in result.stderr


def test_kvstore_log_level_takes_the_kvstore_records_even_from_a_configured_application():
    code = (
        APP_LOGGING + "kv0 = kvstore.create('local'); kv0.close()\n"
        "logging.getLogger('kvstore.t').info('I-line'); logging.getLogger('app').info('A-line')"
    )
    result = run_worker(code, _env(KVSTORE_LOG_LEVEL="INFO"))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "APP INFO app A-line" in lines  # the application's own records stay its own
    kvstore_lines = [line for line in lines if "I-line" in line]
    assert len(kvstore_lines) == 1 and LINE.match(kvstore_lines[0])  # once, in kvstore's format


@pytest.fixture
def kvstore_logger():
    """The ``kvstore`` logger, restored after the test (the rest of the session shares it)."""
    logger = logging.getLogger("kvstore")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def test_configure_worker_is_repeatable_and_keeps_foreign_handlers(kvstore_logger, monkeypatch):
    monkeypatch.setenv("KVSTORE_LOG_LEVEL", "info")
    foreign = logging.NullHandler()
    kvstore_logger.handlers[:] = [foreign]
    _logging.configure_worker("worker 3")
    _logging.configure_worker("worker 3")
    ours = [h for h in kvstore_logger.handlers if h is not foreign]
    assert foreign in kvstore_logger.handlers and len(ours) == 1
    assert ours[0].formatter._fmt == _logging.FORMAT.format(role="worker 3")
    assert kvstore_logger.level == logging.INFO and not kvstore_logger.propagate

    # the application configures logging later, and the variable is gone: records propagate
    monkeypatch.delenv("KVSTORE_LOG_LEVEL")
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    _logging.configure_worker("worker 3")
    assert kvstore_logger.handlers == [foreign] and kvstore_logger.propagate


def test_entry_points_replace_every_handler(kvstore_logger, monkeypatch):
    monkeypatch.delenv("KVSTORE_LOG_LEVEL", raising=False)
    kvstore_logger.handlers[:] = [logging.NullHandler()]
    _logging.configure("server 1", default_level="INFO")
    (handler,) = kvstore_logger.handlers
    assert handler.formatter._fmt == _logging.FORMAT.format(role="server 1")
    assert kvstore_logger.level == logging.INFO
