"""Hierarchical aggregation (docs/design.md, "Hierarchical aggregation"): jobs whose hosts run
several workers give the flat job's values, push one host's worth of bytes per host, keep a
2-bit residual per host share, and report a dead local worker instead of hanging.

Workers run on threads of the test (a host's workers find each other by the job's server
addresses and their host's index), except the one that dies, which is a process of its own.
Values are integers, so that every order of summation gives the same bits.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest
from kvtest import (
    connect,
    oracle_decode,
    oracle_encode,
    run_ranks,
    run_ranks_outcomes,
    start_servers,
    stop_processes,
)

from kvstore import WorkerLostError

pytestmark = pytest.mark.integration

SHAPES = {"small": (5,), "matrix": (300, 7), "split": (5000,)}
"""A key on one server in one chunk, one in several chunks, and one split over the servers."""
OPTIONS = {"bigarray_bound": 4000, "partition_bytes": 4096}
"""Small bounds, so that small keys take several chunks and a split."""
GUARD = 30.0
"""Hang guard: a dead local worker must be reported well within this (expected: under 1 s)."""


def _push(rank: int, step: int, shape: tuple[int, ...]) -> np.ndarray:
    """Rank ``rank``'s integer-valued push of step ``step``."""
    values = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) % 7
    return values * (rank + 1) - step


def _train(
    num_workers: int,
    local_size: int,
    *,
    mode: str = "dist_sync",
    steps: int = 3,
    optimizer: dict[str, Any] | None = None,
    hierarchy: bool | None = None,
) -> tuple[list[list[dict[str, np.ndarray]]], list[int]]:
    """Every rank's pulled values after each step, and the bytes each rank pushed."""
    servers = start_servers(2, num_workers)
    try:
        addresses = [s.address for s in servers]

        def worker(rank: int) -> tuple[list[dict[str, np.ndarray]], int]:
            kv = connect(addresses, rank, num_workers, mode, local_rank=rank % local_size,
                         local_size=local_size, hierarchy=hierarchy, **OPTIONS)  # fmt: skip
            with kv:
                if optimizer is not None:
                    kv.set_optimizer(**optimizer)
                for key, shape in SHAPES.items():
                    kv.init(key, np.full(shape, 10.0, np.float32))
                pulled = []
                for step in range(steps):
                    kv.push(list(SHAPES), [_push(rank, step, s) for s in SHAPES.values()])
                    if mode == "dist_async":
                        kv.barrier()  # every push applied, then everyone pulls the same
                    outs = {key: np.empty(shape, np.float32) for key, shape in SHAPES.items()}
                    kv.pull(list(outs), list(outs.values()))
                    pulled.append(outs)
                    if mode == "dist_async":
                        kv.barrier()  # nobody pushes before everyone pulled
                return pulled, kv.stats().pushed_raw_bytes

        results = run_ranks(num_workers, worker, timeout=120)
    finally:
        stop_processes([s.process for s in servers])
    return [values for values, _ in results], [nbytes for _, nbytes in results]


def _assert_same(a: list[list[dict]], b: list[list[dict]]) -> None:
    for rank_a, rank_b in zip(a, b, strict=True):
        for step_a, step_b in zip(rank_a, rank_b, strict=True):
            for key in SHAPES:
                np.testing.assert_array_equal(step_a[key], step_b[key], err_msg=key)


@pytest.mark.parametrize(
    ("mode", "optimizer"),
    [
        ("dist_sync", None),
        ("dist_sync", {"name": "sgd", "learning_rate": 1.0, "momentum": 0.5}),
        ("dist_async", {"name": "sgd", "learning_rate": 1.0}),
    ],
)
def test_hosts_of_two_workers_pull_what_the_flat_job_pulls(mode, optimizer):
    flat, flat_bytes = _train(4, 1, mode=mode, optimizer=optimizer)
    hier, hier_bytes = _train(4, 2, mode=mode, optimizer=optimizer)
    _assert_same(flat, hier)
    for rank in range(4):  # every worker of a host pulls the same values
        _assert_same([hier[0]], [hier[rank]])
    # each host pushes one model's worth between its two workers
    model = sum(int(np.prod(s)) for s in SHAPES.values()) * 4 * 3
    assert flat_bytes == [model] * 4
    assert hier_bytes[0] + hier_bytes[1] == hier_bytes[2] + hier_bytes[3] == model
    assert all(0 < nbytes < model for nbytes in hier_bytes)  # both workers push a share


def test_hierarchy_off_is_the_flat_job():
    flat, flat_bytes = _train(4, 1, steps=2)
    off, off_bytes = _train(4, 2, steps=2, hierarchy=False)
    _assert_same(flat, off)
    assert off_bytes == flat_bytes


def test_two_bit_residuals_are_kept_per_host_share_of_the_host_sum():
    threshold = 0.5
    shape, steps, workers, local_size = (2000,), 3, 4, 2
    rng = np.random.default_rng(0)
    pushes = rng.uniform(-0.6, 0.6, size=(steps, workers, *shape)).astype(np.float32)
    servers = start_servers(1, workers)
    try:
        addresses = [s.address for s in servers]

        def worker(rank: int) -> tuple[list[np.ndarray], dict]:
            kv = connect(addresses, rank, workers, local_rank=rank % local_size,
                         local_size=local_size, partition_bytes=2048)  # fmt: skip
            with kv:
                kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
                kv.init("w", np.zeros(shape, np.float32))
                pulled = []
                for step in range(steps):
                    kv.push("w", pushes[step, rank])
                    out = np.empty(shape, np.float32)
                    kv.pull("w", out=out)
                    pulled.append(out)
                return pulled, kv.codec_state("w")

        results = run_ranks(workers, worker, timeout=120)
    finally:
        stop_processes([s.process for s in servers])

    # the oracle: each host's sum is 2-bit encoded with the host's residual; a round is the
    # sum of the hosts' decoded pushes
    hosts = workers // local_size
    residuals = [np.zeros(shape, np.float32) for _ in range(hosts)]
    expected = []
    for step in range(steps):
        total = np.zeros(shape, np.float32)
        for host in range(hosts):
            ranks = range(host * local_size, (host + 1) * local_size)
            host_sum = pushes[step, ranks[0]].copy()
            for rank in ranks[1:]:
                host_sum += pushes[step, rank]
            _, codes = oracle_encode(host_sum, residuals[host], threshold)
            total += oracle_decode(codes, threshold)
        expected.append(total)
    for rank, (pulled, state) in enumerate(results):
        for step in range(steps):
            np.testing.assert_array_equal(pulled[step], expected[step])
        host = rank // local_size
        owned = [c for c in state["keys"][0]["chunks"] if c["pushes"]]
        assert owned, f"rank {rank} pushes no chunk of its host's share"
        for chunk in owned:
            span = slice(chunk["start"], chunk["start"] + chunk["numel"])
            np.testing.assert_array_equal(chunk["state"]["residual"], residuals[host][span])
    # the host's two workers push every chunk between them, once
    for host in range(hosts):
        pushed = [c["index"] for rank in (2 * host, 2 * host + 1)
                  for c in results[rank][1]["keys"][0]["chunks"] if c["pushes"]]  # fmt: skip
        assert sorted(pushed) == list(range(len(results[0][1]["keys"][0]["chunks"])))


DYING_WORKER = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import kvstore
    kv = kvstore.create("dist_sync", timeout=60)
    kv.init("w", np.zeros(4096, np.float32))
    print("ready", flush=True)
    sys.stdin.readline()
    os._exit(3)  # dies before its push, as a crashed training process does
    """
)


def test_a_local_worker_that_dies_is_reported_to_its_host_and_to_the_job():
    heartbeat = "1.5"
    servers = start_servers(1, 4, env={"KVSTORE_HEARTBEAT_TIMEOUT": heartbeat})
    addresses = [s.address for s in servers]
    env = {**os.environ, "KVSTORE_SERVERS": addresses[0], "KVSTORE_RANK": "1",
           "KVSTORE_NUM_WORKERS": "4", "KVSTORE_LOCAL_RANK": "1", "KVSTORE_LOCAL_SIZE": "2",
           "KVSTORE_HEARTBEAT_TIMEOUT": heartbeat, "KVSTORE_LOG_LEVEL": "CRITICAL"}  # fmt: skip
    dying = subprocess.Popen([sys.executable, "-c", DYING_WORKER], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:

        def worker(rank: int) -> float:
            index = {0: 0, 1: 2, 2: 3}[rank]  # ranks 0, 2 and 3 run here; rank 1 dies
            kv = connect(addresses, index, 4, local_rank=index % 2, local_size=2,
                         heartbeat_timeout=float(heartbeat))  # fmt: skip
            try:
                kv.init("w", np.zeros(4096, np.float32))
                if index == 0:
                    assert dying.stdout.readline().strip() == "ready"
                    dying.stdin.write("die\n")
                    dying.stdin.flush()
                started = time.monotonic()
                try:
                    kv.push("w", np.ones(4096, np.float32))
                    kv.pull("w", out=np.empty(4096, np.float32))
                finally:
                    waited = time.monotonic() - started
                return waited
            finally:
                try:
                    kv.close()
                except Exception:
                    pass

        outcomes = run_ranks_outcomes(3, worker, timeout=GUARD * 3)
    finally:
        if dying.poll() is None:
            dying.kill()
        dying.wait()
        stop_processes([s.process for s in servers])
    assert dying.returncode == 3
    for outcome in outcomes:  # its host's worker and the other host's both raise
        assert isinstance(outcome, WorkerLostError), outcome
        assert outcome.rank == 1, outcome
    assert "local rank 1 on this host" in str(outcomes[0])


def _steps(kv: Any, rank: int, steps: range) -> dict[str, np.ndarray]:
    """Push and pull every key for ``steps``; the last values pulled."""
    outs = {key: np.empty(shape, np.float32) for key, shape in SHAPES.items()}
    for step in steps:
        grads = [_push(rank, step, shape) * np.float32(0.01) for shape in SHAPES.values()]
        kv.push(list(SHAPES), grads)
        kv.pull(list(outs), list(outs.values()))
    return outs


def test_a_hierarchical_job_resumes_from_its_checkpoint_bit_identically(tmp_path):
    """2-bit pushes (residuals on each host share's owner), server SGD with momentum."""
    workers, local_size = 4, 2

    def job(rank: int, *, addresses: list[str], load: bool) -> dict[str, np.ndarray]:
        kv = connect(addresses, rank, workers, local_rank=rank % local_size,
                     local_size=local_size, **OPTIONS)  # fmt: skip
        with kv:
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.05})
            kv.set_optimizer("sgd", learning_rate=0.5, momentum=0.9)
            for key, shape in SHAPES.items():
                kv.init(key, np.zeros(shape, np.float32))
            if load:
                kv.load_checkpoint(tmp_path / "ckpt")
            else:
                _steps(kv, rank, range(2))
                kv.save_checkpoint(tmp_path / "ckpt")
            return _steps(kv, rank, range(2, 4))

    finals = []
    for load in (False, True):
        servers = start_servers(2, workers)
        try:
            addresses = [s.address for s in servers]
            finals.append(
                run_ranks(workers, functools.partial(job, addresses=addresses, load=load), 120)
            )
        finally:
            stop_processes([s.process for s in servers])
    uninterrupted, resumed = finals
    _assert_same([uninterrupted], [resumed])
    assert np.count_nonzero(uninterrupted[0]["split"])


def test_kvstore_torch_trains_the_same_with_hosts_of_two_workers():
    torch = pytest.importorskip("torch")
    import kvstore.torch as kvt

    workers = 4

    torch.manual_seed(0)  # (here: the threads below would share torch's generator)
    start = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))

    def train(local_size: int) -> list[dict[str, Any]]:
        servers = start_servers(2, workers)
        try:
            addresses = [s.address for s in servers]
            models = [copy.deepcopy(start) for _ in range(workers)]

            def rank_job(rank: int) -> dict[str, Any]:
                model = models[rank]
                kv = connect(addresses, rank, workers, local_rank=rank % local_size,
                             local_size=local_size)  # fmt: skip
                with kv:
                    opt = kvt.DistributedOptimizer(
                        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        model.named_parameters(),
                        kv=kv,
                    )
                    for step in range(3):
                        gen = torch.Generator().manual_seed(100 * rank + step)
                        x = torch.randn(8, 6, generator=gen)
                        y = torch.randint(0, 3, (8,), generator=gen)
                        opt.zero_grad()
                        torch.nn.functional.cross_entropy(model(x), y).backward()
                        opt.step()
                return {k: v.detach().clone() for k, v in model.state_dict().items()}

            return run_ranks(workers, rank_job, timeout=120)
        finally:
            stop_processes([s.process for s in servers])

    flat, hier = train(1), train(2)
    for state in hier:  # every worker holds the same model, the flat job's to float rounding
        for name, value in state.items():
            assert torch.equal(value, hier[0][name]), name
            torch.testing.assert_close(value, flat[0][name], rtol=1e-5, atol=1e-6)


CODEC_SHAPES = {"matrix": (300, 7), "split": (5000,)}
STOCHASTIC = {"qsgd", "terngrad"}
"""Codecs whose rounding draws numbers keyed by the pushing worker's rank: a host's share is
pushed by its owner, whose rank the flat job of hosts does not have."""


def _codec_job(spec: dict, workers: int, local_size: int, pushes) -> list[dict[str, np.ndarray]]:
    """Every rank's values after two steps of pushing ``pushes[step][rank][key]``."""
    servers = start_servers(1, workers)
    try:
        addresses = [s.address for s in servers]

        def worker(rank: int) -> dict[str, np.ndarray]:
            kv = connect(addresses, rank, workers, local_rank=rank % local_size,
                         local_size=local_size, **OPTIONS)  # fmt: skip
            with kv:
                kv.set_gradient_compression(spec)
                for key, shape in CODEC_SHAPES.items():
                    kv.init(key, np.zeros(shape, np.float32))
                outs = {key: np.empty(shape, np.float32) for key, shape in CODEC_SHAPES.items()}
                for step in range(2):
                    kv.push(list(CODEC_SHAPES), [pushes[step][rank][k] for k in CODEC_SHAPES])
                    kv.pull(list(outs), list(outs.values()))
                return outs

        return run_ranks(workers, worker, timeout=120)
    finally:
        stop_processes([s.process for s in servers])


def _codec_names() -> list[str]:
    """The built-in codecs (not those other tests register)."""
    from kvstore.codecs.registry import built_in_codecs

    return built_in_codecs()


@pytest.mark.parametrize("name", _codec_names())
def test_every_codec_compresses_each_host_s_sum(name):
    """Hosts of two workers give what a flat job of one worker per host gives, pushing the
    hosts' sums: the codec compresses the host's sum, with the host's residual."""
    from kvstore.codecs.registry import codec_class

    spec = {"type": name, **codec_class(name).example_params[0]}
    rng = np.random.default_rng(1)
    pushes = [[{key: rng.standard_normal(shape).astype(np.float32)
                for key, shape in CODEC_SHAPES.items()} for _ in range(4)]
              for _ in range(2)]  # fmt: skip
    host_sums = [[{key: step[2 * h][key] + step[2 * h + 1][key] for key in CODEC_SHAPES}
                  for h in range(2)] for step in pushes]  # fmt: skip
    hier = _codec_job(spec, 4, 2, pushes)
    for rank in range(1, 4):  # every worker of every host pulls the same values
        for key in CODEC_SHAPES:
            np.testing.assert_array_equal(hier[rank][key], hier[0][key], err_msg=key)
    if name in STOCHASTIC:
        assert all(np.isfinite(hier[0][key]).all() for key in CODEC_SHAPES)
        return
    flat = _codec_job(spec, 2, 1, host_sums)
    for key in CODEC_SHAPES:
        np.testing.assert_array_equal(hier[0][key], flat[0][key], err_msg=key)
