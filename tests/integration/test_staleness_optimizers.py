"""The staleness-aware server optimizers in a real ``dist_async`` job (2 servers, 2 workers).

``dcasgd`` and delayed Nesterov (``sgd`` with ``momentum_every=2, nesterov=True``) depend on the
order in which pushes arrive, so the workers take turns: at step ``s`` rank ``s % 2`` pushes a
known gradient and both then meet at a barrier, which returns once the push is applied. The
pulled values must equal a numpy float32 oracle that applies the same gradients in the same
order. Half-way the job saves a checkpoint, runs on, loads it (rolling the servers back,
optimizer state included) and runs the same steps again: the second run must give the same
bits as the first.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import connect, run_ranks

pytestmark = pytest.mark.integration

f32 = np.float32
N = 2
BIGARRAY_BOUND = 1000  # "split" (2500 elements) is cut into chunks on both servers
KEYS = {"whole": 37, "split": 2500}
STEPS, SAVE_AFTER = 7, 3  # saved after an odd number of updates: mid-cycle for momentum_every=2


def _init(name: str) -> np.ndarray:
    return np.linspace(-1, 1, KEYS[name], dtype=np.float32)


def _grad(step: int, name: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * step + KEYS[name])
    return rng.normal(0, 1, KEYS[name]).astype(np.float32)


def _dcasgd_oracle(w, grads, lr, momentum, lamda, rescale):
    """MXNet's dcasgd (wd = 0, no clipping), one update per push in arrival order."""
    lr, momentum, lamda, rescale = f32(lr), f32(momentum), f32(lamda), f32(rescale)
    prev, mom = w.copy(), np.zeros_like(w)
    for g in grads:
        g = rescale * g
        mom = momentum * mom + -lr * (g + lamda * g * g * (w - prev))
        prev, w = w, w + mom
    return w


def _delayed_nesterov_oracle(w, grads, every, lr, momentum, rescale):
    """sgd with nesterov=True and momentum_every (wd = 0, no clipping), in arrival order."""
    lr, momentum, rescale = f32(lr), f32(momentum), f32(rescale)
    mom, buf = np.zeros_like(w), np.zeros_like(w)
    for count, g in enumerate(grads, start=1):
        g = rescale * g
        buf = buf + g
        if count % every:
            w = w - lr * g
        else:
            mom, buf = momentum * mom + buf, np.zeros_like(buf)
            w = w - lr * (g + momentum * mom)
    return w


OPTIMIZERS = {
    "dcasgd": (
        {"learning_rate": 0.1, "momentum": 0.5, "lamda": 2.0, "rescale_grad": 0.5},
        lambda w, grads: _dcasgd_oracle(w, grads, 0.1, 0.5, 2.0, 0.5),
    ),
    "sgd": (
        {
            "learning_rate": 0.1,
            "momentum": 0.9,
            "nesterov": True,
            "momentum_every": 2,
            "rescale_grad": 0.5,
        },
        lambda w, grads: _delayed_nesterov_oracle(w, grads, 2, 0.1, 0.9, 0.5),
    ),
}


def _pull_all(kv) -> dict[str, np.ndarray]:
    outs = {name: np.empty(n, np.float32) for name, n in KEYS.items()}
    kv.pull(list(outs), out=list(outs.values()))
    return outs


def _take_turns(kv, rank: int, steps: range) -> None:
    """Rank ``s % 2`` pushes step ``s``'s gradients; the barrier returns once it is applied."""
    for step in steps:
        if step % N == rank:
            kv.push(list(KEYS), [_grad(step, name) for name in KEYS])
        kv.barrier()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_pushes_in_turn_match_the_oracle_and_a_loaded_checkpoint_replays_them(
    servers_factory, monkeypatch, tmp_path, optimizer
):
    monkeypatch.setenv("KVSTORE_BIGARRAY_BOUND", str(BIGARRAY_BOUND))
    addresses = servers_factory(2, N, env={"KVSTORE_BIGARRAY_BOUND": str(BIGARRAY_BOUND)})
    params, oracle = OPTIMIZERS[optimizer]
    ckpt = tmp_path / "ckpt"

    def worker(rank: int):
        with connect(addresses, rank, N, mode="dist_async") as kv:
            kv.set_optimizer(optimizer, **params)
            kv.init(list(KEYS), [_init(name) for name in KEYS])
            _take_turns(kv, rank, range(SAVE_AFTER))
            kv.save_checkpoint(ckpt)
            saved = _pull_all(kv)
            kv.barrier()  # no rank pushes step SAVE_AFTER before every rank has pulled
            _take_turns(kv, rank, range(SAVE_AFTER, STEPS))
            first = _pull_all(kv)
            kv.barrier()  # every pull is done before the load rolls the servers back
            kv.load_checkpoint(ckpt)
            loaded = _pull_all(kv)
            kv.barrier()  # likewise after the load
            _take_turns(kv, rank, range(SAVE_AFTER, STEPS))
            again = _pull_all(kv)
            return saved, first, loaded, again

    for saved, first, loaded, again in run_ranks(N, worker, timeout=120):
        for name in KEYS:
            expected_saved = oracle(_init(name), [_grad(s, name) for s in range(SAVE_AFTER)])
            expected = oracle(_init(name), [_grad(s, name) for s in range(STEPS)])
            # numba and numpy may round an fp32 expression differently (contracted multiply-
            # adds): a few ulps over 7 updates.
            np.testing.assert_allclose(saved[name], expected_saved, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(first[name], expected, rtol=1e-5, atol=1e-6)
            assert not np.array_equal(first[name], saved[name])
            assert loaded[name].tobytes() == saved[name].tobytes(), name
            assert again[name].tobytes() == first[name].tobytes(), name
