"""Server optimizers against numpy float32 references, and hyperparameter validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvstore.errors import OptimizerError
from kvstore.optimizer_spec import make_optimizer_spec, optimizer_names
from kvstore.server.optimizers import make_optimizer

f32 = np.float32


def _run(name, params, steps=5, n=257, out_of_place=False, seed=0):
    rng = np.random.default_rng(seed)
    optimizer = make_optimizer(make_optimizer_spec(name, params))
    w = rng.standard_normal(n).astype(np.float32)
    state = optimizer.new_state(n, w.dtype)
    grads = [(rng.standard_normal(n) * 3).astype(np.float32) for _ in range(steps)]
    w0 = w.copy()
    for g in grads:
        if out_of_place:
            out = np.empty_like(w)
            optimizer.step(w, out, g, state)
            w = out
        else:
            optimizer.step(w, w, g, state)
    return w0, grads, w


def _clip(x, c):
    return x if c is None else np.clip(x, f32(-c), f32(c))


@pytest.mark.parametrize("out_of_place", [False, True])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_sgd_matches_reference(out_of_place, clip):
    p = dict(learning_rate=0.1, wd=0.01, rescale_grad=0.5, clip_gradient=clip)
    w0, grads, w = _run("sgd", p, out_of_place=out_of_place)
    ref = w0.copy()
    for g in grads:
        ref = (f32(1) - f32(0.1) * f32(0.01)) * ref - f32(0.1) * _clip(f32(0.5) * g, clip)
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("clip", [None, 2.0])
def test_sgd_momentum_matches_reference(clip):
    p = dict(learning_rate=0.05, momentum=0.9, wd=1e-3, rescale_grad=0.25, clip_gradient=clip)
    w0, grads, w = _run("sgd", p)
    ref, mom = w0.copy(), np.zeros_like(w0)
    lr, m, wd = f32(0.05), f32(0.9), f32(1e-3)
    for g in grads:
        mom = m * mom - lr * wd * ref - lr * _clip(f32(0.25) * g, clip)
        ref = ref + mom
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-7)


def test_nesterov_matches_reference():
    p = dict(learning_rate=0.05, momentum=0.9, nesterov=True, wd=1e-3)
    w0, grads, w = _run("sgd", p)
    ref, mom = w0.copy(), np.zeros_like(w0)
    lr, m, wd = f32(0.05), f32(0.9), f32(1e-3)
    for g in grads:
        gi = g + wd * ref
        mom = m * mom + gi
        ref = ref - lr * (gi + m * mom)
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_adam_matches_reference(clip):
    p = dict(learning_rate=0.01, beta1=0.8, beta2=0.99, epsilon=1e-6, wd=0.01, clip_gradient=clip)
    w0, grads, w = _run("adam", p)
    ref, mean, var = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    for t, g in enumerate(grads, start=1):
        gi = _clip(g + f32(0.01) * ref, clip)
        mean = f32(0.8) * mean + (f32(1) - f32(0.8)) * gi
        var = f32(0.99) * var + (f32(1) - f32(0.99)) * gi * gi
        lr_t = f32(0.01 * math.sqrt(1 - 0.99**t) / (1 - 0.8**t))
        ref = ref - lr_t * mean / (np.sqrt(var) + f32(1e-6))
    np.testing.assert_allclose(w, ref, rtol=2e-6, atol=1e-7)


def test_float64_weights_update_in_float64():
    optimizer = make_optimizer(make_optimizer_spec("sgd", {"learning_rate": 0.1}))
    w = np.ones(3, np.float64)
    optimizer.step(w, w, np.full(3, 1e-9), optimizer.new_state(3, w.dtype))
    assert w[0] == 1 - 1e-10


def test_defaults_and_alias():
    spec = make_optimizer_spec("SGD", {"lr": 0.3})
    assert spec.name == "sgd"
    assert spec.params == {
        "learning_rate": 0.3,
        "momentum": 0.0,
        "nesterov": False,
        "wd": 0.0,
        "rescale_grad": 1.0,
        "clip_gradient": None,
    }
    assert make_optimizer_spec("adam").params["epsilon"] == 1e-8
    assert optimizer_names() == ["adam", "sgd"]


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("rmsprop", {}, "unknown optimizer 'rmsprop'; available: adam, sgd"),
        ("sgd", {"learning_rat": 0.1}, r"no hyperparameter\(s\) \['learning_rat'\]"),
        ("sgd", {"learning_rate": -0.1}, "learning_rate must be >= 0"),
        ("sgd", {"learning_rate": "0.1"}, "learning_rate must be a number"),
        ("sgd", {"learning_rate": float("nan")}, "must be finite"),
        ("sgd", {"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ("sgd", {"nesterov": 1}, "nesterov must be True or False"),
        ("sgd", {"clip_gradient": 0}, "clip_gradient must be > 0"),
        ("sgd", {"lr": 0.1, "learning_rate": 0.1}, "not both"),
        ("adam", {"beta2": 1.5}, "beta2 must be in"),
        ("adam", {"epsilon": 0}, "epsilon must be > 0"),
        (3, {}, "expected str for optimizer name"),
    ],
)
def test_bad_hyperparameters(name, params, match):
    with pytest.raises(OptimizerError, match=match):
        make_optimizer_spec(name, params)
