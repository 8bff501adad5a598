"""The ``sketch`` codec against real servers (2 servers, 2 workers, keys cut into chunks).

A numpy oracle replays each chunk's rounds from the equations of ``docs/codecs.md`` with the
reference sketch (``kvstore.codecs.sketch.hashing``): FetchSGD's momentum and error sketches on
the servers, and the exact mode's worker-side momentum and error with a second round trip. With
two workers the servers' float32 sum of two tables is the same whichever arrives first, so the
pulled values must equal the oracle's bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import connect, run_ranks

from kvstore.codecs import codec_from_spec
from kvstore.codecs.sketch.hashing import (
    estimates_reference,
    sketch_reference,
    zero_buckets_reference,
)
from kvstore.codecs.sparse.topk import top_k_reference

pytestmark = pytest.mark.integration

N = 2
SPLIT = {"bigarray_bound": 1000, "partition_bytes": 8192}
KEYS = {"big": 3001, 7: 40}  # "big" is cut into chunks on both servers; 7 is sent dense
STEPS = 4


def _gradient(rank: int, step: int, name) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + 10 * step + (1 if name == "big" else 2))
    g = rng.normal(0, 0.1, KEYS[name]).astype(np.float32)
    g[rng.integers(0, g.size, 8)] += rng.normal(0, 5, 8).astype(np.float32)  # heavy hitters
    return g


def _fetchsgd_oracle(codec, name, bounds, eta: float) -> list[np.ndarray]:
    """Each step's dense k-sparse update of key ``name`` (FetchSGD, per chunk)."""
    numel, keys, rho = KEYS[name], codec.row_keys(name), codec.momentum
    updates = [np.zeros(numel, np.float32) for _ in range(STEPS)]
    for start, stop in bounds:
        plan = codec.plan(start, stop - start, numel)
        shape = (plan.numel,) if plan.dense else (plan.rows, plan.columns)
        s_u, s_e = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        for step in range(STEPS):
            tables = [
                _gradient(r, step, name)[start:stop]
                if plan.dense
                else sketch_reference(
                    _gradient(r, step, name)[start:stop], keys, start, plan.columns
                )
                for r in range(N)
            ]
            s_u = s_u * rho + (tables[0] + tables[1])
            s_e = s_e + np.float32(eta) * s_u
            est = s_e if plan.dense else estimates_reference(s_e, keys, start, plan.numel)
            taken = top_k_reference(np.abs(est), plan.k)
            updates[step][start + taken] = est[taken]
            if plan.dense:
                s_e[taken] = 0
                s_u[taken] = 0
            else:
                zero_buckets_reference(s_e, keys, start, taken)
                zero_buckets_reference(s_u, keys, start, taken)
    return updates


def _exact_oracle(codec, name, bounds) -> list[np.ndarray]:
    """Each step's update of key ``name`` with ``exact``: Sketched-SGD, per chunk."""
    numel, keys, rho = KEYS[name], codec.row_keys(name), codec.momentum
    updates = [np.zeros(numel, np.float32) for _ in range(STEPS)]
    for start, stop in bounds:
        plan = codec.plan(start, stop - start, numel)
        u = [np.zeros(plan.numel, np.float32) for _ in range(N)]
        v = [np.zeros(plan.numel, np.float32) for _ in range(N)]
        for step in range(STEPS):
            for r in range(N):
                u[r] = u[r] * rho + _gradient(r, step, name)[start:stop]
                v[r] = v[r] + u[r]
            if plan.dense:
                est = v[0] + v[1]
            else:
                table = sum(sketch_reference(v[r], keys, start, plan.columns) for r in range(N))
                est = estimates_reference(table, keys, start, plan.numel)
            candidates = top_k_reference(np.abs(est), plan.candidates)
            exact = v[0][candidates] + v[1][candidates]
            chosen = top_k_reference(np.abs(exact), plan.k)
            taken = candidates[chosen]
            updates[step][start + taken] = exact[chosen]
            for r in range(N):
                u[r][taken] = 0
                v[r][taken] = 0
    return updates


def _bounds(kv, key):
    return [(c.start, c.stop) for c in kv._shared.keys[key].chunks]


def _run(addresses, spec, optimizer=None):
    """Each rank's pulled values after every step, and the keys' chunk bounds."""

    def worker(rank):
        with connect(addresses, rank, N, **SPLIT) as kv:
            if optimizer is not None:
                kv.set_optimizer(optimizer[0], **optimizer[1])
            kv.set_gradient_compression(spec)
            kv.init(list(KEYS), [np.zeros(n, np.float32) for n in KEYS.values()])
            pulled = []
            for step in range(STEPS):
                kv.push(list(KEYS), [_gradient(rank, step, name) for name in KEYS])
                outs = [np.empty(n, np.float32) for n in KEYS.values()]
                kv.pull(list(KEYS), out=outs)
                pulled.append(outs)
            stats = kv.stats()
            return pulled, {name: _bounds(kv, name) for name in KEYS}, stats

    return run_ranks(N, worker, timeout=120)


@pytest.mark.parametrize("exact", [False, True], ids=["fetchsgd", "exact"])
def test_pulls_are_the_oracles_sparse_updates(two_servers_two_workers, exact):
    spec = {"type": "sketch", "columns": 400, "k": 0.02, "momentum": 0.9, "exact": exact}
    codec = codec_from_spec(spec)
    results = _run(two_servers_two_workers, spec)
    bounds = results[0][1]
    assert len(bounds["big"]) > 2 and codec.plan(0, KEYS[7], KEYS[7]).dense
    assert not any(codec.plan(a, b - a, KEYS["big"]).dense for a, b in bounds["big"])
    for name_index, name in enumerate(KEYS):
        if exact:
            expected = _exact_oracle(codec, name, bounds[name])
        else:
            expected = _fetchsgd_oracle(codec, name, bounds[name], 1.0)
        for pulled, _, _ in results:
            for step in range(STEPS):
                got = pulled[step][name_index]
                assert got.tobytes() == expected[step].tobytes(), (name, step)
                assert 0 < np.count_nonzero(got) <= np.count_nonzero(expected[step])


def test_a_round_is_pulled_as_sparse_pairs(two_servers_two_workers):
    spec = {"type": "sketch", "columns": 0.1, "k": 0.01}
    (_, _, stats), _ = _run(two_servers_two_workers, spec)
    dense = STEPS * sum(KEYS.values()) * 4
    # k = 1% of the elements as (index, value) pairs: far below the dense values
    assert 0 < stats.pulled_bytes < dense / 10


def test_a_server_sgd_scales_the_error_and_moves_the_weights(two_servers_two_workers):
    lr, wd, rescale = 0.1, 0.01, 0.5
    spec = {"type": "sketch", "columns": 400, "k": 0.02, "momentum": 0.5}
    codec = codec_from_spec(spec)
    optimizer = ("sgd", {"learning_rate": lr, "wd": wd, "rescale_grad": rescale})
    results = _run(two_servers_two_workers, spec, optimizer)
    bounds = results[0][1]
    for name_index, name in enumerate(KEYS):
        updates = _fetchsgd_oracle(codec, name, bounds[name], np.float32(lr) * np.float32(rescale))
        w = np.zeros(KEYS[name], np.float32)
        decay = np.float32(1) - np.float32(lr) * np.float32(wd)
        for step in range(STEPS):
            w = decay * w - updates[step]
            for pulled, _, _ in results:
                np.testing.assert_array_equal(pulled[step][name_index], w)


def test_a_loaded_checkpoint_restores_the_servers_sketches(two_servers_two_workers, tmp_path):
    """Momentum and error sketches are server state: after a load the same pushes give the same
    bits as the first time (a load that lost them would recover other elements)."""
    spec = {"type": "sketch", "columns": 400, "k": 0.02, "momentum": 0.9}
    ckpt = tmp_path / "ckpt"

    def steps(kv, rank, which):
        pulled = []
        for step in which:
            kv.push(list(KEYS), [_gradient(rank, step, name) for name in KEYS])
            outs = [np.empty(n, np.float32) for n in KEYS.values()]
            kv.pull(list(KEYS), out=outs)
            pulled.append(outs)
        return pulled

    def worker(rank):
        with connect(two_servers_two_workers, rank, N, **SPLIT) as kv:
            kv.set_gradient_compression(spec)
            kv.init(list(KEYS), [np.zeros(n, np.float32) for n in KEYS.values()])
            steps(kv, rank, range(2))
            kv.save_checkpoint(ckpt)
            first = steps(kv, rank, range(2, STEPS))
            kv.barrier()
            kv.load_checkpoint(ckpt)
            again = steps(kv, rank, range(2, STEPS))
            return first, again

    for first, again in run_ranks(N, worker, timeout=120):
        for a, b in zip(first, again, strict=True):
            for x, y in zip(a, b, strict=True):
                assert x.tobytes() == y.tobytes()
                assert np.count_nonzero(x)


def test_training_through_kvstore_torch(two_servers_two_workers):
    torch = pytest.importorskip("torch")
    import kvstore.torch as kvt

    k = 8  # per key

    def worker(rank):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(40, 50), torch.nn.ReLU(), torch.nn.Linear(50, 3)
        )
        gen = torch.Generator().manual_seed(rank)
        with connect(two_servers_two_workers, rank, N) as kv:
            opt = kvt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=1000.0),  # never steps: the servers do
                model.named_parameters(),
                kv=kv,
                compression={"type": "sketch", "columns": 60, "k": k},
                server_optimizer=("sgd", {"learning_rate": 0.5}),
            )
            moved_weights = []  # per round: how many weights of each parameter changed
            for _ in range(3):
                before = [p.detach().clone() for p in model.parameters()]
                opt.zero_grad()
                x = torch.randn(16, 40, generator=gen)
                y = torch.randint(0, 3, (16,), generator=gen)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                pairs = zip(model.parameters(), before, strict=True)
                moved_weights.append([int((p.detach() != b).sum()) for p, b in pairs])
            return [p.detach().clone() for p in model.parameters()], moved_weights

    (params0, moved_weights), (params1, _) = run_ranks(N, worker, timeout=120)
    for a, b in zip(params0, params1, strict=True):
        assert torch.equal(a, b)
    codec = codec_from_spec({"type": "sketch", "columns": 60, "k": k})
    sizes = [50 * 40, 50, 3 * 50, 3]  # the weights and biases, in order
    recovered = [plan.k for plan in (codec.plan(0, n, n) for n in sizes)]
    assert recovered[0] == k and codec.plan(0, 50, 50).dense  # (the biases travel dense)
    for moved in moved_weights:  # a round moves at most the k weights it recovered, per key
        assert all(m <= r for m, r in zip(moved, recovered, strict=True))
        assert sum(moved) > 0


def test_few_nonzeros_are_pulled_exactly(two_servers_two_workers):
    """At most ``k`` nonzero elements in the workers' sum and enough columns: the pulled value
    is that sum, exactly (no three rows of an element collide at this size and seed)."""
    numel, k = 20_000, 12
    spec = {"type": "sketch", "columns": 2000, "k": k, "momentum": 0.0}

    def grad(rank):
        rng = np.random.default_rng(rank)
        g = np.zeros(numel, np.float32)
        g[rng.choice(numel, k // N, replace=False)] = rng.normal(0, 3, k // N).astype(np.float32)
        return g

    def worker(rank):
        with connect(two_servers_two_workers, rank, N) as kv:
            kv.set_gradient_compression(spec)
            kv.init("sparse", np.zeros(numel, np.float32))
            kv.push("sparse", grad(rank))
            out = np.empty(numel, np.float32)
            kv.pull("sparse", out=out)
            return out

    expected = grad(0) + grad(1)
    assert np.count_nonzero(expected) == k
    for pulled in run_ranks(N, worker, timeout=60):
        assert pulled.tobytes() == expected.tobytes()
