"""A worker for the multi-process integration tests: ``python scenario_worker.py NAME OUTDIR``.

Run under ``kvstore-launch`` (or, with ``local``, in the test process). Each scenario pushes
values the test can regenerate from seeds, saves what it pulled to ``OUTDIR/NAME_rank{R}.npz``,
and the test checks them against closed forms, the 2-bit oracle, or numpy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import kvstore

STEPS = 3
THRESHOLD = 0.5
LR = 0.125

# key -> shape. One big key of 1.5M elements (split over the servers), one whose length is not a
# multiple of 16, int and str keys.
DENSE_KEYS = {
    3: (2, 5),
    "w": (1000,),
    "odd": (100_003,),
    "big": (1_500_000,),
    "big_odd": (1_000_007,),
}
TWOBIT_KEYS = {"w": (1000,), "odd": (10_007,), "big": (1_500_000,), 11: (33,)}
MIXED_KEY = ("mixed", (5_003,))
SGD_KEYS = {"w": (1000,), 5: (33,), "big": (1_500_000,)}
ASYNC_KEYS = {"w": (999,), 9: (1_200_000,)}


def _seed(*parts: object) -> int:
    import zlib

    return zlib.crc32(repr(parts).encode())


def init_value(key: object, shape: tuple[int, ...], rank: int) -> np.ndarray:
    """Rank 0's init value wins; the other ranks pass something else on purpose."""
    base = np.random.default_rng(_seed("init", key)).integers(-64, 64, shape) / 32
    return (base if rank == 0 else base + 1000 + rank).astype(np.float32)


def dense_push(key: object, shape: tuple[int, ...], step: int, rank: int) -> np.ndarray:
    base = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) % 97 - 48
    return ((rank + 1) * (base + step)).astype(np.float32)


def twobit_grad(key: object, shape: tuple[int, ...], step: int, rank: int | None) -> np.ndarray:
    """Gradients around the threshold, so codes and residual carry both matter."""
    rng = np.random.default_rng(_seed("2bit", key, step, rank))
    return (rng.standard_normal(shape) * 0.4).astype(np.float32)


def exact_grad(key: object, shape: tuple[int, ...], step: int, rank: int) -> np.ndarray:
    """Multiples of 1/16: sums and updates with lr 1/8 are exact in float32 in any order."""
    rng = np.random.default_rng(_seed("exact", key, step, rank))
    return (rng.integers(-16, 17, shape) / 16).astype(np.float32)


def _save(outdir: Path, name: str, rank: int, arrays: dict[str, np.ndarray]) -> None:
    np.savez(outdir / f"{name}_rank{rank}.npz", **arrays)


def _pull_all(kv: kvstore.KVStore, keys: dict) -> dict:
    outs = {k: np.empty(shape, np.float32) for k, shape in keys.items()}
    kv.pull(list(outs), out=list(outs.values()))
    return outs


def run_dense(kv: kvstore.KVStore, outdir: Path) -> None:
    rank, saved = kv.rank, {}
    kv.init(list(DENSE_KEYS), [init_value(k, s, rank) for k, s in DENSE_KEYS.items()])
    for key, value in _pull_all(kv, DENSE_KEYS).items():
        saved[f"init/{key}"] = value
    for step in range(STEPS):
        for priority, (key, shape) in enumerate(DENSE_KEYS.items()):
            kv.push(key, dense_push(key, shape, step, rank), priority=priority)
        for key, value in _pull_all(kv, DENSE_KEYS).items():
            saved[f"{step}/{key}"] = value
    _save(outdir, "dense", rank, saved)


def run_twobit(kv: kvstore.KVStore, outdir: Path) -> None:
    rank, saved = kv.rank, {}
    kv.set_gradient_compression({"type": "2bit", "threshold": THRESHOLD})
    keys = {**TWOBIT_KEYS, MIXED_KEY[0]: MIXED_KEY[1]}
    kv.init(list(keys), [np.zeros(s, np.float32) for s in keys.values()])
    for step in range(STEPS):
        # every rank pushes the same gradient to TWOBIT_KEYS, and its own to the mixed key
        grads = [twobit_grad(k, s, step, None) for k, s in TWOBIT_KEYS.items()]
        grads.append(twobit_grad(MIXED_KEY[0], MIXED_KEY[1], step, rank))
        kv.push(list(keys), grads)
        for key, value in _pull_all(kv, keys).items():
            saved[f"{step}/{key}"] = value
    _save(outdir, "twobit", rank, saved)


def run_sgd(kv: kvstore.KVStore, outdir: Path) -> None:
    rank, saved = kv.rank, {}
    kv.set_optimizer(
        "sgd", learning_rate=LR, momentum=0.875, wd=0.0625, rescale_grad=1.0 / kv.num_workers
    )
    kv.init(list(SGD_KEYS), [init_value(k, s, rank) for k, s in SGD_KEYS.items()])
    for step in range(STEPS):
        kv.push(list(SGD_KEYS), [exact_grad(k, s, step, rank) for k, s in SGD_KEYS.items()])
        for key, value in _pull_all(kv, SGD_KEYS).items():
            saved[f"{step}/{key}"] = value
    _save(outdir, "sgd", rank, saved)


def run_async(kv: kvstore.KVStore, outdir: Path) -> None:
    rank = kv.rank
    kv.set_optimizer("sgd", learning_rate=LR)
    kv.init(list(ASYNC_KEYS), [init_value(k, s, rank) for k, s in ASYNC_KEYS.items()])
    for step in range(STEPS + 2):
        for key, shape in ASYNC_KEYS.items():
            kv.push(key, exact_grad(key, shape, step, rank))
        _pull_all(kv, ASYNC_KEYS)  # a worker's pull follows its own push; values interleave
    kv.barrier()  # every worker's pushes are applied once anyone passes this
    final = _pull_all(kv, ASYNC_KEYS)
    _save(outdir, "async", rank, {f"final/{k}": v for k, v in final.items()})


SCENARIOS = {"dense": run_dense, "twobit": run_twobit, "sgd": run_sgd, "async": run_async}
MODES = {"dense": "dist_sync", "twobit": "dist_sync", "sgd": "dist_sync", "async": "dist_async"}


def main(argv: list[str]) -> int:
    name, outdir = argv[1], Path(argv[2])
    mode = "local" if len(argv) > 3 and argv[3] == "local" else MODES[name]
    with kvstore.create(mode) as kv:
        SCENARIOS[name](kv, outdir)
        kv.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
