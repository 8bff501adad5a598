"""``kvstore.torch``: DistributedOptimizer, broadcast and buffer synchronization, through real
servers.

Two workers are threads of this process, each with its own model, torch optimizer and store
connected to two ``kvstore-server`` processes. The reference for every run is the same training
done in one process: the mean of the two workers' gradients, stepped by a torch optimizer. With
two workers a server's sum ``a + b`` is exact and commutative, so the wrapper's mean equals the
reference bit for bit and the comparisons below are exact unless noted.
"""

from __future__ import annotations

import copy

import pytest
import torch
from kvtest import connect, run_ranks

import kvstore.torch as kvt
from kvstore.errors import UsageError

pytestmark = pytest.mark.integration

WORKERS = 2
STEPS = 3


class Net(torch.nn.Module):
    """Three linear layers; ``spare`` is used only when asked (the unused-parameter case)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 3)
        self.spare = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        h = torch.relu(self.mid(torch.relu(self.inp(x))))
        y = self.out(h)
        return y + self.spare(h) if use_spare else y


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.randn(8, 6, generator=gen)
    return x, torch.randint(0, 3, (8,), generator=gen)


def loss_of(model: Net, rank: int, step: int, micro: int = 0, use_spare: bool = False):
    x, y = batch(rank, step, micro)
    return torch.nn.functional.cross_entropy(model(x, use_spare), y)


def reference(
    model: Net,
    steps: int,
    *,
    micro: int = 1,
    spare_ranks: tuple[int, ...] = (),
    momentum: float = 0.9,
) -> Net:
    """The job in one process: each step's gradient is the mean over workers of each worker's
    gradient summed over its micro-batches."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(steps):
        per_rank = []
        for rank in range(WORKERS):
            model.zero_grad(set_to_none=True)
            for m in range(micro):
                loss_of(model, rank, step, m, rank in spare_ranks).backward()
            per_rank.append(
                [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            )
        for p, grads in zip(model.parameters(), zip(*per_rank, strict=True), strict=True):
            present = [g for g in grads if g is not None]
            p.grad = None if not present else (sum(present) if len(present) > 1 else present[0] + 0)
            if p.grad is not None:
                p.grad.div_(WORKERS)
        opt.step()
    return model


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = True):
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def train(addresses, models, *, steps=STEPS, micro=1, spare_ranks=(), momentum=0.9, **options):
    """Each rank trains its model (in place); returns per rank the wrapper's keys and stats."""

    def rank_job(rank: int):
        model = models[rank]
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                model.named_parameters(),
                kv=kv,
                backward_passes_per_step=micro,
                **options,
            )
            for step in range(steps):
                opt.zero_grad()
                for m in range(micro):
                    loss_of(model, rank, step, m, rank in spare_ranks).backward()
                opt.step()
            return opt.keys, kv.stats()

    return run_ranks(WORKERS, rank_job)


@pytest.fixture
def addresses(two_servers_two_workers):
    return two_servers_two_workers


def test_the_mean_gradient_matches_one_process(addresses):
    start = make_net()
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    (keys, _), _ = train(addresses, models)
    expected = params_of(reference(start, STEPS))
    for model in models:
        assert_same(params_of(model), expected)
    # one key per trainable parameter, named after it; the spare layer (never used) too
    assert sorted(keys) == sorted(f"kvt.param/{n}" for n, _ in start.named_parameters())


def test_pushes_start_inside_backward(addresses):
    """When the first layer's gradient arrives, the later layers' keys were already pushed."""
    start = make_net()
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    seen: list[list[tuple[str, int]]] = [[] for _ in range(WORKERS)]

    def rank_job(rank: int):
        model = models[rank]
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), kv=kv
            )
            for name, param in model.named_parameters():  # run after the wrapper's hooks
                param.register_post_accumulate_grad_hook(
                    lambda _p, name=name: seen[rank].append((name, kv.stats().push_messages))
                )
            before = kv.stats().push_messages
            loss_of(model, rank, 0).backward()
            after_backward = kv.stats().push_messages
            opt.step()
            return before, after_backward, kv.stats().push_messages

    for rank, (before, after_backward, after_step) in enumerate(run_ranks(WORKERS, rank_job)):
        order = [name for name, _ in seen[rank]]
        counts = {name: count - before for name, count in seen[rank]}
        # backward reached the output layer first and the input layer last
        assert order.index("out.weight") < order.index("inp.weight")
        assert counts["out.weight"] >= 1 and counts["out.bias"] >= 1
        assert counts["inp.weight"] > counts["out.weight"]
        # every used parameter was pushed before backward returned; step pushed only the spare
        # layer, which backward never reached (2 keys, one chunk each)
        assert after_backward - before == counts[order[-1]]
        assert after_step - after_backward == 2
        assert "spare.weight" not in order


def test_bucket_bytes_sends_fewer_keys_and_gives_the_same_result(addresses):
    start = make_net()
    per_key = [copy.deepcopy(start) for _ in range(WORKERS)]
    bucketed = [copy.deepcopy(start) for _ in range(WORKERS)]
    (keys_none, stats_none), _ = train(addresses, per_key)
    (keys_bucketed, stats_bucketed), _ = train(
        addresses, bucketed, bucket_plan={"bucket_bytes": 512}
    )
    parameters = len(list(start.parameters()))
    assert len(keys_none) == parameters
    assert 1 < len(keys_bucketed) < parameters
    assert stats_bucketed.push_messages < stats_none.push_messages
    for a, b in zip(per_key, bucketed, strict=True):
        assert_same(params_of(a), params_of(b))


def test_a_planner_function_decides_the_buckets(addresses):
    start = make_net()
    models = [copy.deepcopy(start) for _ in range(WORKERS)]

    def pairs(params):  # backward order: out.bias, out.weight, ... (spare, out, mid, inp)
        return [list(range(i, min(i + 2, len(params)))) for i in range(0, len(params), 2)]

    (keys, _), _ = train(addresses, models, bucket_plan=pairs)
    assert keys == (
        "kvt.param/spare.bias..spare.weight",
        "kvt.param/out.bias..out.weight",
        "kvt.param/mid.bias..mid.weight",
        "kvt.param/inp.bias..inp.weight",
    )
    expected = params_of(reference(start, STEPS))
    for model in models:
        assert_same(params_of(model), expected)


def test_gradient_accumulation_pushes_on_the_last_pass_only(addresses):
    start = make_net()
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    train(addresses, models, micro=2, bucket_plan={"bucket_bytes": 1024})
    expected = params_of(reference(start, STEPS, micro=2))
    for model in models:
        assert_same(params_of(model), expected, exact=False)  # (two passes summed by torch)

    models = [copy.deepcopy(start) for _ in range(WORKERS)]

    def rank_job(rank: int):
        model = models[rank]
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                model.named_parameters(),
                kv=kv,
                backward_passes_per_step=2,
            )
            loss_of(model, rank, 0, 0).backward()
            first = kv.stats().push_messages
            loss_of(model, rank, 0, 1).backward()
            second = kv.stats().push_messages
            opt.step()
            with pytest.raises(UsageError, match="backward_passes_per_step=2"):
                for m in range(3):
                    loss_of(model, rank, 1, m).backward()
            return first, second

    for first, second in run_ranks(WORKERS, rank_job):
        assert first == 0 and second > 0


def test_frozen_and_unused_parameters(addresses):
    """A frozen layer is no key and stays as it was; a layer that only rank 0 uses gets the
    mean (rank 1 pushed zeros); every worker ends with the same model."""
    start = make_net()
    start.mid.weight.requires_grad_(False)
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    (keys, _), _ = train(addresses, models, spare_ranks=(0,), momentum=0.0)
    assert "kvt.param/mid.weight" not in keys and "kvt.param/mid.bias" in keys
    expected = params_of(reference(start, STEPS, spare_ranks=(0,), momentum=0.0))
    for model in models:
        assert_same(params_of(model), expected)
        assert torch.equal(model.mid.weight, start.mid.weight)
        assert model.mid.weight.grad is None

    # Used by nobody: a zero mean gradient, on every worker alike.
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    train(addresses, models, steps=1, momentum=0.0)
    for model in models:
        assert torch.equal(model.spare.weight, start.spare.weight)
        assert torch.count_nonzero(model.spare.weight.grad) == 0


def test_server_optimizer_pulls_the_servers_weights(addresses):
    """Ranks seeded differently start from rank 0's weights; the servers run SGD on the mean
    (rescale_grad 1/N by default); the wrapped optimizer's update never runs (its huge
    learning rate would show)."""
    models = [make_net(seed=rank) for rank in range(WORKERS)]
    start = copy.deepcopy(models[0])

    def rank_job(rank: int):
        model = models[rank]
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=1000.0),
                model.named_parameters(),
                kv=kv,
                bucket_plan={"bucket_bytes": 1024},
                server_optimizer=("sgd", {"learning_rate": 0.1}),
            )
            started = params_of(model)
            for step in range(STEPS):
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()
            with pytest.raises(UsageError, match="fixed"):
                opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
            return started

    started = run_ranks(WORKERS, rank_job)
    assert_same(started[0], params_of(start))
    assert_same(started[1], params_of(start))
    expected = params_of(reference(start, STEPS, momentum=0.0))
    for model in models:
        assert_same(params_of(model), expected, exact=False)  # (the servers' w - lr * g)
    assert_same(params_of(models[0]), params_of(models[1]))


def test_compressed_pushes_keep_the_workers_identical(addresses):
    start = make_net()
    models = [copy.deepcopy(start) for _ in range(WORKERS)]
    results = train(
        addresses,
        models,
        compression={"type": "2bit", "threshold": 0.01},
        bucket_plan={"bucket_bytes": 4096},
    )
    assert_same(params_of(models[0]), params_of(models[1]))
    assert not torch.equal(models[0].out.weight, start.out.weight)
    for _, stats in results:
        assert stats.compression_ratio > 10


def test_state_dict_round_trip_resumes_the_same_run(addresses):
    """Model and optimizer state saved after two steps and loaded into fresh objects in a new
    job continue exactly as the job that went on."""
    start = make_net()
    first = [copy.deepcopy(start) for _ in range(WORKERS)]
    second = [copy.deepcopy(start) for _ in range(WORKERS)]
    saved: list[dict] = [{} for _ in range(WORKERS)]

    def run(rank: int, model: Net, steps: range, load: dict | None = None, plan="none"):
        with connect(addresses, rank, WORKERS) as kv:
            opt = kvt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                model.named_parameters(),
                kv=kv,
                bucket_plan=plan,
            )
            if load is not None:
                model.load_state_dict(load["model"])
                opt.load_state_dict(load["optimizer"])
            for step in steps:
                if step == 2 and load is None:
                    saved[rank]["model"] = copy.deepcopy(model.state_dict())
                    saved[rank]["optimizer"] = copy.deepcopy(opt.state_dict())
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()
            if load is not None:
                with pytest.raises(ValueError, match="other parameters or buckets"):
                    wrong = copy.deepcopy(load["optimizer"])
                    wrong["kvstore"]["buckets"] = wrong["kvstore"]["buckets"][::-1]
                    opt.load_state_dict(wrong)

    run_ranks(WORKERS, lambda rank: run(rank, first[rank], range(4)))
    assert saved[0]["optimizer"]["state"], "momentum buffers are saved"
    assert saved[0]["optimizer"]["kvstore"]["buckets"][0] == ["spare.bias"]
    run_ranks(WORKERS, lambda rank: run(rank, second[rank], range(2, 4), saved[rank]))
    for a, b in zip(first, second, strict=True):
        assert_same(params_of(a), params_of(b))


def test_the_documented_checkpoint_recipe_resumes_compressed_training_exactly(addresses, tmp_path):
    """2-bit residuals on the workers and SGD momentum on the servers live in the store:
    ``kv.save_checkpoint`` / ``load_checkpoint`` beside the model's and the wrapper's state
    dicts resume the run bit for bit (docs/torch.md, "Checkpoints")."""
    start = make_net()
    first = [copy.deepcopy(start) for _ in range(WORKERS)]
    second = [make_net(seed=5) for _ in range(WORKERS)]
    saved: list[dict] = [{} for _ in range(WORKERS)]
    store = tmp_path / "store"

    def wrapper(model: Net, kv):
        return kvt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            kv=kv,
            compression={"type": "2bit", "threshold": 0.01},
            bucket_plan={"bucket_bytes": 1024},
            server_optimizer=("sgd", {"learning_rate": 0.1, "momentum": 0.9}),
        )

    def run(rank: int, model: Net, steps: range, resume: bool):
        with connect(addresses, rank, WORKERS) as kv:
            if resume:
                model.load_state_dict(saved[rank]["model"])
            opt = wrapper(model, kv)
            if resume:
                opt.load_state_dict(saved[rank]["optimizer"])
                kv.load_checkpoint(store)
            for step in steps:
                if step == 2 and not resume:
                    saved[rank]["model"] = copy.deepcopy(model.state_dict())
                    saved[rank]["optimizer"] = copy.deepcopy(opt.state_dict())
                    kv.save_checkpoint(store)
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()

    run_ranks(WORKERS, lambda rank: run(rank, first[rank], range(4), False))
    run_ranks(WORKERS, lambda rank: run(rank, second[rank], range(2, 4), True))
    for a, b in zip(first, second, strict=True):
        assert_same(params_of(a), params_of(b))
    assert not torch.equal(first[0].out.weight, start.out.weight)


def test_broadcast_makes_differently_seeded_workers_identical(addresses):
    """Parameters and buffers of every dtype (float, bfloat16, int64, bool) become rank 0's,
    on a second call too."""

    def model_of(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7))
        model[1].running_mean.normal_()
        model[1].num_batches_tracked.fill_(seed + 3)
        model.register_buffer("mask", torch.rand(4) > 0.5)
        model.register_buffer("brain", torch.randn(3).to(torch.bfloat16))
        return model

    models = [model_of(seed=11 + rank) for rank in range(WORKERS)]
    rank0 = params_of(models[0])
    assert not torch.equal(models[1][0].weight, models[0][0].weight)

    def rank_job(rank: int):
        with connect(addresses, rank, WORKERS) as kv:
            kvt.broadcast_parameters(models[rank], kv)
            first = params_of(models[rank])
            with torch.no_grad():
                models[rank][0].bias.add_(rank + 1)  # differ again
            kvt.broadcast_parameters(models[rank], kv)
            return first

    firsts = run_ranks(WORKERS, rank_job)
    for rank in range(WORKERS):
        assert_same(firsts[rank], rank0)
        assert_same(params_of(models[rank]), params_of(models[0]))
    assert models[1].brain.dtype == torch.bfloat16 and models[1].mask.dtype == torch.bool


def test_synchronize_buffers(addresses):
    def bn(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.BatchNorm1d(4)
        model(torch.randn(6, 4) * (seed + 1))  # running statistics of its own batch
        return model

    models = [bn(rank) for rank in range(WORKERS)]
    own = [params_of(m) for m in models]
    mean = {k: (own[0][k] + own[1][k]) / 2 for k in ("running_mean", "running_var")}

    def rank_job(rank: int):
        with connect(addresses, rank, WORKERS) as kv:
            kvt.synchronize_buffers(models[rank], kv, mode="average")
            averaged = params_of(models[rank])
            with torch.no_grad():
                models[rank].running_mean.fill_(rank)
                models[rank].num_batches_tracked.fill_(7 + rank)
            kvt.synchronize_buffers(models[rank], kv, mode="average")  # the keys again
            again = params_of(models[rank])
            kvt.synchronize_buffers(models[rank], kv, mode="rank0")
            with pytest.raises(ValueError, match="unknown mode"):
                kvt.synchronize_buffers(models[rank], kv, mode="median")
            return averaged, again

    for rank, (averaged, again) in enumerate(run_ranks(WORKERS, rank_job)):
        for k, value in mean.items():
            torch.testing.assert_close(averaged[k], value)
        assert averaged["num_batches_tracked"] == 1  # rank 0's (equal anyway)
        assert torch.equal(again["running_mean"], torch.full((4,), 0.5))
        assert again["num_batches_tracked"] == 7  # integers: rank 0's
        # parameters are not buffers: untouched
        assert torch.equal(averaged["weight"], own[rank]["weight"])
    assert_same(params_of(models[0]), params_of(models[1]))


def test_misuse_is_refused_before_anything_is_sent(addresses):
    model = make_net()
    with connect(addresses, 0, WORKERS, mode="dist_async") as kv:
        with pytest.raises(UsageError, match="server_optimizer"):
            kvt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), kv=kv
            )
        with pytest.raises(UsageError, match="dist_sync"):
            kvt.DDPHookState(kv)
    with connect(addresses, 0, WORKERS) as kv:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match="not in named_parameters"):
            kvt.DistributedOptimizer(sgd, list(model.named_parameters())[:2], kv=kv)
        with pytest.raises(ValueError, match="backward_passes_per_step"):
            kvt.DistributedOptimizer(sgd, kv=kv, backward_passes_per_step=0)
        with pytest.raises(ValueError, match="unknown bucket_plan"):
            kvt.DistributedOptimizer(sgd, kv=kv, bucket_plan="fancy")
        with pytest.raises(TypeError, match="server_optimizer"):
            kvt.DistributedOptimizer(sgd, kv=kv, server_optimizer=("sgd", 0.1))
        with pytest.raises(TypeError, match="already a DistributedOptimizer"):
            kvt.DistributedOptimizer(
                kvt.DistributedOptimizer.__new__(kvt.DistributedOptimizer), kv=kv
            )
