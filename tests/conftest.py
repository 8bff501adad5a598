"""Shared fixtures. The first thing this does is check that kvstore is installed."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import kvtest  # noqa: E402

try:
    kvtest.require_installed()
except RuntimeError as exc:  # fail loudly, before any test is collected
    pytest.exit(str(exc), returncode=4)


@pytest.fixture
def servers_factory():
    """Start server processes for a test; every one is stopped by pid at teardown."""
    started: list[kvtest.ServerProcess] = []

    def start(num_servers: int = 1, num_workers: int = 1, **kwargs):
        servers = kvtest.start_servers(num_servers, num_workers, **kwargs)
        started.extend(servers)
        return [s.address for s in servers]

    yield start
    kvtest.stop_processes([s.process for s in started])


@pytest.fixture(scope="module")
def one_server():
    """One server for one worker, shared by a module's tests (it resets when the worker leaves)."""
    servers = kvtest.start_servers(1, 1)
    yield servers[0].address
    kvtest.stop_processes([s.process for s in servers])


@pytest.fixture
def client(one_server):
    """A raw wire client of ``one_server`` (no kvstore client logic); says BYE at teardown."""
    c = kvtest.RawClient(one_server)
    yield c
    try:
        c.send("BYE")
        c.receive(timeout=2)
    except Exception:  # the test may have left the connection unusable
        pass
    c.close()


@pytest.fixture(scope="module")
def two_servers_two_workers():
    servers = kvtest.start_servers(2, 2)
    yield [s.address for s in servers]
    kvtest.stop_processes([s.process for s in servers])
