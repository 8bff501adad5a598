"""The slurm launcher's pieces: host lists, the allocation, and the srun command lines."""

from __future__ import annotations

import os
import sys

import pytest

from kvstore.deploy.backends import SlurmBackend
from kvstore.deploy.slurm_env import allocation_from_env, expand_hostlist, expand_nodelist
from kvstore.errors import ConfigError


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no leading zero: no padding
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # the width of the lower end
        ("a[1-2]b,c[3]", ["a1b", "a2b", "c3"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        (" x-1.cluster , y ", ["x-1.cluster", "y"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "a,,b", "n[1-", "n]1", "n[[1]]", "n[]", "n[3-1]", "n[a]"])
def test_bad_hostlists_are_config_errors(text):
    with pytest.raises(ConfigError, match="host list"):
        expand_hostlist(text)


def _script(path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def test_expand_nodelist_prefers_scontrol_and_falls_back(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    _script(good / "scontrol", 'test "$1 $2" = "show hostnames" && printf "s1\\ns2\\n"')
    _script(bad / "scontrol", "exit 1")
    assert expand_nodelist("n[1-2]", path=str(good)) == ["s1", "s2"]
    assert expand_nodelist("n[1-2]", path=str(bad)) == ["n1", "n2"]
    assert expand_nodelist("n[1-2]", path=str(tmp_path)) == ["n1", "n2"]  # no scontrol


def test_the_allocation_comes_from_slurms_variables(tmp_path):
    _script(tmp_path / "srun", "exit 0")
    env = {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "77", "PATH": str(tmp_path)}
    allocation = allocation_from_env(env)
    assert allocation.nodes == ("node1", "node2")
    assert allocation.job_id == "77"
    assert allocation.srun == str(tmp_path / "srun")


def test_outside_an_allocation_or_without_srun_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="inside a Slurm allocation.*SLURM_JOB_NODELIST"):
        allocation_from_env({"PATH": str(tmp_path)})
    with pytest.raises(ConfigError, match="needs srun, which is not on PATH"):
        allocation_from_env({"SLURM_JOB_NODELIST": "n1", "PATH": str(tmp_path)})


def test_placement_and_srun_command_lines():
    backend = SlurmBackend(["n1", "n2", "n3"], num_servers=2, srun="/opt/slurm/bin/srun")
    # servers first, then workers, cycling through the nodes (as the ssh launcher does)
    assert [backend.node("server", r) for r in range(2)] == ["n1", "n2"]
    assert [backend.node("worker", r) for r in range(4)] == ["n3", "n1", "n2", "n3"]
    argv = ["python3", "train.py", "--name", "a b"]
    command = backend.child("worker", 1, argv, {"KVSTORE_RANK": "1"})
    assert command.argv == [
        "/opt/slurm/bin/srun",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=n1",
        "--overlap",
        f"--chdir={os.getcwd()}",
        "--export=ALL",
        "--job-name=kvstore-worker-1",
        *argv,  # no shell in between: the words arrive as they are
    ]
    assert command.env["KVSTORE_RANK"] == "1"  # srun exports the environment to the process
    assert command.env["PATH"] == os.environ["PATH"]


def test_workers_per_node_keep_consecutive_ranks_on_one_node():
    backend = SlurmBackend(["n1", "n2", "n3"], num_servers=1, workers_per_host=2)
    assert [backend.node("worker", r) for r in range(6)] == ["n2", "n2", "n3", "n3", "n1", "n1"]


def test_servers_bind_every_interface_and_workers_use_node_names():
    backend = SlurmBackend(["n1", "n2"], num_servers=2)
    assert backend.server_host(1) == "0.0.0.0"
    assert backend.server_python() == sys.executable
    assert backend.server_address(1, "tcp://n2.cluster.example:4711") == "tcp://n2:4711"
    pinned = SlurmBackend(["n1"], num_servers=1, bind="10.0.0.5", python="python3")
    assert pinned.server_host(0) == "10.0.0.5" and pinned.server_python() == "python3"


def test_no_nodes_is_an_error():
    with pytest.raises(ConfigError):
        SlurmBackend([], num_servers=1)
