"""Every misuse listed in docs/design.md ("Client API and semantics") raises a clear exception:
never a hang, never a dead server."""

from __future__ import annotations

import kvtest
import numpy as np
import pytest
from kvtest import run_ranks, run_ranks_outcomes

import kvstore
from kvstore import (
    CodecError,
    ConfigError,
    DuplicateInitError,
    KeyNotInitializedError,
    OptimizerError,
    UsageError,
    ValueMismatchError,
)

pytestmark = pytest.mark.integration


def connect(addresses, rank=0, num_workers=1, mode="dist_sync", **kwargs):
    kwargs.setdefault("timeout", 20)
    return kvtest.connect(addresses, rank, num_workers, mode, **kwargs)


@pytest.fixture
def kv(one_server):
    with connect([one_server]) as store:
        yield store


def test_push_or_pull_of_a_key_never_initialised(kv):
    out = np.zeros(3, np.float32)
    with pytest.raises(KeyNotInitializedError, match=r"key 'nope' is not initialised.*kv.init"):
        kv.push("nope", out)
    with pytest.raises(KeyNotInitializedError, match="key 5 is not initialised"):
        kv.pull(5, out=out)
    with pytest.raises(KeyError):  # also a KeyError, for except KeyError users
        kv.pushpull(5, out)


def test_duplicate_init(kv):
    kv.init("w", np.zeros(3, np.float32))
    with pytest.raises(DuplicateInitError, match="key 'w' is already initialised"):
        kv.init("w", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="appears twice"):
        kv.init(["a", "a"], [np.zeros(1, np.float32)] * 2)


def test_shape_or_dtype_different_from_init(kv):
    kv.init("w", np.zeros((2, 3), np.float32))
    for bad in (np.zeros(6, np.float32), np.zeros((3, 2), np.float32), np.zeros((2, 3))):
        with pytest.raises(ValueMismatchError, match=r"key 'w' \(shape \(2, 3\), float32\)"):
            kv.push("w", bad)
        with pytest.raises(ValueMismatchError, match="`out`"):
            kv.pull("w", out=bad)
        with pytest.raises(ValueMismatchError):
            kv.pushpull("w", bad)


def test_compression_set_after_init(kv):
    kv.init("w", np.zeros(3, np.float32))
    with pytest.raises(UsageError, match="before init.*'w'"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})


def test_unknown_codec_or_optimizer_and_bad_hyperparameters(kv):
    with pytest.raises(
        CodecError,
        match=r"unknown codec '1bitt' \(did you mean '1bit'\?\); registered codecs: 1bit, 2bit",
    ):
        kv.set_gradient_compression({"type": "1bitt"})
    with pytest.raises(CodecError, match="threshold must be a finite number > 0"):
        kv.set_gradient_compression({"type": "2bit", "threshold": -1})
    with pytest.raises(OptimizerError, match="unknown optimizer 'adagrad'"):
        kv.set_optimizer("adagrad")
    with pytest.raises(OptimizerError, match="momentum must be in"):
        kv.set_optimizer("sgd", momentum=1.5)
    with pytest.raises(OptimizerError, match="no hyperparameter"):
        kv.set_optimizer("sgd", learningrate=0.1)


def test_compression_needs_float32_keys(kv):
    kv.set_gradient_compression({"type": "2bit"})
    with pytest.raises(CodecError, match="key 'h' is float16"):
        kv.init("h", np.zeros(4, np.float16))


def test_bad_values_and_arguments(kv):
    kv.init("w", np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="numpy array, torch tensor or CuPy array.*list"):
        kv.push("w", [1.0, 2.0])
    with pytest.raises(TypeError, match="dtype bool"):
        kv.init("b", np.zeros(2, bool))
    with pytest.raises(TypeError, match="pull needs `out`"):
        kv.pull("w")
    with pytest.raises(TypeError, match="int or str for `key`, got float"):
        kv.push(1.5, np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="needs a list of 2 values"):
        kv.push(["w", "x"], np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        kv.push(["w", "x"], [np.zeros(2, np.float32)])
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(2, np.float32)
        ro.flags.writeable = False
        kv.pull("w", out=ro)


def test_async_push_without_optimizer_fails_on_the_worker(servers_factory):
    (address,) = servers_factory(1, 1)
    with connect([address], mode="dist_async") as kv:
        kv.init("w", np.zeros(2, np.float32))
        with pytest.raises(UsageError, match="dist_async.*needs an optimizer"):
            kv.push("w", np.ones(2, np.float32))
        kv.set_optimizer("sgd", learning_rate=1.0)
        kv.push("w", np.ones(2, np.float32))
        out = np.empty(2, np.float32)
        kv.pull("w", out=out)
        assert out.tolist() == [-1, -1]


def test_mixed_modes_across_workers(servers_factory):
    addresses = servers_factory(2, 2)
    with connect(addresses, 0, 2, mode="dist_sync"):
        with pytest.raises(ConfigError, match="rank 1 created a 'dist_async' store.*same mode"):
            connect(addresses, 1, 2, mode="dist_async")


def test_workers_that_disagree_on_init_or_optimizer(servers_factory):
    import threading

    addresses = servers_factory(1, 2)
    # Both workers are in the job before either calls, and rank 0 stays until rank 1's init
    # was answered: a server whose last worker left forgets the job, so a rank 1 that came
    # late (a loaded machine) would join a new one and wait for a rank 0 that never inits.
    connected = threading.Barrier(2, timeout=60)  # the timeouts are hang guards
    rank1_answered = threading.Event()

    def init(rank):
        with connect(addresses, rank, 2) as kv:
            connected.wait()
            try:
                kv.init("w", np.zeros(4 if rank == 0 else 5, np.float32))
            finally:
                if rank == 1:
                    rank1_answered.set()
            if rank == 0:
                assert rank1_answered.wait(timeout=60)

    outcomes = run_ranks_outcomes(2, init)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], ValueMismatchError)
    assert "rank 1 declared shape (5,)" in str(outcomes[1])
    assert "rank 0 declared shape (4,)" in str(outcomes[1])

    connected.reset()

    def optimizer(rank):
        # The first to call waits for the other's arguments (until its timeout); the second
        # gets the error at once.
        with connect(addresses, rank, 2, timeout=3) as kv:
            connected.wait()
            kv.set_optimizer("sgd", learning_rate=0.1 * (rank + 1))

    outcomes = run_ranks_outcomes(2, optimizer)
    errors = [o for o in outcomes if isinstance(o, OptimizerError)]
    assert errors and "same arguments" in str(errors[0]), outcomes


def test_cluster_misconfiguration(servers_factory):
    a, b = servers_factory(2, 1)
    with pytest.raises(ConfigError, match="rank order"):
        connect([b, a])
    with pytest.raises(ConfigError, match="serves 1 worker"):
        connect([a, b], 0, 2)
    with pytest.raises(ConfigError, match="--num-servers 2"):
        connect([a])
    with connect([a, b], 0, 1):
        with pytest.raises(ConfigError, match="rank 0 is already connected"):
            connect([a, b], 0, 1)


def test_create_arguments(monkeypatch):
    with pytest.raises(ValueError, match="unknown kvstore type 'dist_turbo'.*dist_sync"):
        kvstore.create("dist_turbo")
    with pytest.raises(TypeError):
        kvstore.create(3)
    with pytest.raises(ConfigError, match="rank 0"):
        kvstore.create("local", rank=1)
    for var in ("KVSTORE_SERVERS", "KVSTORE_RANK", "KVSTORE_NUM_WORKERS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="KVSTORE_SERVERS is not set.*kvstore-launch"):
        kvstore.create("dist_sync")


def test_no_server_at_the_address_fails_instead_of_hanging():
    with pytest.raises(
        kvstore.ConnectionLostError, match=r"did not answer within 1 s.*kvstore-launch"
    ):
        kvstore.create(
            "dist_sync", servers=["tcp://127.0.0.1:1"], rank=0, num_workers=1, connect_timeout=1
        )


def test_a_worker_that_never_pushes_gives_a_timeout_not_a_hang(servers_factory):
    import threading

    addresses = servers_factory(1, 2)
    # Both workers are in the job before either calls: a rank 1 that came after rank 0 gave
    # up and left (a loaded machine) would join a new job and wait for rank 0's init.
    connected = threading.Barrier(2, timeout=60)  # a hang guard

    def worker(rank):
        # Only rank 0's calls are to time out; rank 1's init waits for rank 0's, which may take
        # a while on a loaded machine, so it waits as long as any other test's.
        kv = connect(addresses, rank, 2, timeout=1.5) if rank == 0 else connect(addresses, rank, 2)
        connected.wait()
        kv.init("w", np.zeros(2, np.float32))
        if rank == 1:
            kv.close()  # leaves without pushing: rank 0's round can never complete
            return
        kv.push("w", np.ones(2, np.float32))
        with pytest.raises(kvstore.KVStoreTimeoutError, match="no reply within.*KVSTORE_TIMEOUT"):
            kv.pull("w", out=np.empty(2, np.float32))
        with pytest.raises(kvstore.KVStoreTimeoutError, match="an earlier push of key 'w'"):
            kv.close()  # reports the push that never completed, then closes anyway
        with pytest.raises(UsageError):
            kv.push("w", np.ones(2, np.float32))

    run_ranks(2, worker)


def test_a_dead_server_fails_requests_instead_of_hanging():
    import signal

    import kvtest

    servers = kvtest.start_servers(1, 1)
    try:
        # Waiting would end in KVStoreTimeoutError after this long; the lost connection must
        # be reported as such instead (what is raised is the test, not how soon).
        kv = connect([servers[0].address], timeout=60)
        kv.init("w", np.zeros(2, np.float32))
        servers[0].process.send_signal(signal.SIGKILL)
        servers[0].process.wait()
        with pytest.raises(kvstore.ConnectionLostError, match="server 0 .* closed the connection"):
            kv.pull("w", out=np.empty(2, np.float32))
        with pytest.raises(kvstore.ConnectionLostError):
            kv.push("w", np.ones(2, np.float32))
        kv.close()
    finally:
        kvtest.stop_processes([s.process for s in servers])
