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
import math
import threading
from collections.abc import Callable

import pytest
import torch
from kvtest import connect, run_ranks

import kvstore.torch as kvt
from kvstore.errors import CodecError, UsageError

pytestmark = pytest.mark.integration

WORKERS = 2
INNER_LR = 0.1
THRESHOLD = 2.0**-6  # a power of two: sums of +-t and their halves are exact in float32
ULP_BOUND = 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def loss_of(model: Net, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 6, generator=gen)
    y = torch.randint(0, 3, (8,), generator=gen)
    return torch.nn.functional.cross_entropy(model(x), y)


def inner_sgd(model: Net, momentum: float = 0.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=momentum)


def f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


# the servers' outer updates, in float32 (server/optimizers.py; wd = 0, no clipping) -------------


def outer_sgd(lr: float) -> Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]:
    """``w = (1 - lr*wd) * w - lr * (rescale * g)``."""

    def update(i: int, w: torch.Tensor, g: torch.Tensor, state: dict) -> torch.Tensor:
        decay = f32(1.0) - f32(lr) * f32(0.0)
        return decay * w - f32(lr) * (f32(1.0 / WORKERS) * g)

    return update


def outer_nag(lr: float, momentum: float):
    """MXNet's NAG, per key ``i``::

    g' = rescale*g + wd*w;  mom = momentum*mom + g';  w = w - lr*(g' + momentum*mom)
    """

    def update(i: int, w: torch.Tensor, g: torch.Tensor, state: dict) -> torch.Tensor:
        gi = f32(1.0 / WORKERS) * g + f32(0.0) * w
        # The momentum starts at zero: its first value is g'.
        mom = state[i] = gi.clone() if i not in state else f32(momentum) * state[i] + gi
        return w - f32(lr) * (gi + f32(momentum) * mom)

    return update


def outer_adam(lr: float, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8):
    """``g' = rescale*g + wd*w; m = b1*m + (1-b1)*g'; v = b2*v + (1-b2)*g'*g';
    w = w - lr_t*m/(sqrt(v) + eps)`` with ``lr_t = lr*sqrt(1 - b2^t)/(1 - b1^t)`` computed in
    double and rounded to float32, ``t`` counting the key's updates from 1."""

    def update(i: int, w: torch.Tensor, g: torch.Tensor, state: dict) -> torch.Tensor:
        t, m, v = state.get(i, (0, torch.zeros_like(w), torch.zeros_like(w)))
        t += 1
        gi = f32(1.0 / WORKERS) * g + f32(0.0) * w
        b1, b2 = f32(beta1), f32(beta2)
        m = b1 * m + (f32(1.0) - b1) * gi
        v = b2 * v + (f32(1.0) - b2) * gi * gi
        state[i] = (t, m, v)
        lr_t = f32(lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t))
        # The servers' float32 sqrt is correctly rounded; torch's vectorized float32 sqrt on
        # the CPU is not always, while the double sqrt rounded to float32 is.
        root = torch.sqrt(v.double()).float()
        return w - lr_t * m / (root + f32(epsilon))

    return update


def two_bit(residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The 2-bit codec's encode-then-decode with error feedback (codecs/twobit): updates the
    residual in place and returns what the servers receive."""
    residual.add_(delta)
    plus = residual >= THRESHOLD
    minus = residual <= -THRESHOLD
    sent = torch.zeros_like(residual)
    sent[plus] = THRESHOLD
    sent[minus] = -THRESHOLD
    residual[plus] -= THRESHOLD
    residual[minus] += THRESHOLD
    return sent


def ulp(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, *scales: torch.Tensor) -> None:
    scale = torch.stack([t.abs() for t in (got, want, *scales)]).amax(dim=0)
    bound = ULP_BOUND * ulp(scale)
    excess = (got - want).abs() - bound
    assert excess.max() <= 0, f"off by more than {ULP_BOUND} ulp: {excess.max()}"


class Oracle:
    """The job in one process; ``residuals[rank]`` per parameter with a 2-bit push codec."""

    def __init__(
        self,
        start: Net,
        *,
        sync_every: int,
        outer,
        inner_momentum=0.0,
        codec=False,
        fp16=False,
        inner=None,
    ):
        self.models = [copy.deepcopy(start) for _ in range(WORKERS)]
        make_inner = inner or (lambda model: inner_sgd(model, inner_momentum))
        self.opts = [make_inner(m) for m in self.models]
        self.theta = [p.detach().clone() for p in start.parameters()]  # as the workers hold it
        self.server = [t.clone() for t in self.theta]  # the servers' weights
        self.fp16 = fp16
        self.sync_every = sync_every
        self.outer = outer
        self.outer_state: dict = {}
        self.codec = codec
        self.residuals = [[torch.zeros_like(t) for t in self.theta] for _ in range(WORKERS)]
        self.checks: list[Callable[[list[torch.Tensor]], None]] = []

    def run(self, steps: range) -> None:
        for step in steps:
            for rank, (model, opt) in enumerate(zip(self.models, self.opts, strict=True)):
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()
            if (step + 1) % self.sync_every == 0:
                self.sync()

    def sync(self) -> None:
        previous = self.theta
        sums = [torch.zeros_like(t) for t in previous]
        for rank, model in enumerate(self.models):
            for i, (theta, param) in enumerate(zip(previous, model.parameters(), strict=True)):
                delta = theta - param.detach()
                sums[i] += two_bit(self.residuals[rank][i], delta) if self.codec else delta
        self.server = [
            self.outer(i, w, g, self.outer_state)
            for i, (w, g) in enumerate(zip(self.server, sums, strict=True))
        ]
        if self.fp16:  # fp16 pulls: w_pub += float32(fp16(w - w_pub)), the rest goes later
            self.theta = [
                theta + (w - theta).half().float()
                for theta, w in zip(previous, self.server, strict=True)
            ]
        else:
            self.theta = [w.clone() for w in self.server]
        for check in self.checks:
            check(previous)
        for model in self.models:
            with torch.no_grad():
                for param, theta in zip(model.parameters(), self.theta, strict=True):
                    param.copy_(theta)


def train(
    addresses,
    models,
    steps,
    *,
    sync_every,
    outer,
    inner_momentum=0.0,
    pull=None,
    inner=None,
    **options,
):
    """Each rank trains its model in place with a DiLoCo; returns each rank's wrapper state."""

    def rank_job(rank: int):
        model = models[rank]
        with connect(addresses, rank, WORKERS) as kv:
            if pull is not None:
                kv.set_pull_compression(pull)
            opt = kvt.DiLoCo(
                inner(model) if inner is not None else inner_sgd(model, inner_momentum),
                model.named_parameters(),
                kv=kv,
                sync_every=sync_every,
                outer=outer,
                **options,
            )
            for step in steps:
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()
            return opt.steps, [t.clone() for t in opt.outer_weights], opt.state_dict()

    return run_ranks(WORKERS, rank_job)


def assert_models_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


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


# Streaming DiLoCo: fragments, overlap, mixing --------------------------------------------------


def due(step: int, sync_every: int, fragments: int) -> list[int]:
    """The contract's schedule: fragment f syncs after the steps t with (t - f*H/F) % H == 0."""
    stride = sync_every // fragments
    return [f for f in range(fragments) if (step - f * stride) % sync_every == 0]


class StreamingOracle:
    """Per fragment, the servers' arithmetic at the fragment's sync step; the workers see the
    round's θ ``overlap`` steps later and mix it, ``(1 - α)·θ + α·θ_local``."""

    def __init__(self, start, *, sync_every, fragments, overlap, mixing, outer, loss=None):
        self.models = [copy.deepcopy(start) for _ in range(WORKERS)]
        self.opts = [inner_sgd(m) for m in self.models]
        self.theta = [p.detach().clone() for p in start.parameters()]
        self.server = [t.clone() for t in self.theta]
        self.fragments, self.sync_every, self.overlap, self.mixing = (
            fragments,
            sync_every,
            overlap,
            mixing,
        )
        self.outer = outer
        self.outer_state: dict = {}
        self.loss = loss or loss_of
        self.pending: list[tuple[int, list[int]]] = []  # (pull after step, key indices)
        self.checks: list[Callable[[list[int], list[torch.Tensor]], None]] = []

    def run(self, steps: range) -> None:
        for step in steps:
            for rank, (model, opt) in enumerate(zip(self.models, self.opts, strict=True)):
                opt.zero_grad()
                self.loss(model, rank, step).backward()
                opt.step()
            t = step + 1
            for at, indices in [p for p in self.pending if p[0] == t]:
                self.pending.remove((at, indices))
                self.land(indices)
            for f in due(t, self.sync_every, len(self.fragments)):
                indices = self.fragments[f]
                for check in self.checks:
                    check(indices, self.theta)
                for i in indices:
                    total = torch.zeros_like(self.theta[i])
                    for model in self.models:
                        total += self.theta[i] - list(model.parameters())[i].detach()
                    self.server[i] = self.outer(i, self.server[i], total, self.outer_state)
                if self.overlap == 0:
                    self.land(indices)
                else:
                    self.pending.append((t + self.overlap, indices))

    def land(self, indices: list[int]) -> None:
        a = f32(self.mixing)
        for i in indices:
            self.theta[i] = self.server[i].clone()
            for model in self.models:
                param = list(model.parameters())[i]
                with torch.no_grad():
                    if self.overlap == 0:
                        param.copy_(self.theta[i])
                    else:
                        param.copy_((f32(1.0) - a) * self.theta[i] + a * param.detach())


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


# dist_async: each worker's Δ applied on arrival, no worker waits for another -----------------


class AsyncOracle:
    """Asynchronous local SGD in one process, the syncs in a given order of ranks: the syncing
    worker's ``Δ = θ_r - θ_local`` (``θ_r``: the θ that worker last pulled) goes through the
    servers' outer update alone, and that worker pulls the result."""

    def __init__(self, start: Net, *, sync_every: int, outer) -> None:
        self.models = [copy.deepcopy(start) for _ in range(WORKERS)]
        self.opts = [inner_sgd(m) for m in self.models]
        self.theta = [[p.detach().clone() for p in start.parameters()] for _ in range(WORKERS)]
        self.server = [p.detach().clone() for p in start.parameters()]
        self.steps = [0] * WORKERS
        self.sync_every = sync_every
        self.outer = outer
        self.outer_state: dict = {}

    def turn(self, rank: int) -> None:
        """``rank``'s H inner steps, then its sync."""
        model, opt = self.models[rank], self.opts[rank]
        for _ in range(self.sync_every):
            opt.zero_grad()
            loss_of(model, rank, self.steps[rank]).backward()
            opt.step()
            self.steps[rank] += 1
        for i, param in enumerate(model.parameters()):
            delta = self.theta[rank][i] - param.detach()
            self.server[i] = self.outer(i, self.server[i], delta, self.outer_state)
            self.theta[rank][i] = self.server[i].clone()
            with torch.no_grad():
                param.copy_(self.theta[rank][i])


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
