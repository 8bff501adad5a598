"""Oracles of ``kvstore.torch.DiLoCo`` for its tests (``tests/integration/test_diloco*.py``): the
same job in one process, each worker's inner steps on the same batches and, at each sync, the
servers' arithmetic written out in float32 (MXNet's formulas, as ``server/optimizers.py`` has
them); for whole-model syncs, Streaming DiLoCo's fragments and overlap, and ``dist_async``'s
syncs in a given order."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from kvtest import connect, run_ranks

import kvstore.torch as kvt

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
