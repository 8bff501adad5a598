"""Every optional speed-up turned off by its variable changes no result (docs/internals.md).

The multi-process scenarios of ``test_multiprocess`` (2-bit rounds pulled as relayed pushes,
server-side SGD pulled dense, pushes followed by pulls so that values are prefetched), run by
``kvstore-launch`` with every speed-up's switch at 0 in the servers' and the workers'
environment, and checked against the same references as with all of them on.
"""

from __future__ import annotations

import os

import pytest
from test_multiprocess import check_sgd, check_twobit, launch

from kvstore.envvars import ENV_VARS

pytestmark = pytest.mark.integration

SWITCHES = (
    "KVSTORE_VALUE_PREFETCH",
    "KVSTORE_PULL_RELAY",
    "KVSTORE_ACKS_ON_PULLS",
    "KVSTORE_INLINE_WORK",
    "KVSTORE_NATIVE_SENDS",
    "KVSTORE_MALLOC_TUNING",
    "KVSTORE_PUSH_LEAD",
    "KVSTORE_PUSH_TOS",
)


def test_every_switch_is_a_declared_variable():
    declared = {var.name for var in ENV_VARS}
    assert set(SWITCHES) <= declared


@pytest.mark.slow
@pytest.mark.parametrize("name, check", [("twobit", check_twobit), ("sgd", check_sgd)])
def test_a_job_without_its_speedups_pulls_the_same_values(tmp_path, name, check):
    env = {**os.environ, **dict.fromkeys(SWITCHES, "0")}
    check(launch(name, tmp_path, n=2, s=2, env=env))
