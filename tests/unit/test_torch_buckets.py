"""Bucket plans of kvstore.torch (no store needed): fixed-size merging, the planner protocol,
the checks on what a planner returns, and bucket_plan="mgs"'s lazy import."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvstore.torch import buckets


def tensors(*numels: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype) for n in numels]


def test_none_is_one_bucket_per_parameter():
    assert buckets.resolve("none")(tensors(3, 4, 5)) == [[0], [1], [2]]


def test_bucket_bytes_merges_neighbours_up_to_the_size():
    params = tensors(10, 10, 30, 100, 1, 1)  # 40, 40, 120, 400, 4, 4 bytes
    assert buckets.fixed_size(params, 80) == [[0, 1], [2], [3], [4, 5]]
    assert buckets.fixed_size(params, 10_000) == [[0, 1, 2, 3, 4, 5]]
    assert buckets.fixed_size(params, 1) == [[i] for i in range(6)]
    mixed = [*tensors(2, 2), *tensors(2, dtype=torch.float64), *tensors(2)]
    assert buckets.fixed_size(mixed, 1000) == [[0, 1], [2], [3]]
    assert buckets.resolve({"bucket_bytes": 80})(params) == [[0, 1], [2], [3], [4, 5]]


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "8"])
def test_bad_bucket_bytes(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        buckets.resolve({"bucket_bytes": bad})


@pytest.mark.parametrize(
    "spec, error, match",
    [
        ("fancy", ValueError, "unknown bucket_plan 'fancy'"),
        ({"bucket_bytes": 8, "x": 1}, ValueError, "exactly one entry"),
        (42, TypeError, "bucket_plan must be"),
    ],
)
def test_bad_specs(spec, error, match):
    with pytest.raises(error, match=match):
        buckets.resolve(spec)


@pytest.mark.parametrize(
    "plan, match",
    [
        ([[0, 1], []], "empty bucket"),
        ([[0, 1], [1, 2]], "puts parameter 'b' twice"),
        ([[0, 1]], r"leaves out parameters \['c'\]"),
        ([[0, 1, 2, 3]], "index 3"),
        ([["a"], [1, 2]], "list of lists of indices"),
    ],
)
def test_a_planner_must_return_a_partition(plan, match):
    with pytest.raises(ValueError, match=match):
        buckets.make_plan(lambda params: plan, tensors(1, 2, 3), ["a", "b", "c"])


def test_a_bucket_keeps_one_dtype():
    params = [*tensors(2), *tensors(2, dtype=torch.float16)]
    with pytest.raises(ValueError, match="share dtype and device"):
        buckets.make_plan(lambda p: [[0, 1]], params, ["w", "h"])


def test_mgs_without_its_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, buckets.MGS_MODULE, None)
    with pytest.raises(ImportError, match="bucket_plan='mgs' needs .*plan_parameters"):
        buckets.resolve("mgs")


def test_mgs_calls_the_module_planner_by_the_protocol(monkeypatch):
    module = types.ModuleType(buckets.MGS_MODULE)
    module.plan_parameters = lambda params: [list(range(len(params)))]
    monkeypatch.setitem(sys.modules, buckets.MGS_MODULE, module)
    assert buckets.make_plan("mgs", tensors(1, 2), ["a", "b"]) == [[0, 1]]

    def cost_model_planner(layers, comm, sparsify):
        return []

    module.plan_parameters = cost_model_planner
    with pytest.raises(TypeError, match="does not follow the planner protocol"):
        buckets.resolve("mgs")
    del module.plan_parameters
    with pytest.raises(ImportError, match="no function plan_parameters"):
        buckets.resolve("mgs")


def test_mgs_merges_a_model_of_many_small_tensors():
    # ResNet-like tail: many small tensors (biases, norms) between two big ones; with a per
    # message cost the real planner must not give each its own key.
    params = [*tensors(1000, 64, 64, 64, 64, 64, 64, 64), *tensors(100_000)]
    plan = buckets.make_plan("mgs", params, [f"p{i}" for i in range(len(params))])
    assert sorted(i for bucket in plan for i in bucket) == list(range(len(params)))
    assert len(plan) < len(params)
