"""Configuration from the environment: clear errors naming the variable."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvstore import config
from kvstore.config import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_PUSH_TOS,
    ClusterConfig,
    MetricsConfig,
    ServerConfig,
    WorkerOptions,
    cpu_kernels_from_env,
    default_push_lead,
    default_push_tos,
    default_server_threads,
    metrics_config_from_env,
)
from kvstore.envvars import ENV_VARS
from kvstore.errors import ConfigError

GOOD = {
    "KVSTORE_SERVERS": "tcp://10.0.0.1:9100,tcp://10.0.0.2:9100",
    "KVSTORE_RANK": "1",
    "KVSTORE_NUM_WORKERS": "2",
}


def test_cluster_from_env():
    cluster = ClusterConfig.from_env(GOOD)
    assert cluster.servers == ("tcp://10.0.0.1:9100", "tcp://10.0.0.2:9100")
    assert (cluster.rank, cluster.num_workers, cluster.num_servers) == (1, 2, 2)


@pytest.mark.parametrize("missing", sorted(GOOD))
def test_missing_variable_names_it_and_points_at_the_launcher(missing):
    env = {k: v for k, v in GOOD.items() if k != missing}
    with pytest.raises(ConfigError, match=rf"{missing} is not set.*kvstore-launch"):
        ClusterConfig.from_env(env)


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("KVSTORE_RANK", "one", "KVSTORE_RANK='one' is not an integer"),
        ("KVSTORE_RANK", "-1", "must be >= 0"),
        ("KVSTORE_RANK", "2", "KVSTORE_RANK=2 is out of range"),
        ("KVSTORE_NUM_WORKERS", "0", "KVSTORE_NUM_WORKERS='0' must be >= 1"),
        ("KVSTORE_SERVERS", "10.0.0.1:9100", "not an address of the form tcp://HOST:PORT"),
        ("KVSTORE_SERVERS", "tcp://a:1,,tcp://b:2", "empty entry"),
        ("KVSTORE_SERVERS", "tcp://a:1,tcp://a:1", "same server twice"),
        ("KVSTORE_SERVERS", "tcp://a:99999", "out of range"),
    ],
)
def test_malformed_variables(name, value, match):
    with pytest.raises(ConfigError, match=re.escape(match) if "*" not in match else match):
        ClusterConfig.from_env({**GOOD, name: value})


def test_worker_options_defaults_env_and_overrides():
    assert WorkerOptions.from_env({}) == WorkerOptions()
    opts = WorkerOptions.from_env(
        {
            "KVSTORE_BIGARRAY_BOUND": "64",
            "KVSTORE_TIMEOUT": "2.5",
            "KVSTORE_PARTITION_BYTES": "4096",
        }
    )
    assert (opts.bigarray_bound, opts.timeout, opts.partition_bytes) == (64, 2.5, 4096)
    assert WorkerOptions.from_env({"KVSTORE_TIMEOUT": "0"}).timeout is None
    assert WorkerOptions.from_env({"KVSTORE_TIMEOUT": "9"}, timeout=1.0).timeout == 1.0
    with pytest.raises(ConfigError, match="KVSTORE_BIGARRAY_BOUND='x' is not an integer"):
        WorkerOptions.from_env({"KVSTORE_BIGARRAY_BOUND": "x"})
    with pytest.raises(ConfigError, match="KVSTORE_TIMEOUT='-1'"):
        WorkerOptions.from_env({"KVSTORE_TIMEOUT": "-1"})
    with pytest.raises(ConfigError, match="KVSTORE_PARTITION_BYTES"):
        WorkerOptions.from_env({"KVSTORE_PARTITION_BYTES": "8"})


def test_pull_relay_and_push_lead_settings():
    assert WorkerOptions().pull_relay is True
    assert WorkerOptions.from_env({"KVSTORE_PULL_RELAY": "off"}).pull_relay is False
    assert WorkerOptions.from_env({"KVSTORE_PULL_RELAY": "0"}, pull_relay=True).pull_relay
    with pytest.raises(ConfigError, match="KVSTORE_PULL_RELAY='maybe' must be 0 or 1"):
        WorkerOptions.from_env({"KVSTORE_PULL_RELAY": "maybe"})
    assert WorkerOptions().push_lead is None  # the default depends on the job's size
    assert [default_push_lead(n) for n in (1, 2, 3, 8)] == [0, 0, 3, 3]
    assert WorkerOptions.from_env({"KVSTORE_PUSH_LEAD": "0"}).push_lead == 0
    with pytest.raises(ConfigError, match="KVSTORE_PUSH_LEAD"):
        WorkerOptions.from_env({"KVSTORE_PUSH_LEAD": "-1"})
    # for_job fills in only what was left to the job's size.
    assert (WorkerOptions().for_job(8).push_lead, WorkerOptions().for_job(8).push_tos) == (3, 0x10)
    assert (WorkerOptions().for_job(2).push_lead, WorkerOptions().for_job(2).push_tos) == (0, 0)
    chosen = WorkerOptions(push_lead=0, push_tos=0xB8, partition_bytes=1 << 20).for_job(8)
    assert (chosen.push_lead, chosen.push_tos, chosen.partition_bytes) == (0, 0xB8, 1 << 20)


def test_server_config_validation():
    with pytest.raises(ConfigError, match="--server-rank 2 is out of range"):
        ServerConfig(server_rank=2, num_servers=2)
    with pytest.raises(ConfigError, match="--num-workers"):
        ServerConfig(num_workers=0)
    with pytest.raises(ConfigError, match="--port"):
        ServerConfig(port=70000)
    assert ServerConfig.from_env({"KVSTORE_SERVER_THREADS": "3"}).threads == 3
    with pytest.raises(ConfigError, match="KVSTORE_SERVER_THREADS"):
        ServerConfig.from_env({"KVSTORE_SERVER_THREADS": "0"})
    assert cpu_kernels_from_env({}) == "numba"
    with pytest.raises(ConfigError, match="KVSTORE_CPU_KERNELS"):
        cpu_kernels_from_env({"KVSTORE_CPU_KERNELS": "gpu"})


def test_readme_documents_every_variable():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("| variable") :]
    for var in ENV_VARS:
        assert f"`{var.name}`" in table, f"README's table lacks {var.name}"


def test_send_queue_setting():
    assert WorkerOptions().send_queue_ms == 0  # opt-in
    assert WorkerOptions().for_job(2).send_queue_ms == 0
    assert WorkerOptions.from_env({"KVSTORE_SEND_QUEUE_MS": "12.5"}).send_queue_ms == 12.5
    with pytest.raises(ConfigError, match="KVSTORE_SEND_QUEUE_MS"):
        WorkerOptions.from_env({"KVSTORE_SEND_QUEUE_MS": "-1"})
    with pytest.raises(ConfigError, match="send_queue_ms"):
        WorkerOptions(send_queue_ms=-1)


def test_push_tos_setting():
    assert WorkerOptions().push_tos is None  # the default depends on the job's size
    assert [default_push_tos(n) for n in (1, 2, 3, 8)] == [0, 0, 0x10, 0x10]
    assert DEFAULT_PUSH_TOS == 0x10
    assert WorkerOptions.from_env({"KVSTORE_PUSH_TOS": "0"}).push_tos == 0
    assert WorkerOptions.from_env({"KVSTORE_PUSH_TOS": "0xb8"}).push_tos == 0xB8
    assert WorkerOptions.from_env({"KVSTORE_PUSH_TOS": "184"}).push_tos == 0xB8
    with pytest.raises(ValueError, match="KVSTORE_PUSH_TOS='256' must be <= 255"):
        WorkerOptions.from_env({"KVSTORE_PUSH_TOS": "256"})
    with pytest.raises(ValueError, match="KVSTORE_PUSH_TOS='low' is not an integer"):
        WorkerOptions.from_env({"KVSTORE_PUSH_TOS": "low"})
    with pytest.raises(ValueError, match="push_tos must be a TOS byte"):
        WorkerOptions(push_tos=-1)


def test_metrics_settings():
    assert metrics_config_from_env({}) is None  # no endpoint unless the port is set
    assert WorkerOptions.from_env({}).metrics is None
    assert metrics_config_from_env({"KVSTORE_METRICS_PORT": "9100"}) == MetricsConfig(
        port=9100, addr="127.0.0.1", every=10
    )
    assert metrics_config_from_env({"KVSTORE_METRICS_PORT": " 0 "}) == MetricsConfig(port=0)
    env = {
        "KVSTORE_METRICS_PORT": "9100",
        "KVSTORE_METRICS_ADDR": "0.0.0.0",
        "KVSTORE_METRICS_EVERY": "3",
    }
    assert WorkerOptions.from_env(env).metrics == MetricsConfig(9100, "0.0.0.0", 3)
    assert WorkerOptions.from_env(env).for_job(8).metrics == MetricsConfig(9100, "0.0.0.0", 3)
    for addr in ("::", "::1", "10.1.2.3", "localhost", "node-7.cluster.example"):
        config = metrics_config_from_env(
            {"KVSTORE_METRICS_PORT": "1", "KVSTORE_METRICS_ADDR": addr}
        )
        assert config is not None and config.addr == addr


@pytest.mark.parametrize(
    "name, raw, match",
    [
        ("KVSTORE_METRICS_PORT", "http", "KVSTORE_METRICS_PORT='http' is not an integer"),
        ("KVSTORE_METRICS_PORT", "-1", "KVSTORE_METRICS_PORT='-1' must be >= 0"),
        ("KVSTORE_METRICS_PORT", "65536", "KVSTORE_METRICS_PORT='65536' must be <= 65535"),
        ("KVSTORE_METRICS_ADDR", "tcp://0.0.0.0", "KVSTORE_METRICS_ADDR='tcp://0.0.0.0' is not"),
        ("KVSTORE_METRICS_ADDR", "127.0.0.1:9100", "KVSTORE_METRICS_ADDR='127.0.0.1:9100' is not"),
        ("KVSTORE_METRICS_ADDR", "a b", "KVSTORE_METRICS_ADDR='a b' is not a host name"),
        ("KVSTORE_METRICS_EVERY", "0", "KVSTORE_METRICS_EVERY='0' must be >= 1"),
        ("KVSTORE_METRICS_EVERY", "often", "KVSTORE_METRICS_EVERY='often' is not an integer"),
    ],
)
def test_malformed_metrics_settings_name_the_variable(name, raw, match):
    env = {"KVSTORE_METRICS_PORT": "9100", name: raw}
    with pytest.raises(ConfigError, match=re.escape(match)):
        metrics_config_from_env(env)
    with pytest.raises(ConfigError, match=re.escape(match)):
        WorkerOptions.from_env(env)  # what kvstore.create reads


def test_metrics_settings_are_checked_even_without_the_port():
    # A typo surfaces at once, not on the day the port is set.
    with pytest.raises(ConfigError, match="KVSTORE_METRICS_EVERY"):
        metrics_config_from_env({"KVSTORE_METRICS_EVERY": "0"})
    with pytest.raises(ConfigError, match="metrics every must be >= 1"):
        MetricsConfig(every=0)
    with pytest.raises(ConfigError, match="out of range"):
        MetricsConfig(port=70000)


def test_metrics_port_rule():
    from kvstore.metrics import endpoint_port  # noqa: PLC0415  (imports no prometheus_client)

    config = MetricsConfig(port=9100)
    # 2 servers, 3 workers: servers on P + I, workers on P + S + R.
    assert [endpoint_port(config, i, f"server {i}") for i in range(2)] == [9100, 9101]
    assert [endpoint_port(config, 2 + r, f"worker {r}") for r in range(3)] == [9102, 9103, 9104]
    assert endpoint_port(MetricsConfig(port=0), 5, "worker 3") == 0  # each picks a free port
    with pytest.raises(ConfigError, match=r"KVSTORE_METRICS_PORT=65535: worker 1 would .* 65537"):
        endpoint_port(MetricsConfig(port=65535), 2, "worker 1")


def test_metrics_without_prometheus_client_name_the_variable_and_the_extra(monkeypatch):
    import sys  # noqa: PLC0415

    from kvstore.metrics import ServerMetrics, WorkerMetrics  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if missing
    hint = re.escape(
        "KVSTORE_METRICS_PORT is set but prometheus_client is not installed: "
        'pip install "pskv[metrics]"'
    )
    with pytest.raises(ConfigError, match=hint):
        WorkerMetrics(MetricsConfig(), 0, 1)
    with pytest.raises(ConfigError, match=hint):
        ServerMetrics(MetricsConfig(), 0)


def test_every_declared_field_exists_in_the_config_that_reads_it():
    # The table names config classes and fields as text; a typo there would silently drop a
    # variable, so each one is checked against the real dataclass.
    for var in ENV_VARS:
        assert bool(var.field) == bool(var.read_by), var.name
        for name in var.read_by:
            fields = {f.name for f in dataclasses.fields(getattr(config, name))}
            assert var.field in fields, f"{var.name} fills {name}.{var.field}, which is not a field"
        if var.name != "KVSTORE_LOG_LEVEL":  # kvstore._logging reads it, warning on a bad level
            assert var.parse is not None, f"{var.name} has no parser"


def test_server_config_from_env_reads_what_kvstore_server_reads():
    defaults = ServerConfig.from_env({})
    assert defaults == ServerConfig(heartbeat_timeout=DEFAULT_HEARTBEAT_TIMEOUT)
    assert defaults.threads == default_server_threads() and defaults.max_message_bytes is None
    env = {
        "KVSTORE_SERVER_THREADS": "3",
        "KVSTORE_PARTITION_BYTES": "4096",
        "KVSTORE_MAX_MESSAGE_BYTES": "65536",
        "KVSTORE_HEARTBEAT_TIMEOUT": "0",
        "KVSTORE_METRICS_PORT": "9100",
    }
    read = ServerConfig.from_env(env, num_workers=2, threads=None, max_message_bytes=None)
    assert (read.threads, read.partition_bytes, read.max_message_bytes) == (3, 4096, 65536)
    assert (read.heartbeat_timeout, read.metrics, read.num_workers) == (0.0, MetricsConfig(9100), 2)
    assert ServerConfig.from_env(env, threads=1).threads == 1  # the command line wins
    with pytest.raises(ConfigError, match="KVSTORE_MAX_MESSAGE_BYTES='1024' must be >= 65536"):
        ServerConfig.from_env({"KVSTORE_MAX_MESSAGE_BYTES": "1024"})
