"""The MGS bucket planner (``kvstore.torch.mgs``): cost models, the pipeline timeline, the greedy
merge decision of OMGS-SGD and the plans it is compared with. Pure functions, no torch.

Hand-worked cases use round numbers: a bucket of ``n`` elements costs ``t_c(n) = alpha +
beta * n`` to send (``bytes_per_element = 1``) and ``t_s(n) = a_s + b_s * n`` to sparsify; layers
are listed in backward order (layer 0's gradient is produced first)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from kvstore.torch.mgs import (
    CommCost,
    Layer,
    SparsifyCost,
    fit_affine,
    fixed_buckets,
    greedy_merge,
    layers_from,
    no_buckets,
    one_bucket,
    plan_buckets,
    simulate,
    timeline,
)

REPO = Path(__file__).resolve().parents[2]

# t_c(1000) = 4, t_c(2000) = 5, t_c(3000) = 6: merging saves alpha = 3 per message.
COMM = CommCost(alpha=3.0, beta=0.001, bytes_per_element=1.0)
FREE_SPARSIFY = SparsifyCost(a_s=0.0, b_s=0.0)


def layers(numels: list[int], backward: list[float]) -> list[Layer]:
    return layers_from(numels, backward)


def plans(ls: list[Layer], comm: CommCost, sparsify: SparsifyCost) -> dict[str, float]:
    return {
        "greedy": simulate(ls, greedy_merge(ls, comm, sparsify), comm, sparsify),
        "plan": simulate(ls, plan_buckets(ls, comm, sparsify), comm, sparsify),
        "none": simulate(ls, no_buckets(ls), comm, sparsify),
        "all": simulate(ls, one_bucket(ls), comm, sparsify),
    }


# --- hand-worked cases ---------------------------------------------------------------------


def test_short_backward_steps_are_merged_into_one_bucket():
    ls = layers([1000, 1000, 1000], [1.0, 1.0, 1.0])
    # boundary 0|1: G = {0} ready at 1, link idle (slack 0): t_wait = t_b(1) = 1 < t_save = 3
    # boundary 1|2: G = {0, 1} ready at 2, slack 0:          t_wait = t_b(2) = 1 < 3
    assert greedy_merge(ls, COMM, FREE_SPARSIFY) == [[0, 1, 2]]
    assert plan_buckets(ls, COMM, FREE_SPARSIFY) == [[0, 1, 2]]
    # one bucket: ready at 3, t_c(3000) = 6 -> 9
    # no merging: ready at 1, 2, 3; sent 1-5, 5-9, 9-13 -> 13
    assert plans(ls, COMM, FREE_SPARSIFY) == pytest.approx(
        {"greedy": 9.0, "plan": 9.0, "none": 13.0, "all": 9.0}
    )


def test_a_long_backward_step_closes_the_bucket_before_it():
    ls = layers([1000, 1000, 1000], [1.0, 10.0, 1.0])
    # boundary 0|1: G = {0} ready at 1, slack 0: t_wait = t_b(1) = 10 >= 3 -> close {0}
    #   {0} is sent 1-5 (t_c(1000) = 4)
    # boundary 1|2: G = {1} ready at 11, link free at 5, slack 0: t_wait = 1 < 3 -> merge
    assert greedy_merge(ls, COMM, FREE_SPARSIFY) == [[0], [1, 2]]
    assert plan_buckets(ls, COMM, FREE_SPARSIFY) == [[0], [1, 2]]
    # greedy: {1, 2} ready at 12, sent 12-17 (t_c(2000) = 5) -> 17
    # none: 1-5, ready 11 sent 11-15, ready 12 sent 15-19 -> 19
    # all: ready at 12, t_c(3000) = 6 -> 18
    assert plans(ls, COMM, FREE_SPARSIFY) == pytest.approx(
        {"greedy": 17.0, "plan": 17.0, "none": 19.0, "all": 18.0}
    )
    t = timeline(ls, [[0], [1, 2]], COMM, FREE_SPARSIFY)
    assert t.payload_ready == [1.0, 12.0] and t.comm_start == [1.0, 12.0]
    assert t.comm_end == [5.0, 17.0] and t.exposed_comm == pytest.approx(5.0)


def test_a_payload_that_waits_for_the_link_anyway_is_merged_despite_a_long_backward():
    # t_c(8000) = 11
    ls = layers([8000, 1000, 1000], [1.0, 5.0, 5.0])
    # boundary 0|1: G = {0} ready at 1, slack 0: t_wait = 5 >= 3 -> close; {0} sent 1-12
    # boundary 1|2: G = {1} ready at 6, the link is busy until 12: slack 6,
    #   t_wait = t_b(2) - slack = 5 - 6 = -1 < 3 -> merge (without the slack term: 5 >= 3)
    assert greedy_merge(ls, COMM, FREE_SPARSIFY) == [[0], [1, 2]]
    # greedy: {1, 2} ready at 11, sent 12-17 -> 17
    # none: 1-12; ready 6 sent 12-16; ready 11 sent 16-20 -> 20
    # all: ready at 11, t_c(10000) = 13 -> 24
    assert plans(ls, COMM, FREE_SPARSIFY) == pytest.approx(
        {"greedy": 17.0, "plan": 17.0, "none": 20.0, "all": 24.0}
    )


def test_the_sparsifiers_fixed_cost_tips_the_decision():
    comm = CommCost(alpha=1.0, beta=0.001, bytes_per_element=1.0)  # t_c(1000) = 2, (2000) = 3
    ls = layers([1000, 1000], [1.0, 2.5])
    with_fixed_cost = SparsifyCost(a_s=2.0, b_s=0.001)  # t_s(1000) = 3, t_s(2000) = 4
    # G = {0} ready at 1 + 3 = 4, slack 0:
    #   t_wait = 2.5 + t_s(2000) - 2 t_s(1000) = 2.5 + 4 - 6 = 0.5 < t_save = 1 -> merge
    assert greedy_merge(ls, comm, with_fixed_cost) == [[0, 1]]
    # merged: backward 3.5, sparsify 4 -> ready 7.5, sent 7.5-10.5
    # none: backward 0-1, sparsify 1-4, sent 4-6; backward 4-6.5, sparsify 6.5-9.5, sent 9.5-11.5
    assert plans(ls, comm, with_fixed_cost) == pytest.approx(
        {"greedy": 10.5, "plan": 10.5, "none": 11.5, "all": 10.5}
    )
    # The same per-layer sparsify time with no fixed part: t_wait = 2.5 >= 1 -> no merging.
    linear = SparsifyCost(a_s=0.0, b_s=0.003)  # t_s(1000) = 3, t_s(2000) = 6
    assert greedy_merge(ls, comm, linear) == [[0], [1]]
    # none: 11.5 as above; merged: backward 3.5, sparsify 6 -> ready 9.5, sent 9.5-12.5
    assert plans(ls, comm, linear) == pytest.approx(
        {"greedy": 11.5, "plan": 11.5, "none": 11.5, "all": 12.5}
    )


def test_simulate_follows_the_papers_recurrence_with_merged_layers_zeroed():
    """§8.3 of the reference, written as the paper does: layers 1..L in forward order, a
    merged group's sizes and times moved into its earliest layer (the last one computed) and
    the others zeroed."""
    rng = random.Random(7)
    for _ in range(200):
        count = rng.randint(1, 8)
        ls = [Layer(rng.randint(0, 5000), rng.uniform(0, 2)) for _ in range(count)]
        cut = [rng.random() < 0.5 for _ in range(count - 1)]
        groups: list[list[int]] = [[0]]
        for i in range(1, count):
            (groups.append([i]) if cut[i - 1] else groups[-1].append(i))
        comm = CommCost(rng.uniform(0, 2), rng.uniform(0, 1e-3), 1.0)
        sparsify = SparsifyCost(rng.uniform(0, 1), rng.uniform(0, 1e-3))
        assert simulate(ls, groups, comm, sparsify) == pytest.approx(
            _paper_recurrence(ls, groups, comm, sparsify), rel=1e-12, abs=1e-12
        )


def _paper_recurrence(ls, groups, comm, sparsify) -> float:
    big_l = len(ls)
    # forward index f = 1..L (the paper's l) is backward index L - f
    p, t_b, active = [0] * (big_l + 1), [0.0] * (big_l + 1), [False] * (big_l + 1)
    for group in groups:
        last = big_l - group[-1]  # the group's last-computed layer, forward index
        p[last] = sum(ls[i].numel for i in group)
        t_b[last] = sum(ls[i].backward_seconds for i in group)
        active[last] = True
    t_s = [sparsify.seconds(p[f]) if active[f] else 0.0 for f in range(big_l + 1)]
    t_c = [comm.seconds(p[f]) if active[f] else 0.0 for f in range(big_l + 1)]
    tau_b, tau_s, tau_c = [0.0] * (big_l + 2), [0.0] * (big_l + 1), [0.0] * (big_l + 1)
    # zeroed layers of a group take no time, so the group's backward runs in its last slot
    for f in range(big_l, 0, -1):
        tau_s[f] = tau_b[f] + t_b[f]
        tau_b[f - 1] = tau_s[f] + t_s[f]
    tau_c[big_l] = tau_s[big_l] + t_s[big_l]
    for f in range(big_l - 1, 0, -1):
        tau_c[f] = max(tau_c[f + 1] + t_c[f + 1], tau_s[f] + t_s[f])
    return tau_c[1] + t_c[1]


# --- edge cases ----------------------------------------------------------------------------


def test_one_layer_is_one_bucket():
    ls = [Layer(1000, 2.0)]
    sparsify = SparsifyCost(0.5, 0.001)
    assert plan_buckets(ls, COMM, sparsify) == [[0]] == greedy_merge(ls, COMM, sparsify)
    assert simulate(ls, [[0]], COMM, sparsify) == pytest.approx(2.0 + 1.5 + 4.0)


def test_no_layers_is_no_buckets():
    assert plan_buckets([], COMM, FREE_SPARSIFY) == []
    assert simulate([], [], COMM, FREE_SPARSIFY) == 0.0
    assert fixed_buckets([], 100) == [] and one_bucket([]) == [] and no_buckets([]) == []


def test_free_communication_without_a_fixed_sparsify_cost_merges_nothing():
    free = CommCost(0.0, 0.0)
    ls = layers([10, 2000, 30, 400], [0.5, 1.0, 0.0, 2.0])
    sparsify = SparsifyCost(0.0, 0.001)
    assert plan_buckets(ls, free, sparsify) == no_buckets(ls)
    # the stream's work only: backward 3.5 plus sparsifying 2440 elements
    assert simulate(ls, no_buckets(ls), free, sparsify) == pytest.approx(3.5 + 2.44)


def test_free_communication_with_a_fixed_sparsify_cost_merges_everything():
    # Each bucket costs a_s on the compute stream and nothing else matters: one bucket is best,
    # but the greedy rule only merges where the next backward step is below a_s.
    free = CommCost(0.0, 0.0)
    ls = layers([10, 2000, 30, 400], [0.5, 1.0, 0.0, 2.0])
    sparsify = SparsifyCost(0.25, 0.001)
    assert greedy_merge(ls, free, sparsify) == [[0], [1, 2], [3]]  # t_b(2) = 0 < 0.25
    assert plan_buckets(ls, free, sparsify) == [[0, 1, 2, 3]]
    assert simulate(ls, [[0, 1, 2, 3]], free, sparsify) == pytest.approx(3.5 + 0.25 + 2.44)


def test_a_huge_start_up_latency_gives_one_bucket():
    rng = random.Random(3)
    for _ in range(50):
        ls = [Layer(rng.randint(1, 10**6), rng.uniform(0, 1e-2)) for _ in range(rng.randint(1, 30))]
        comm = CommCost(alpha=10.0, beta=1e-9)
        assert greedy_merge(ls, comm, SparsifyCost(1e-5, 1e-9)) == one_bucket(ls)
        assert plan_buckets(ls, comm, SparsifyCost(1e-5, 1e-9)) == one_bucket(ls)


def test_no_start_up_latency_and_no_fixed_sparsify_cost_merge_nothing_even_on_a_busy_link():
    # t_c(n) = n / 100: layer 0's message (80 s) keeps the link busy while the others are ready;
    # the paper's condition (t_wait = 1 - slack < t_save = 0) holds there, but the merge saves
    # nothing and is not taken.
    comm = CommCost(alpha=0.0, beta=0.01, bytes_per_element=1.0)
    ls = layers([8000, 1000, 1000], [1.0, 1.0, 1.0])
    assert greedy_merge(ls, comm, FREE_SPARSIFY) == [[0], [1], [2]]
    assert plan_buckets(ls, comm, FREE_SPARSIFY) == [[0], [1], [2]]
    # the link is the bottleneck either way: 1 + 80 + 10 + 10
    assert plans(ls, comm, FREE_SPARSIFY)["none"] == pytest.approx(101.0)


# --- properties ----------------------------------------------------------------------------


def _random_instance(rng: random.Random) -> tuple[list[Layer], CommCost, SparsifyCost]:
    count = rng.randint(1, 24)
    ls = [
        Layer(
            int(10 ** rng.uniform(0, 6.5)), rng.choice([0.0, 1.0, 1.0, 1.0]) * rng.uniform(0, 2e-3)
        )
        for _ in range(count)
    ]
    comm = CommCost(
        alpha=rng.choice([0.0, 1.0]) * 10 ** rng.uniform(-6, -2),
        beta=10 ** rng.uniform(-10, -7),
        bytes_per_element=rng.choice([4.0, 0.008, 0.064]),
    )
    sparsify = SparsifyCost(
        rng.choice([0.0, 1.0]) * 10 ** rng.uniform(-6, -3), 10 ** rng.uniform(-10, -8)
    )
    return ls, comm, sparsify


def test_the_plan_is_never_slower_than_no_merging_or_one_bucket():
    rng = random.Random(2024)
    for _ in range(400):
        ls, comm, sparsify = _random_instance(rng)
        groups = plan_buckets(ls, comm, sparsify)
        assert [i for g in groups for i in g] == list(range(len(ls)))
        # (the cost model's predictions, pure arithmetic: nothing here is timed)
        predicted = simulate(ls, groups, comm, sparsify)
        bound = min(simulate(ls, no_buckets(ls), comm, sparsify),
                    simulate(ls, one_bucket(ls), comm, sparsify))  # fmt: skip
        assert predicted <= bound * (1 + 1e-9), (ls, comm, sparsify, groups)


def test_the_greedy_groups_are_consecutive_and_cover_every_layer():
    rng = random.Random(11)
    for _ in range(200):
        ls, comm, sparsify = _random_instance(rng)
        groups = greedy_merge(ls, comm, sparsify)
        assert all(groups) and [i for g in groups for i in g] == list(range(len(ls)))


# --- fixed buckets, fits, validation -------------------------------------------------------


def test_fixed_buckets_close_once_they_hold_the_cap():
    ls = layers([100, 100, 300, 50, 50, 10], [0.0] * 6)  # 400, 400, 1200, 200, 200, 40 bytes
    assert fixed_buckets(ls, 800) == [[0, 1], [2], [3, 4, 5]]
    assert fixed_buckets(ls, 1) == no_buckets(ls)
    assert fixed_buckets(ls, 10**9) == one_bucket(ls)
    assert fixed_buckets(ls, 800, itemsize=2) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        fixed_buckets(ls, 0)


def test_fits_recover_the_constants_of_exact_measurements():
    comm = CommCost.fit([(1e3, 1e-4 + 1e3 * 8e-9), (1e6, 1e-4 + 1e6 * 8e-9), (1e5, 9e-4)], 0.008)
    assert comm.alpha == pytest.approx(1e-4) and comm.beta == pytest.approx(8e-9)
    assert comm.bytes_per_element == 0.008
    sparsify = SparsifyCost.fit([(n, 2e-5 + 3e-9 * n) for n in (1024, 65536, 1 << 20)])
    assert sparsify.a_s == pytest.approx(2e-5) and sparsify.b_s == pytest.approx(3e-9)


def test_a_fit_never_returns_a_negative_constant():
    # The unconstrained line through these has a negative intercept; the best line through
    # the origin is returned instead.
    intercept, slope = fit_affine([(1.0, 0.5), (2.0, 2.0), (3.0, 3.5)])
    assert intercept == 0.0 and slope == pytest.approx((0.5 + 4 + 10.5) / 14)
    # Times that fall with size: a flat line at their mean.
    assert fit_affine([(1.0, 3.0), (2.0, 1.0)]) == (2.0, 0.0)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_affine([(5.0, 1.0), (5.0, 2.0)])
    with pytest.raises(ValueError, match="finite"):
        fit_affine([(1.0, math.nan), (2.0, 1.0)])


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="numel"):
        Layer(-1, 0.0)
    with pytest.raises(ValueError, match="backward_seconds"):
        Layer(10, math.inf)
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        plan_buckets([Layer(1, 0.0), (1, 0.0)], COMM, FREE_SPARSIFY)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="alpha"):
        CommCost(-1.0, 0.0)
    with pytest.raises(ValueError, match="bytes_per_element"):
        CommCost(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="a_s"):
        SparsifyCost(math.nan, 0.0)
    ls = layers([1, 1, 1], [0.0] * 3)
    with pytest.raises(ValueError, match="group 1 has 0"):
        simulate(ls, [[0], [0, 1, 2]], COMM, FREE_SPARSIFY)
    with pytest.raises(ValueError, match="group 1 is empty"):
        simulate(ls, [[0], [], [1, 2]], COMM, FREE_SPARSIFY)
    with pytest.raises(ValueError, match="cover layers 0..1"):
        simulate(ls, [[0, 1]], COMM, FREE_SPARSIFY)
    with pytest.raises(ValueError, match="2 element counts but 1"):
        layers_from([1, 2], [0.0])
    with pytest.raises(ValueError, match="numel"):
        layers_from([2.5], [0.0])


def test_numpy_scalars_are_accepted_as_python_numbers():
    layer = Layer(np.int64(7), np.float32(0.5))
    assert layer == Layer(7, 0.5) and type(layer.numel) is int
    assert fixed_buckets([layer], np.int64(28)) == [[0]]


# --- the benchmark's data ------------------------------------------------------------------


def test_the_benchmarks_resnet50_shapes_are_complete():
    data = json.loads((REPO / "benchmarks/data/resnet50_param_shapes.json").read_text())
    numels = [math.prod(t["shape"]) for t in data["tensors"]]
    assert len(numels) == data["count"] == 161 and sum(numels) == data["total"] == 25_557_032


def test_the_benchmarks_plans_on_resnet50_with_stated_constants():
    from benchmarks.mgs_plan import compare_plans, resnet50_layers

    ls = resnet50_layers(backward_seconds=0.1)
    assert len(ls) == 161 and ls[0].numel == 1000  # backward order: the fc bias first
    rows = compare_plans(ls, CommCost.for_link(1e9, 2e-4, 0.064), SparsifyCost(2e-5, 3e-9))
    by_plan = {row["plan"]: row for row in rows}
    assert by_plan["none"]["keys"] == 161
    assert by_plan["mgs"]["keys"] < 161
    assert by_plan["mgs"]["simulated_ms"] <= by_plan["none"]["simulated_ms"]
