"""``kvstore.torch.DiLoCo``'s Streaming DiLoCo (fragments, overlap, mixing) and its syncs on
``dist_async`` stores, through real servers, against the oracles of ``tests/diloco_oracles.py``
(the comparison rules are in ``test_diloco.py``'s docstring)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from diloco_oracles import (
    THRESHOLD,
    WORKERS,
    AsyncOracle,
    Net,
    StreamingOracle,
    assert_models_equal,
    assert_within_ulps,
    due,
    f32,
    inner_sgd,
    loss_of,
    make_net,
    outer_nag,
    outer_sgd,
    train,
    two_bit,
)
from kvtest import connect, run_ranks

import kvstore.torch as kvt
from kvstore.errors import UsageError

pytestmark = pytest.mark.integration


@pytest.fixture
def addresses(two_servers_two_workers):
    return two_servers_two_workers


NET_FRAGMENTS = [[0], [1, 2, 3]]  # 96 | 16 + 48 + 3 elements: the smallest largest fragment


@pytest.mark.parametrize(("sync_every", "fragments", "overlap"), [(4, 2, 0), (4, 2, 1), (8, 4, 1)])
def test_fragments_sync_on_the_staggered_schedule(addresses, sync_every, fragments, overlap):
    """The keys pushed and pulled after each step: fragment f's after the steps t with
    (t - f*H/F) % H == 0, its pull τ steps later; every key once in every H consecutive steps."""
    start = make_net()
    steps = 3 * sync_every

    def rank_job(rank: int):
        model = copy.deepcopy(start)
        with connect(addresses, rank, WORKERS) as kv:
            events: list[tuple[str, int, tuple[str, ...]]] = []
            holder: list[kvt.DiLoCo] = []
            push, pull = kv.push, kv.pull

            def recording_push(keys, values, *args, **kwargs):
                events.append(("push", holder[0].steps, tuple(keys)))
                return push(keys, values, *args, **kwargs)

            def recording_pull(keys, *args, **kwargs):
                if holder:
                    events.append(("pull", holder[0].steps, tuple(keys)))
                return pull(keys, *args, **kwargs)

            kv.push, kv.pull = recording_push, recording_pull
            opt = kvt.DiLoCo(
                inner_sgd(model),
                model.named_parameters(),
                kv=kv,
                sync_every=sync_every,
                outer=("sgd", {"learning_rate": 1}),
                fragments=fragments,
                overlap=overlap,
            )
            holder.append(opt)
            for step in range(steps):
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()
            return opt.fragment_keys, events

    for fragment_keys, events in run_ranks(WORKERS, rank_job):
        keys = [kvt.diloco.DEFAULT_KEY_PREFIX + name for name, _ in start.named_parameters()]
        if fragments == 2:
            assert [list(f) for f in fragment_keys] == [[keys[i] for i in f] for f in NET_FRAGMENTS]
        else:
            assert [list(f) for f in fragment_keys] == [[k] for k in keys]
        want = []
        for t in range(1, steps + 1):
            # A pull lands before the push of the same step (only possible when τ = 0).
            for f in due(t - overlap, sync_every, fragments) if overlap else []:
                if t - overlap >= 1:
                    want.append(("pull", t, fragment_keys[f]))
            for f in due(t, sync_every, fragments):
                want.append(("push", t, fragment_keys[f]))
                if overlap == 0:
                    want.append(("pull", t, fragment_keys[f]))
        assert events == want
        pushed_at = {
            key: [t for kind, t, ks in events if kind == "push" and key in ks] for key in keys
        }
        for key, at in pushed_at.items():
            for first in range(1, steps - sync_every + 2):
                window = [t for t in at if first <= t < first + sync_every]
                assert len(window) == 1, (key, first, at)


def test_two_fragments_without_overlap_average_each_fragment_at_its_own_steps(addresses):
    """F = 2, τ = 0, outer SGD lr 1: after fragment f's steps both workers hold the mean of
    their local values of f's parameters (the servers' arithmetic exactly, the textbook mean
    within the ulp bound), while the other fragment stays local."""
    start = make_net()
    oracle = StreamingOracle(
        start, sync_every=4, fragments=NET_FRAGMENTS, overlap=0, mixing=0.5, outer=outer_sgd(1.0)
    )
    synced: list[tuple[list[int], list[list[torch.Tensor]]]] = []

    def local_values(indices: list[int], theta: list[torch.Tensor]) -> None:
        synced.append(
            (indices, [[p.detach().clone() for p in m.parameters()] for m in oracle.models])
        )

    oracle.checks.append(local_values)
    oracle.run(range(11))
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    results = train(
        addresses, models, range(11), sync_every=4, outer=("sgd", {"learning_rate": 1}), fragments=2
    )
    # Steps 2, 6, 10: fragment 1; steps 4, 8: fragment 0.
    assert [indices for indices, _ in synced] == [[1, 2, 3], [0], [1, 2, 3], [0], [1, 2, 3]]
    for model, expected in zip(models, oracle.models, strict=True):
        assert_models_equal(model, expected)
    for _, theta, _ in results:
        for got, want in zip(theta, oracle.theta, strict=True):
            assert torch.equal(got, want)
    # Each fragment's θ is the mean of the local values at its last sync (steps 8 and 10).
    theta = results[0][1]
    for indices, locals_ in synced[-2:]:
        for i in indices:
            want = (locals_[0][i] + locals_[1][i]) / WORKERS
            assert_within_ulps(theta[i], want, locals_[0][i], locals_[1][i])
    assert not torch.equal(models[0].inp.weight, models[1].inp.weight), "local steps differ"


def test_overlapped_rounds_mix_the_late_outer_weights_into_the_local_ones(addresses):
    """F = 2, τ = 1, the paper's outer Nesterov: each fragment's θ lands one step after its
    push and the parameters become (1 - α)·θ + α·θ_local with α = 0.5 (exact in float32: the
    halves are exact, the sum rounds once, as in the wrapper's own arithmetic)."""
    start = make_net()
    outer = ("sgd", {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True})
    oracle = StreamingOracle(
        start,
        sync_every=4,
        fragments=NET_FRAGMENTS,
        overlap=1,
        mixing=0.5,
        outer=outer_nag(0.7, 0.9),
    )
    oracle.run(range(11))
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    results = train(addresses, models, range(11), sync_every=4, outer=outer, fragments=2, overlap=1)
    for model, expected in zip(models, oracle.models, strict=True):
        assert_models_equal(model, expected)
    for _, theta, _ in results:
        for got, want in zip(theta, oracle.theta, strict=True):
            assert torch.equal(got, want)
    # The mix matters: α = 0 (drop the overlapped step) gives other weights.
    dropped = StreamingOracle(
        start,
        sync_every=4,
        fragments=NET_FRAGMENTS,
        overlap=1,
        mixing=0.0,
        outer=outer_nag(0.7, 0.9),
    )
    dropped.run(range(11))
    assert not torch.equal(dropped.models[0].inp.weight, oracle.models[0].inp.weight)


class EvenNet(torch.nn.Module):
    """Four parameters of 256, 16, 256 and 16 elements: two fragments of 272 each."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 16)
        self.second = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def even_loss(model: EvenNet, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 16, generator=gen)
    y = torch.randint(0, 16, (8,), generator=gen)
    return torch.nn.functional.cross_entropy(model(x), y)


def pushed_bytes_per_step(addresses, fragments: int, steps: int) -> list[list[int]]:
    """Each rank's bytes pushed during each step (H = 4, dense float32 pseudo-gradients)."""
    torch.manual_seed(0)
    start = EvenNet()

    def rank_job(rank: int) -> list[int]:
        model = copy.deepcopy(start)
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DiLoCo(
                inner_sgd(model),
                model.named_parameters(),
                kv=kv,
                sync_every=4,
                outer=("sgd", {"learning_rate": 1}),
                fragments=fragments,
                key_prefix=f"bytes{fragments}/",
            )
            sent = []
            for step in range(steps):
                before = kv.stats().pushed_bytes
                opt.zero_grad()
                even_loss(model, rank, step).backward()
                opt.step()  # τ = 0: the round's pull waited for the push to go out
                sent.append(kv.stats().pushed_bytes - before)
            return sent

    return run_ranks(WORKERS, rank_job)


def test_fragments_divide_the_bytes_of_a_sync_and_keep_the_total(addresses):
    """Bytes pushed per step, H = 4: the whole model (F = 1) goes out after steps 4 and 8;
    with F = 2 half of it after each of steps 2, 4, 6, 8. Each sync carries its fragment's
    float32 values plus message headers; the total over H steps differs by headers only."""
    steps = 8
    payload = 4 * (256 + 16 + 256 + 16)  # float32 bytes of the whole model
    header_bound = 256  # per key and message, far above the headers of one dense chunk
    whole = pushed_bytes_per_step(addresses, 1, steps)
    halves = pushed_bytes_per_step(addresses, 2, steps)
    for one, two in zip(whole, halves, strict=True):
        assert [step + 1 for step, n in enumerate(one) if n] == [4, 8]
        assert [step + 1 for step, n in enumerate(two) if n] == [2, 4, 6, 8]
        for n in one:
            assert n == 0 or payload <= n <= payload + 4 * header_bound
        for n in two:
            assert n == 0 or payload // 2 <= n <= payload // 2 + 2 * header_bound
        peak_ratio = max(two) / max(one)
        assert abs(peak_ratio - 0.5) < 0.05, peak_ratio
        assert abs(sum(two) - sum(one)) <= 4 * header_bound


def test_resume_between_overlapped_rounds_and_refusal_while_one_is_in_flight(addresses, tmp_path):
    """F = 2, τ = 1, H = 4: after step 4 fragment 0's round is in flight, so state_dict is
    refused; after step 5 it has landed, and a new job of fresh objects resumed from the state
    dicts and ``kv.save_checkpoint`` continues exactly as the job that went on. A state saved
    with other fragments or overlap is refused."""
    start = make_net()
    first = [copy.deepcopy(start) for _ in range(WORKERS)]
    second = [make_net(seed=7) for _ in range(WORKERS)]
    saved: list[dict] = [{} for _ in range(WORKERS)]
    store = tmp_path / "store"
    outer = ("sgd", {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True})

    def run(rank: int, model: Net, steps: range, resume: bool) -> None:
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DiLoCo(
                inner_sgd(model, 0.9),
                model.named_parameters(),
                kv=kv,
                sync_every=4,
                outer=outer,
                compression={"type": "2bit", "threshold": THRESHOLD},
                fragments=2,
                overlap=1,
            )
            if resume:
                model.load_state_dict(saved[rank]["model"])
                opt.load_state_dict(saved[rank]["optimizer"])
                kv.load_checkpoint(store)
                assert opt.steps == 5 and not opt.round_in_flight
            for step in steps:
                if step == 4 and not resume:
                    assert opt.round_in_flight
                    with pytest.raises(UsageError, match="fragment 0's round is in flight"):
                        opt.state_dict()
                if step == 5 and not resume:
                    saved[rank]["model"] = copy.deepcopy(model.state_dict())
                    saved[rank]["optimizer"] = copy.deepcopy(opt.state_dict())
                    kv.save_checkpoint(store)
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()

    run_ranks(WORKERS, lambda rank: run(rank, first[rank], range(11), False))
    run_ranks(WORKERS, lambda rank: run(rank, second[rank], range(5, 11), True))
    for a, b in zip(first, second, strict=True):
        assert_models_equal(a, b)
    assert not torch.equal(first[0].inp.weight, start.inp.weight)

    def mismatch(rank: int) -> None:
        model = make_net()
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DiLoCo(
                inner_sgd(model, 0.9), model.named_parameters(), kv=kv, sync_every=4, fragments=2
            )
            with pytest.raises(ValueError, match="saved with fragments=2, overlap=1"):
                opt.load_state_dict(saved[rank]["optimizer"])

    run_ranks(WORKERS, mismatch)


def pull_servers_theta(kv, opt: kvt.DiLoCo) -> list[torch.Tensor]:
    theta = [torch.empty_like(t) for t in opt.outer_weights]
    kv.pull(list(opt.keys), out=theta)
    return theta


def test_async_syncs_apply_each_pseudo_gradient_in_arrival_order(addresses):
    """dist_async, H = 3, outer SGD lr 1, the syncs forced into the order 0, 1, 1, 0 (each
    worker waits for its turn outside the store): the servers' θ is the oracle's, which applies
    each Δ alone as it arrives (θ - Δ/2, each Δ from the θ its worker last pulled), bit for bit;
    so are the workers' models and the θ each one last pulled."""
    start = make_net()
    order = [0, 1, 1, 0]
    sync_every = 3
    oracle = AsyncOracle(start, sync_every=sync_every, outer=outer_sgd(1.0))
    for rank in order:
        oracle.turn(rank)
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    turn = threading.Condition()
    done = [0]  # the turns taken
    constructed = threading.Barrier(WORKERS)
    finished = threading.Barrier(WORKERS)

    def rank_job(rank: int):
        model = models[rank]
        with connect(addresses, rank, WORKERS, mode="dist_async") as kv:
            opt = kvt.DiLoCo(
                inner_sgd(model),
                model.named_parameters(),
                kv=kv,
                sync_every=sync_every,
                outer=("sgd", {"learning_rate": 1}),
            )
            # Both hold rank 0's parameters before any Δ arrives.
            constructed.wait(timeout=30)
            step = 0
            for index, owner in enumerate(order):
                if owner != rank:
                    continue
                with turn:
                    assert turn.wait_for(lambda index=index: done[0] == index, timeout=30)
                for _ in range(sync_every):
                    opt.zero_grad()
                    loss_of(model, rank, step).backward()
                    opt.step()  # the H-th step pushes Δ and pulls θ
                    step += 1
                with turn:
                    done[0] += 1
                    turn.notify_all()
            finished.wait(timeout=30)
            return [t.clone() for t in opt.outer_weights], pull_servers_theta(kv, opt)

    results = run_ranks(WORKERS, rank_job)
    for rank, (model, (theta, servers)) in enumerate(zip(models, results, strict=True)):
        assert_models_equal(model, oracle.models[rank])
        for got, want in zip(theta, oracle.theta[rank], strict=True):
            assert torch.equal(got, want)
        for got, want in zip(servers, oracle.server, strict=True):
            assert torch.equal(got, want)
    # Worker 0 last synced after worker 1: it holds the servers' θ. The order matters: the
    # same syncs in the order 0, 0, 1, 1 give other weights.
    for got, want in zip(results[0][0], oracle.server, strict=True):
        assert torch.equal(got, want)
    other = AsyncOracle(start, sync_every=sync_every, outer=outer_sgd(1.0))
    for rank in [0, 0, 1, 1]:
        other.turn(rank)
    assert not torch.equal(other.server[0], oracle.server[0])


def test_async_slow_worker_does_not_hold_the_fast_one_back(addresses):
    """dist_async, H = 2: worker 1 takes H - 1 steps and stops before the step that syncs,
    until worker 0 has finished all its syncs (4 of them, counted by its pushes). Then worker 1
    takes its steps (2 syncs). Every sync's order is fixed that way, so the servers' θ, the
    models and each worker's last θ equal the oracle of the syncs 0, 0, 0, 0, 1, 1 bit for
    bit; worker 1, last to sync, holds the servers' θ."""
    start = make_net()
    sync_every, fast_syncs, slow_syncs = 2, 4, 2
    oracle = AsyncOracle(start, sync_every=sync_every, outer=outer_sgd(1.0))
    for rank in [0] * fast_syncs + [1] * slow_syncs:
        oracle.turn(rank)
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    release = threading.Event()  # set by worker 0 once all its syncs returned
    constructed = threading.Barrier(WORKERS)
    finished = threading.Barrier(WORKERS)

    def rank_job(rank: int):
        model = models[rank]
        with connect(addresses, rank, WORKERS, mode="dist_async") as kv:
            pushes: list[int] = []
            push = kv.push

            def counting_push(keys, values, *args, **kwargs):
                pushes.append(len(keys))
                return push(keys, values, *args, **kwargs)

            kv.push = counting_push
            opt = kvt.DiLoCo(
                inner_sgd(model),
                model.named_parameters(),
                kv=kv,
                sync_every=sync_every,
                outer=("sgd", {"learning_rate": 1}),
            )
            constructed.wait(timeout=30)
            syncs = fast_syncs if rank == 0 else slow_syncs
            for step in range(syncs * sync_every):
                if rank == 1 and step == sync_every - 1:
                    # Stopped before its first sync; worker 0 must get through all of its own.
                    assert release.wait(timeout=30), "the fast worker waited for the slow one"
                    assert pushes == []
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()
            completed = len(pushes)  # one push of every key per sync
            if rank == 0:
                release.set()
            finished.wait(timeout=30)
            return completed, [t.clone() for t in opt.outer_weights], pull_servers_theta(kv, opt)

    results = run_ranks(WORKERS, rank_job)
    assert [completed for completed, _, _ in results] == [fast_syncs, slow_syncs]
    for rank, (model, (_, theta, servers)) in enumerate(zip(models, results, strict=True)):
        assert_models_equal(model, oracle.models[rank])
        for got, want in zip(theta, oracle.theta[rank], strict=True):
            assert torch.equal(got, want)
        for got, want in zip(servers, oracle.server, strict=True):
            assert torch.equal(got, want)
    for got, want in zip(results[1][1], oracle.server, strict=True):
        assert torch.equal(got, want)
    # Worker 0 ended on the θ of its last sync, before worker 1's Δs arrived.
    assert not torch.equal(results[0][1][0], oracle.server[0])


def test_async_fragments_overlap_and_compression_one_worker_after_the_other(addresses):
    """dist_async with F = 2, τ = 1, 2-bit pseudo-gradients and the paper's outer Nesterov:
    worker 0 runs its 9 steps (syncs after steps 2, 4, 6, 8, each θ pulled a step later and
    mixed in), then worker 1 runs its 9 from the θ it pulled at construction. The servers' θ and
    the models equal the oracle that applies each fragment's compressed Δ alone on arrival (the
    outer momentum carried from worker 0's Δs into worker 1's), bit for bit."""
    start = make_net()
    sync_every, fragments, overlap, mixing, steps = 4, 2, 1, 0.5, 9
    update = outer_nag(0.7, 0.9)
    server = [p.detach().clone() for p in start.parameters()]
    outer_state: dict = {}
    expected = [copy.deepcopy(start) for _ in range(WORKERS)]
    for rank, model in enumerate(expected):  # one worker after the other
        opt = inner_sgd(model)
        params = list(model.parameters())
        theta = [p.detach().clone() for p in params]
        residuals = [torch.zeros_like(t) for t in theta]
        pending: list[tuple[int, list[int]]] = []
        for t in range(1, steps + 1):
            opt.zero_grad()
            loss_of(model, rank, t - 1).backward()
            opt.step()
            for at, indices in [p for p in pending if p[0] == t]:
                pending.remove((at, indices))
                for i in indices:
                    theta[i] = server[i].clone()
                    with torch.no_grad():
                        mixed = (f32(1.0) - f32(mixing)) * theta[i] + f32(mixing) * params[i]
                        params[i].copy_(mixed)
            for f in due(t, sync_every, fragments):
                for i in NET_FRAGMENTS[f]:
                    sent = two_bit(residuals[i], theta[i] - params[i].detach())
                    server[i] = update(i, server[i], sent, outer_state)
                pending.append((t + overlap, NET_FRAGMENTS[f]))
        assert not pending
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    constructed = threading.Barrier(WORKERS)
    first_done = threading.Event()
    finished = threading.Barrier(WORKERS)

    def rank_job(rank: int) -> list[torch.Tensor]:
        model = models[rank]
        with connect(addresses, rank, WORKERS, mode="dist_async") as kv:
            opt = kvt.DiLoCo(
                inner_sgd(model),
                model.named_parameters(),
                kv=kv,
                sync_every=sync_every,
                outer=("sgd", {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True}),
                compression={"type": "2bit", "threshold": THRESHOLD},
                fragments=fragments,
                overlap=overlap,
                mixing=mixing,
            )
            constructed.wait(timeout=30)
            if rank == 1:
                assert first_done.wait(timeout=30)
            for step in range(steps):
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()
            assert not opt.round_in_flight
            first_done.set()
            finished.wait(timeout=30)
            return pull_servers_theta(kv, opt)

    for servers in run_ranks(WORKERS, rank_job):
        for got, want in zip(servers, server, strict=True):
            assert torch.equal(got, want)
    for model, want in zip(models, expected, strict=True):
        assert_models_equal(model, want)
    assert not torch.equal(models[0].inp.weight, models[1].inp.weight)
