"""``kvstore.torch.DiLoCo`` through real servers, against oracles computed here.

Two workers are threads of this process, each with its own model, inner optimizer and store
connected to two ``kvstore-server`` processes. The oracle runs the same job in one process: each
worker's inner steps with the same torch optimizer on the same batches, and at each sync the
servers' arithmetic written out in float32 (the pseudo-gradients' sum, then the outer update as
``server/optimizers.py`` writes it, MXNet's formulas). With two workers the servers' sum
``a + b`` is exact and commutative, so DiLoCo must equal that oracle bit for bit.

The textbook forms of the same algorithms (synchronous SGD on the mean gradient, the mean of the
local models) are compared too, within a bound of a few units in the last place (ulp): the
pseudo-gradient ``θ - θ_local`` is exact (Sterbenz) only where ``θ_local`` is within a factor
two of ``θ``, and ``θ_local = fl(θ - ηg)`` itself was rounded, so the outer step's
``θ - mean(Δ)`` and the textbook ``θ - η mean(g)`` or ``mean(x)`` round differently: each of
(1) ``θ_local``, (2) ``Δ``, (3) the sum of the ``Δ`` and (4) the final subtraction contributes at
most half an ulp of the largest magnitude involved, and the textbook form one more.
"""

from __future__ import annotations

import copy

import pytest
import torch
from diloco_oracles import (
    INNER_LR,
    THRESHOLD,
    WORKERS,
    Net,
    Oracle,
    assert_models_equal,
    assert_within_ulps,
    inner_sgd,
    loss_of,
    make_net,
    outer_adam,
    outer_nag,
    outer_sgd,
    train,
)
from kvtest import connect, run_ranks

import kvstore.torch as kvt
from kvstore.errors import CodecError, UsageError

pytestmark = pytest.mark.integration


@pytest.fixture
def addresses(two_servers_two_workers):
    return two_servers_two_workers


def test_one_inner_step_per_sync_is_synchronous_sgd(addresses):
    """H = 1, plain SGD inside, outer SGD lr 1: each step is one step of synchronous SGD on the
    mean gradient (exactly the servers' arithmetic; the textbook step within the ulp bound)."""
    start = make_net()
    oracle = Oracle(start, sync_every=1, outer=outer_sgd(1.0))
    textbook: list[torch.Tensor] = []

    def synchronous_sgd(previous: list[torch.Tensor]) -> None:
        # Every worker's model held θ before its step: its gradient is at θ.
        for i, theta in enumerate(previous):
            grads = [list(m.parameters())[i].grad for m in oracle.models]
            want = theta - INNER_LR * ((grads[0] + grads[1]) / WORKERS)
            locals_ = [list(m.parameters())[i].detach() for m in oracle.models]
            assert_within_ulps(oracle.theta[i], want, theta, *locals_)
            textbook.append(want)

    oracle.checks.append(synchronous_sgd)
    oracle.run(range(6))
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    results = train(addresses, models, range(6), sync_every=1, outer=("sgd", {"learning_rate": 1}))
    for model, (steps, theta, _) in zip(models, results, strict=True):
        assert steps == 6
        assert_models_equal(model, oracle.models[0])
        for got, want in zip(theta, oracle.theta, strict=True):
            assert torch.equal(got, want)
    assert textbook and not torch.equal(oracle.theta[0], start.inp.weight.detach())


def test_five_inner_steps_per_sync_average_the_local_models(addresses):
    """H = 5, outer SGD lr 1: every 5 steps both workers continue from the mean of their
    local models (the textbook mean within the ulp bound); between syncs they differ."""
    start = make_net()
    oracle = Oracle(start, sync_every=5, outer=outer_sgd(1.0))

    def model_average(previous: list[torch.Tensor]) -> None:
        for i, theta in enumerate(previous):
            locals_ = [list(m.parameters())[i].detach() for m in oracle.models]
            want = (locals_[0] + locals_[1]) / WORKERS
            assert_within_ulps(oracle.theta[i], want, theta, *locals_)

    oracle.checks.append(model_average)
    oracle.run(range(12))  # two syncs, then two local steps
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    results = train(addresses, models, range(12), sync_every=5, outer=("sgd", {"learning_rate": 1}))
    for model, expected in zip(models, oracle.models, strict=True):
        assert_models_equal(model, expected)
    assert not torch.equal(models[0].inp.weight, models[1].inp.weight), "local steps differ"
    for _, theta, _ in results:
        for got, want in zip(theta, oracle.theta, strict=True):
            assert torch.equal(got, want)


def test_outer_nesterov_is_the_servers_nag_on_the_mean_pseudo_gradient(addresses):
    """The paper's outer step (lr 0.7, momentum 0.9, Nesterov), H = 3, inner SGD with momentum
    (its state kept across syncs): equal to the oracle's NAG bit for bit."""
    start = make_net()
    oracle = Oracle(start, sync_every=3, outer=outer_nag(0.7, 0.9), inner_momentum=0.9)
    oracle.run(range(10))
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    outer = ("sgd", {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True})
    results = train(addresses, models, range(10), sync_every=3, outer=outer, inner_momentum=0.9)
    for model, expected in zip(models, oracle.models, strict=True):
        assert_models_equal(model, expected)
    for _, theta, state in results:
        for got, want in zip(theta, oracle.theta, strict=True):
            assert torch.equal(got, want)
        assert state["state"], "the inner momentum buffers are kept"
    # Outer lr 1 without momentum would have given another model.
    plain = Oracle(start, sync_every=3, outer=outer_sgd(1.0), inner_momentum=0.9)
    plain.run(range(10))
    assert not torch.equal(plain.theta[0], oracle.theta[0])


def test_outer_adam_with_adamw_inside(addresses):
    """The servers' Adam as the outer step over AdamW inner steps (whose moments and step
    counts stay on each worker across syncs): equal to the oracle bit for bit."""

    def adamw(model: Net) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.1)

    start = make_net()
    oracle = Oracle(start, sync_every=4, outer=outer_adam(0.05), inner=adamw)
    oracle.run(range(9))
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    outer = ("adam", {"learning_rate": 0.05})
    results = train(addresses, models, range(9), sync_every=4, outer=outer, inner=adamw)
    for model, expected in zip(models, oracle.models, strict=True):
        assert_models_equal(model, expected)
    for _, theta, state in results:
        for got, want in zip(theta, oracle.theta, strict=True):
            assert torch.equal(got, want)
        assert all(int(s["step"]) == 9 for s in state["state"].values())


def test_update_outer_optimizer_changes_the_next_outer_steps(addresses):
    """A schedule of the outer learning rate: lr 1 for the first sync, 0.5 for the second."""
    start = make_net()
    oracle = Oracle(start, sync_every=2, outer=outer_sgd(1.0))
    oracle.run(range(2))
    oracle.outer = outer_sgd(0.5)
    oracle.run(range(2, 4))
    models = [copy.deepcopy(start) for _ in range(WORKERS)]

    def rank_job(rank: int) -> dict:
        model = models[rank]
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DiLoCo(
                inner_sgd(model), model.named_parameters(), kv=kv, sync_every=2, outer="sgd"
            )
            opt.update_outer_optimizer(learning_rate=1.0)
            for step in range(4):
                if step == 2:
                    opt.update_outer_optimizer(learning_rate=0.5)
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()
            return opt.state_dict()["kvstore_diloco"]["outer"]

    for outer in run_ranks(WORKERS, rank_job):
        assert outer == ["sgd", {"rescale_grad": 1 / WORKERS, "learning_rate": 0.5}]
    for model, expected in zip(models, oracle.models, strict=True):
        assert_models_equal(model, expected)


def test_compressed_pseudo_gradients_keep_their_error_feedback_across_syncs(addresses):
    """2-bit pushes: what each worker sent plus its residual is the sum of its pseudo-gradients;
    the residual left by one sync goes into the next one's push (the oracle's residuals equal
    the store's codec state, and its θ the servers')."""
    start = make_net()
    oracle = Oracle(start, sync_every=2, outer=outer_sgd(1.0), codec=True)
    pseudo_gradients = [[torch.zeros_like(t) for t in oracle.theta] for _ in range(WORKERS)]
    carried: list[bool] = []

    def bookkeeping(previous: list[torch.Tensor]) -> None:
        for rank, model in enumerate(oracle.models):
            for i, param in enumerate(model.parameters()):
                pseudo_gradients[rank][i] += previous[i] - param.detach()
        carried.append(any(bool(r.abs().sum() > 0) for r in oracle.residuals[0]))

    oracle.checks.append(bookkeeping)
    oracle.run(range(6))
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    compression = {"type": "2bit", "threshold": THRESHOLD}
    results = train(
        addresses,
        models,
        range(6),
        sync_every=2,
        outer=("sgd", {"learning_rate": 1}),
        compression=compression,
    )
    sent_by_workers = [torch.zeros_like(t) for t in oracle.theta]
    for rank, (model, (_, theta, state)) in enumerate(zip(models, results, strict=True)):
        assert_models_equal(model, oracle.models[rank])
        for got, want in zip(theta, oracle.theta, strict=True):
            assert torch.equal(got, want)
        keys = state["kvstore_codec_state"]["keys"]
        for i, key in enumerate(keys):
            (chunk,) = key["chunks"]
            residual = chunk["state"]["residual"].view(oracle.theta[i].shape)
            assert torch.equal(residual, oracle.residuals[rank][i]), key["key"]
            # What the worker sent over the 3 syncs: whole quanta of t, at most one a sync.
            sent = pseudo_gradients[rank][i] - residual
            quanta = sent / THRESHOLD
            torch.testing.assert_close(quanta, quanta.round(), rtol=0, atol=1e-3)
            assert quanta.abs().max() <= 3.001
            sent_by_workers[i] += sent
    assert all(carried), "every sync leaves a residual for the next"
    # The servers' θ moved by the mean of what was sent (outer SGD lr 1): sent plus residual is
    # the pseudo-gradients, the residuals being the store's own.
    start_theta = [p.detach() for p in start.parameters()]
    for begin, end, sent in zip(start_theta, results[0][1], sent_by_workers, strict=True):
        torch.testing.assert_close(WORKERS * (begin - end), sent, rtol=0, atol=1e-5)
        assert sent.abs().max() > 0


def test_pull_compression_gives_the_weights_the_workers_hold(addresses):
    """fp16 pulls: the workers' θ is the servers' published ``w_pub`` (the servers' weights
    plus what the fp16 differences left out), and each pseudo-gradient starts from it."""
    start = make_net()
    oracle = Oracle(start, sync_every=2, outer=outer_nag(0.7, 0.9), fp16=True)
    oracle.run(range(6))
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    outer = ("sgd", {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True})
    results = train(addresses, models, range(6), sync_every=2, outer=outer, pull={"type": "fp16"})
    for model, expected in zip(models, oracle.models, strict=True):
        assert_models_equal(model, expected)
    for _, theta, _ in results:
        for got, want in zip(theta, oracle.theta, strict=True):
            assert torch.equal(got, want)
    assert any(not torch.equal(a, b) for a, b in zip(oracle.theta, oracle.server, strict=True))


def test_state_dict_and_checkpoint_resume_bit_identically(addresses, tmp_path):
    """Saved mid-round (after 4 steps, H = 3) with the model's and DiLoCo's state dicts and
    ``kv.save_checkpoint`` (outer momentum, θ on the servers, 2-bit residuals), a new job of
    fresh objects continues exactly as the job that went on."""
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
                sync_every=3,
                outer=outer,
                compression={"type": "2bit", "threshold": THRESHOLD},
            )
            if resume:  # after construction, which pulls rank 0's parameters
                model.load_state_dict(saved[rank]["model"])
                opt.load_state_dict(saved[rank]["optimizer"])
                kv.load_checkpoint(store)
                assert opt.steps == 4
            for step in steps:
                if step == 4 and not resume:
                    saved[rank]["model"] = copy.deepcopy(model.state_dict())
                    saved[rank]["optimizer"] = copy.deepcopy(opt.state_dict())
                    kv.save_checkpoint(store)
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()

    run_ranks(WORKERS, lambda rank: run(rank, first[rank], range(10), False))
    run_ranks(WORKERS, lambda rank: run(rank, second[rank], range(4, 10), True))
    for a, b in zip(first, second, strict=True):
        assert_models_equal(a, b)
    assert not torch.equal(first[0].inp.weight, start.inp.weight)


def test_bad_arguments_are_refused_before_anything_is_sent(addresses):
    def rank_job(rank: int) -> None:
        model = make_net()
        with connect(addresses, rank, WORKERS) as kv:
            sgd = inner_sgd(model)
            named = list(model.named_parameters())
            with pytest.raises(ValueError, match="sync_every must be a multiple of fragments"):
                kvt.DiLoCo(sgd, named, kv=kv, sync_every=4, fragments=3)
            with pytest.raises(ValueError, match="overlap must be < sync_every/fragments = 2"):
                kvt.DiLoCo(sgd, named, kv=kv, sync_every=4, fragments=2, overlap=2)
            with pytest.raises(ValueError, match="at most the number of parameters"):
                kvt.DiLoCo(sgd, named, kv=kv, sync_every=8, fragments=8)
            with pytest.raises(ValueError, match="mixing must be a number in"):
                kvt.DiLoCo(sgd, named, kv=kv, sync_every=4, overlap=1, mixing=1.5)
            with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
                kvt.DiLoCo(sgd, model.named_parameters(), kv=kv, sync_every=0)
            with pytest.raises(TypeError, match="outer must be a name"):
                kvt.DiLoCo(sgd, model.named_parameters(), kv=kv, outer=("sgd", 0.7))
            with pytest.raises(UsageError, match="fixed when it is made"):
                opt = kvt.DiLoCo(sgd, model.named_parameters(), kv=kv, sync_every=2)
                opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
            with pytest.raises(ValueError, match="not a DiLoCo's"):
                opt.load_state_dict(sgd.state_dict())

    run_ranks(WORKERS, rank_job)


def test_async_store_is_accepted_and_a_codec_it_cannot_run_is_refused(addresses):
    """A dist_async store makes a DiLoCo; PowerSGD pseudo-gradients (two round trips per
    sync) are refused there by name before the collective calls, and a one-message codec is
    taken."""

    def rank_job(rank: int) -> str:
        model = make_net()
        with connect(addresses, rank, WORKERS, mode="dist_async") as kv:
            named = list(model.named_parameters())
            with pytest.raises(CodecError, match="DiLoCo on a dist_async store: .*'powersgd'"):
                kvt.DiLoCo(
                    inner_sgd(model), named, kv=kv, compression={"type": "powersgd", "rank": 1}
                )
            opt = kvt.DiLoCo(
                inner_sgd(model),
                named,
                kv=kv,
                sync_every=1,
                compression={"type": "2bit", "threshold": THRESHOLD},
            )
            return repr(opt)

    assert all(r.startswith("DiLoCo(SGD, 4 keys") for r in run_ranks(WORKERS, rank_job))


class BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def test_buffers_are_averaged_at_each_sync_and_the_outer_step_skips_them(addresses):
    """BatchNorm's running statistics: every worker starts from rank 0's, and after each sync
    holds the mean of the workers' statistics before it (exact: (a + b) / 2), while the
    parameters take the outer Nesterov step; the integer batch counter stays each worker's."""
    torch.manual_seed(3)
    start = BatchNormNet()
    sync_every, steps = 2, 6
    before: dict[tuple[int, int], list[torch.Tensor]] = {}
    after: dict[tuple[int, int], list[torch.Tensor]] = {}

    def rank_job(rank: int) -> tuple[tuple[str, ...], int]:
        model = copy.deepcopy(start)
        if rank == 1:  # not rank 0's statistics: the construction must replace them
            with torch.no_grad():
                model.norm.running_mean.fill_(5.0)
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DiLoCo(
                inner_sgd(model),
                model.named_parameters(),
                kv=kv,
                sync_every=sync_every,
                outer=("sgd", {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True}),
                buffers=model.named_buffers(),
            )
            assert torch.equal(model.norm.running_mean, start.norm.running_mean)
            for step in range(steps):
                opt.zero_grad()
                loss_of(model, rank, step).backward()  # the forward updates the statistics
                stats = [model.norm.running_mean.clone(), model.norm.running_var.clone()]
                before[(rank, step)] = stats
                opt.step()
                stats = [model.norm.running_mean.clone(), model.norm.running_var.clone()]
                after[(rank, step)] = stats
            return opt.buffer_keys, int(model.norm.num_batches_tracked)

    results = run_ranks(WORKERS, rank_job)
    assert results[0] == results[1] == (("kvt.diloco/norm.running_mean",
                                         "kvt.diloco/norm.running_var"), steps)  # fmt: skip
    for step in range(steps):
        synced = (step + 1) % sync_every == 0
        for i in range(2):
            mine = [before[(rank, step)][i] for rank in range(WORKERS)]
            for rank in range(WORKERS):
                got = after[(rank, step)][i]
                want = (mine[0] + mine[1]) / WORKERS if synced else mine[rank]
                assert torch.equal(got, want), (step, rank, i)
    # Not averaged: the statistics of the two workers differed between syncs.
    assert not torch.equal(before[(0, 0)][0], before[(1, 0)][0])


def test_synced_and_outer_weights_loaded(addresses):
    """``synced`` after every H-th step only; inside ``outer_weights_loaded`` the parameters
    are θ as last pulled, and the local weights come back after the block."""

    def rank_job(rank: int) -> list[bool]:
        model = make_net()
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DiLoCo(inner_sgd(model), model.named_parameters(), kv=kv, sync_every=2)
            seen = []
            for step in range(3):
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()
                seen.append(opt.synced)
            local = [p.detach().clone() for p in model.parameters()]
            with opt.outer_weights_loaded():
                inside = [p.detach().clone() for p in model.parameters()]
            for got, want in zip(inside, opt.outer_weights, strict=True):
                assert torch.equal(got, want)
            for got, want in zip(model.parameters(), local, strict=True):
                assert torch.equal(got, want)
            assert not all(torch.equal(a, b) for a, b in zip(inside, local, strict=True))
            return seen

    assert run_ranks(WORKERS, rank_job) == [[False, True, False]] * WORKERS
