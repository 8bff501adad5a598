"""kvstore.torch's environment: torchrun's RANK and WORLD_SIZE stand in for KVSTORE_RANK and
KVSTORE_NUM_WORKERS, and the package without torch installed.

(tests/integration/test_torch_ddp.py runs a real job under torchrun.)
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from kvtest import REPO

from kvstore.api import _cluster
from kvstore.config import ClusterConfig
from kvstore.envvars import ENV_VARS, TORCHRUN_ENV_VARS, TORCHRUN_FALLBACKS
from kvstore.errors import ConfigError

SERVERS = {"KVSTORE_SERVERS": "tcp://10.0.0.1:9100"}


def test_torchrun_variables_give_the_rank_and_the_job_size():
    cluster = ClusterConfig.from_env({**SERVERS, "RANK": "1", "WORLD_SIZE": "3"})
    assert (cluster.rank, cluster.num_workers) == (1, 3)


def test_the_kvstore_variables_win_one_by_one():
    env = {**SERVERS, "RANK": "1", "WORLD_SIZE": "3", "KVSTORE_RANK": "0"}
    assert (ClusterConfig.from_env(env).rank, ClusterConfig.from_env(env).num_workers) == (0, 3)
    env = {**env, "KVSTORE_NUM_WORKERS": "2"}
    assert ClusterConfig.from_env(env).num_workers == 2
    env = {**SERVERS, "RANK": "0", "WORLD_SIZE": "8", "KVSTORE_NUM_WORKERS": "2"}
    assert ClusterConfig.from_env(env).num_workers == 2


def test_create_arguments_still_win(monkeypatch):
    env = {**SERVERS, "RANK": "5", "WORLD_SIZE": "6"}
    assert _cluster(env, None, None, None).rank == 5
    cluster = _cluster(env, None, 1, None)
    assert (cluster.rank, cluster.num_workers) == (1, 6)
    assert _cluster(env, None, 0, 1).num_workers == 1


@pytest.mark.parametrize(
    "env, match",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is out of range for WORLD_SIZE=2"),
        ({"KVSTORE_RANK": "2", "WORLD_SIZE": "2"}, "KVSTORE_RANK=2 is out of range for WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be >= 1"),
        ({"WORLD_SIZE": "2"}, "KVSTORE_RANK is not set (nor torchrun's RANK)"),
        ({"RANK": "0"}, "KVSTORE_NUM_WORKERS is not set (nor torchrun's WORLD_SIZE)"),
    ],
)
def test_errors_name_the_variable_that_was_read(env, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        ClusterConfig.from_env({**SERVERS, **env})


def test_the_torchrun_variables_are_declared_and_documented():
    assert set(TORCHRUN_FALLBACKS.values()) == {v.name for v in TORCHRUN_ENV_VARS}
    assert set(TORCHRUN_FALLBACKS) <= {v.name for v in ENV_VARS}
    operations = (REPO / "docs" / "operations.md").read_text()
    table = operations[operations.index("| variable") :]
    guide = (REPO / "docs" / "torch.md").read_text()
    for var in TORCHRUN_ENV_VARS:
        assert f"| `{var.name}` |" in table, f"operations.md lacks {var.name}"
        assert var.meaning in table, f"operations.md's entry for {var.name} is stale"
        assert f"`{var.name}`" in guide, f"docs/torch.md lacks {var.name}"


def test_without_torch_kvstore_imports_and_kvstore_torch_says_what_to_install():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvstore\n"
        "try:\n"
        "    import kvstore.torch\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "kvstore.torch needs PyTorch" in result.stdout
    assert "pip install 'pskv[torch]'" in result.stdout
