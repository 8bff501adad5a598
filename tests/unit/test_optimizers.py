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
        "momentum_every": 1,
        "wd": 0.0,
        "rescale_grad": 1.0,
        "clip_gradient": None,
    }
    assert make_optimizer_spec("adam").params["epsilon"] == 1e-8
    assert optimizer_names() == ["adam", "dcasgd", "sgd"]
    assert make_optimizer_spec("dcasgd").params == {
        "learning_rate": 0.01,
        "momentum": 0.0,
        "lamda": 0.04,
        "wd": 0.0,
        "rescale_grad": 1.0,
        "clip_gradient": None,
    }


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("rmsprop", {}, "unknown optimizer 'rmsprop'; available: adam, dcasgd, sgd"),
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
        ("sgd", {"momentum_every": 0, "nesterov": True}, "momentum_every must be >= 1, got 0"),
        ("sgd", {"momentum_every": -2, "nesterov": True}, "momentum_every must be >= 1"),
        ("sgd", {"momentum_every": 2.0, "nesterov": True}, "momentum_every must be an int"),
        ("sgd", {"momentum_every": True, "nesterov": True}, "momentum_every must be an int"),
        ("sgd", {"momentum_every": "2", "nesterov": True}, "momentum_every must be an int"),
        ("sgd", {"momentum_every": 2}, "momentum_every=2 needs nesterov=True"),
        ("sgd", {"momentum_every": 2, "momentum": 0.9}, "momentum_every=2 needs nesterov=True"),
        ("sgd", {"lamda": 0.1}, r"no hyperparameter\(s\) \['lamda'\]"),
        ("dcasgd", {"lamda": -0.1}, "lamda must be >= 0"),
        ("dcasgd", {"lamda": float("inf")}, "lamda must be finite"),
        ("dcasgd", {"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ("dcasgd", {"nesterov": True}, r"no hyperparameter\(s\) \['nesterov'\]"),
        ("dcasgd", {"learning_rate": -1}, "learning_rate must be >= 0"),
        ("dcasgd", {"clip_gradient": -1.0}, "clip_gradient must be > 0"),
        (3, {}, "expected str for optimizer name"),
    ],
)
def test_bad_hyperparameters(name, params, match):
    with pytest.raises(OptimizerError, match=match):
        make_optimizer_spec(name, params)


def test_momentum_every_accepts_numpy_integers_and_stays_a_python_int():
    spec = make_optimizer_spec("sgd", {"momentum_every": np.int64(4), "nesterov": True})
    assert spec["momentum_every"] == 4 and type(spec["momentum_every"]) is int


# delayed Nesterov ------------------------------------------------------------------------------


def _delayed_nesterov_reference(w0, grads, every, lr, momentum, wd, rescale, clip):
    """numpy float32, one update at a time, straight from the formula."""
    w, mom, buf = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    lr, momentum, wd, rescale = f32(lr), f32(momentum), f32(wd), f32(rescale)
    for count, g in enumerate(grads, start=1):
        gi = _clip(rescale * g, clip) + wd * w
        buf = buf + gi
        if count % every != 0:
            w = w - lr * gi
        else:
            mom = momentum * mom + buf
            buf = np.zeros_like(buf)
            w = w - lr * (gi + momentum * mom)
    return w, mom, buf


@pytest.mark.parametrize("out_of_place", [False, True])
@pytest.mark.parametrize("clip", [None, 1.5])
@pytest.mark.parametrize("every", [2, 3])
def test_delayed_nesterov_matches_reference(every, clip, out_of_place):
    p = dict(
        learning_rate=0.05,
        momentum=0.9,
        nesterov=True,
        momentum_every=every,
        wd=1e-3,
        rescale_grad=0.5,
        clip_gradient=clip,
    )
    w0, grads, w = _run("sgd", p, steps=7, out_of_place=out_of_place)
    ref, _, _ = _delayed_nesterov_reference(w0, grads, every, 0.05, 0.9, 1e-3, 0.5, clip)
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_momentum_every_one_is_nag_bit_for_bit(clip):
    nag = dict(learning_rate=0.05, momentum=0.9, nesterov=True, wd=1e-3, clip_gradient=clip)
    _, _, expected = _run("sgd", nag)
    _, _, got = _run("sgd", {**nag, "momentum_every": 1})
    assert got.tobytes() == expected.tobytes()


def test_delayed_nesterov_over_n_arrivals_is_one_nag_step_with_their_mean():
    """N updates of Δ_i/N from the same weights (rescale_grad = 1/N), momentum_every=N: after
    each cycle the weights are those of ONE NAG step with the mean of the Δ_i, momentum carried
    from cycle to cycle (float32: the N partial steps and the single step round differently)."""
    n, size, cycles = 4, 301, 3
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal(size).astype(np.float32)
    delayed = make_optimizer(
        make_optimizer_spec(
            "sgd",
            dict(
                learning_rate=0.7, momentum=0.9, nesterov=True, momentum_every=n, rescale_grad=1 / n
            ),
        )
    )
    nag = make_optimizer(
        make_optimizer_spec("sgd", dict(learning_rate=0.7, momentum=0.9, nesterov=True))
    )
    w, delayed_state = w0.copy(), delayed.new_state(size, w0.dtype)
    w_nag, nag_state = w0.copy(), nag.new_state(size, w0.dtype)
    for _ in range(cycles):
        deltas = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
        for delta in deltas:
            delayed.step(w, w, delta, delayed_state)
        mean = np.mean(np.stack(deltas).astype(np.float64), axis=0).astype(np.float32)
        nag.step(w_nag, w_nag, mean, nag_state)
        np.testing.assert_allclose(w, w_nag, rtol=1e-5, atol=2e-6)
        np.testing.assert_allclose(delayed_state["mom"], nag_state["mom"], rtol=1e-5, atol=2e-6)
        assert not delayed_state["buf"].any()
    assert delayed_state["count"] == n * cycles


def test_changing_momentum_every_keeps_the_cycle_going():
    spec = dict(learning_rate=0.1, momentum=0.5, nesterov=True, momentum_every=3)
    three = make_optimizer(make_optimizer_spec("sgd", spec))
    one = make_optimizer(make_optimizer_spec("sgd", {**spec, "momentum_every": 1}))
    rng = np.random.default_rng(1)
    w = rng.standard_normal(9).astype(np.float32)
    state = three.new_state(9, w.dtype)
    grads = [rng.standard_normal(9).astype(np.float32) for _ in range(3)]
    three.step(w, w, grads[0], state)
    one.step(w, w, grads[1], state)  # plain NAG: the delayed entries are left as they were
    assert state["count"] == 1
    np.testing.assert_array_equal(state["buf"], grads[0])
    three.step(w, w, grads[2], state)
    assert state["count"] == 2


# dcasgd ----------------------------------------------------------------------------------------


def _dcasgd_reference(w0, grads, lr, momentum, lamda, wd, rescale, clip):
    """numpy float32, MXNet's update one step at a time."""
    w, prev, mom = w0.copy(), w0.copy(), np.zeros_like(w0)
    lr, momentum, lamda, wd, rescale = f32(lr), f32(momentum), f32(lamda), f32(wd), f32(rescale)
    for g in grads:
        g = _clip(rescale * g, clip)
        d = -lr * (g + wd * w + lamda * g * g * (w - prev))
        if momentum > 0:
            mom = momentum * mom + d
            d = mom
        prev = w
        w = w + d
    return w, prev, mom


@pytest.mark.parametrize("out_of_place", [False, True])
@pytest.mark.parametrize("clip", [None, 2.0])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dcasgd_matches_reference(momentum, clip, out_of_place):
    p = dict(
        learning_rate=0.1,
        momentum=momentum,
        lamda=0.5,
        wd=1e-2,
        rescale_grad=0.5,
        clip_gradient=clip,
    )
    w0, grads, w = _run("dcasgd", p, out_of_place=out_of_place)
    ref, _, _ = _dcasgd_reference(w0, grads, 0.1, momentum, 0.5, 1e-2, 0.5, clip)
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-6)


def test_dcasgd_state_prev_is_the_weights_before_the_last_update():
    optimizer = make_optimizer(make_optimizer_spec("dcasgd", {"momentum": 0.5}))
    w = np.array([1.0, -2.0, 3.0], np.float32)
    state = optimizer.new_state(3, w.dtype)
    assert state == {"prev": None, "mom": None}  # made at the first update, from the weights
    before, g = w.copy(), np.array([0.5, 0.5, -1.0], np.float32)
    optimizer.step(w, w, g, state)
    np.testing.assert_array_equal(state["prev"], before)
    np.testing.assert_array_equal(state["mom"], -f32(0.01) * g)  # momentum starts from zero
    np.testing.assert_array_equal(w, before + state["mom"])
    assert state["prev"] is not w


def test_dcasgd_first_update_has_no_compensation_and_lamda_zero_is_sgd():
    """prev starts equal to the weights, so the first update is plain SGD whatever lamda is;
    with lamda=0 every update is MXNet's SGD."""
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal(50).astype(np.float32)
    grads = [rng.standard_normal(50).astype(np.float32) for _ in range(4)]
    for lamda, steps in [(5.0, 1), (0.0, 4)]:
        dcasgd = make_optimizer(make_optimizer_spec("dcasgd", {"lamda": lamda, "lr": 0.1}))
        sgd = make_optimizer(make_optimizer_spec("sgd", {"lr": 0.1}))
        a, b = w0.copy(), w0.copy()
        sa, sb = dcasgd.new_state(50, a.dtype), sgd.new_state(50, b.dtype)
        for g in grads[:steps]:
            dcasgd.step(a, a, g, sa)
            sgd.step(b, b, g, sb)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_dcasgd_float64_weights_update_in_float64():
    optimizer = make_optimizer(make_optimizer_spec("dcasgd", {"learning_rate": 0.1}))
    w = np.ones(3, np.float64)
    state = optimizer.new_state(3, w.dtype)
    optimizer.step(w, w, np.full(3, 1e-9), state)
    assert w[0] == 1 - 1e-10 and state["prev"].dtype == np.float64


# checkpoint round trip of the state --------------------------------------------------------------


def _saved(state):
    """What a checkpoint keeps of a state (``ChunkState.checkpoint_state``): its arrays, as
    read back from the file (copies), and its int counters."""
    arrays = {k: v.copy() for k, v in state.items() if isinstance(v, np.ndarray)}
    scalars = {k: v for k, v in state.items() if isinstance(v, int)}
    return arrays, scalars


@pytest.mark.parametrize(
    "name, params, names",
    [
        ("dcasgd", {"momentum": 0.9, "lamda": 0.3}, {"prev", "mom"}),
        ("dcasgd", {"lamda": 0.3}, {"prev"}),
        ("sgd", {"momentum": 0.9, "nesterov": True, "momentum_every": 3}, {"mom", "buf"}),
        ("sgd", {"momentum": 0.9, "nesterov": True}, {"mom"}),
    ],
)
def test_state_round_trips_through_import_state(name, params, names):
    optimizer = make_optimizer(make_optimizer_spec(name, params))
    rng = np.random.default_rng(5)
    w = rng.standard_normal(33).astype(np.float32)
    grads = [rng.standard_normal(33).astype(np.float32) for _ in range(9)]
    state = optimizer.new_state(33, w.dtype)
    for g in grads[:4]:
        optimizer.step(w, w, g, state)
    arrays, scalars = _saved(state)
    assert set(arrays) == names
    assert scalars == ({"count": 4} if "buf" in names else {})
    restored = optimizer.import_state(arrays, scalars, 33, np.dtype(np.float32), "key 'w'")
    for array in arrays.values():
        array[:] = np.nan  # the restored state holds copies
    resumed = w.copy()
    for g in grads[4:]:
        optimizer.step(w, w, g, state)
        optimizer.step(resumed, resumed, g, restored)
    assert resumed.tobytes() == w.tobytes()


def test_an_sgd_state_without_delayed_entries_imports_for_delayed_nesterov():
    """A checkpoint of plain NAG (no buf, no count) loads into momentum_every > 1: the delayed
    cycle starts there."""
    spec = {"momentum": 0.9, "nesterov": True, "momentum_every": 2}
    optimizer = make_optimizer(make_optimizer_spec("sgd", spec))
    mom = np.ones(4, np.float32)
    state = optimizer.import_state({"mom": mom}, {}, 4, np.dtype(np.float32), "key 'w'")
    assert state["buf"] is None and state["count"] is None
    w = np.zeros(4, np.float32)
    optimizer.step(w, w, np.ones(4, np.float32), state)
    assert state["count"] == 1


@pytest.mark.parametrize(
    "name, arrays, scalars, match",
    [
        ("sgd", {}, {"count": -1}, r"sgd state 'count' is -1"),
        ("sgd", {}, {"count": True}, r"sgd state 'count' is True"),
        ("sgd", {"buf": np.zeros(3, np.float64)}, {}, r"state 'buf' is float64\[3\]"),
        ("dcasgd", {"prev": np.zeros(2, np.float32)}, {}, r"state 'prev' is float32\[2\]"),
        ("dcasgd", {"velocity": np.zeros(3, np.float32)}, {}, r"no state named \['velocity'\]"),
        ("dcasgd", {}, {"t": 1}, r"no state named \['t'\]"),
    ],
)
def test_import_state_refuses_what_is_not_the_optimizers_state(name, arrays, scalars, match):
    optimizer = make_optimizer(
        make_optimizer_spec(name, {"nesterov": True} if name == "sgd" else {})
    )
    with pytest.raises(OptimizerError, match=match):
        optimizer.import_state(arrays, scalars, 3, np.dtype(np.float32), "key 'w'")
