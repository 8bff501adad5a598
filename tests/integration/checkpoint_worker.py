"""A worker for the checkpoint tests: ``python checkpoint_worker.py CONFIG.json``.

Its place in the job comes from the ``KVSTORE_*`` variables the test sets. It sets 2-bit
compression and the configured optimizer, inits :data:`KEYS`, then runs the config's ``plan``,
a list of actions:

=====================  ==========================================================================
``steps A B``          push deterministic per-rank gradients of steps ``[A, B)``, pulling each
``save PATH``          ``kv.save_checkpoint(PATH)``
``load PATH``          ``kv.load_checkpoint(PATH)``
``load_fails PATH``    ``kv.load_checkpoint(PATH)`` must raise ``CheckpointError``; its text is kept
``pull TAG``           keep the values pulled now as ``TAG/KEY``
``residuals TAG``      keep the worker's 2-bit residual of every key (chunks end to end)
``dump``               write what was kept to ``OUT`` (an ``.npz``, renamed into place when whole)
``wait_for PATH``      wait until the file ``PATH`` exists
``hang``               wait to be killed, as a crashed job would
=====================  ==========================================================================
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib

import numpy as np

import kvstore

# Several sizes: one split over two servers (the test sets KVSTORE_BIGARRAY_BOUND=4000), one of
# several chunks on one server (KVSTORE_PARTITION_BYTES), lengths that are not multiples of 16,
# str and int keys.
KEYS = {"w": 1000, 7: 33, "big": 5003, "odd": 3001}
THRESHOLD = 0.5


def gradient(key: object, step: int, rank: int) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(repr(("grad", key, step, rank)).encode()))
    return (rng.standard_normal(KEYS[key]) * 0.4).astype(np.float32)


def init_value(key: object) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(repr(("init", key)).encode()))
    return rng.standard_normal(KEYS[key]).astype(np.float32)


def residuals(kv: kvstore.KVStore) -> dict[object, np.ndarray]:
    """Each key's residual, chunk after chunk (zeros where no encoder was made yet)."""
    result = {}
    for key, state in kv._shared.keys.items():
        parts = []
        for chunk in state.chunks:
            encoder = state.encoders[chunk.index]
            if encoder is not None:
                parts.append(encoder.state()["residual"])
            else:
                parts.append(np.zeros(chunk.numel, np.float32))
        result[key] = np.concatenate(parts)
    return result


def main(config_path: str) -> int:
    with open(config_path) as f:
        cfg = json.load(f)
    kept: dict[str, np.ndarray] = {}
    errors: list[str] = []
    kv = kvstore.create(cfg["mode"], timeout=120)
    kv.set_gradient_compression({"type": "2bit", "threshold": THRESHOLD})
    if cfg.get("optimizer"):
        name, params = cfg["optimizer"]
        kv.set_optimizer(name, **params)
    kv.init(list(KEYS), [init_value(key) for key in KEYS])
    outs = {key: np.empty(n, np.float32) for key, n in KEYS.items()}
    for action, *args in cfg["plan"]:
        if action == "steps":
            for step in range(args[0], args[1]):
                kv.push(list(KEYS), [gradient(key, step, kv.rank) for key in KEYS])
                kv.pull(list(KEYS), out=list(outs.values()))
        elif action == "save":
            kv.save_checkpoint(args[0])
        elif action == "load":
            kv.load_checkpoint(args[0])
        elif action == "load_fails":
            try:
                kv.load_checkpoint(args[0])
            except kvstore.CheckpointError as exc:
                errors.append(str(exc))
            else:
                raise AssertionError(f"loading {args[0]} did not fail")
        elif action == "pull":
            kv.pull(list(KEYS), out=list(outs.values()))
            kept.update({f"{args[0]}/{key}": value.copy() for key, value in outs.items()})
        elif action == "residuals":
            kept.update({f"{args[0]}/{key}": r for key, r in residuals(kv).items()})
        elif action == "dump":
            text = json.dumps(errors).encode()
            np.savez(cfg["out"] + ".tmp.npz", **kept, errors=np.frombuffer(text, np.uint8))
            os.replace(cfg["out"] + ".tmp.npz", cfg["out"])
        elif action == "wait_for":
            while not os.path.exists(args[0]):
                time.sleep(0.05)
        elif action == "hang":
            while True:
                time.sleep(1)
        else:
            raise ValueError(f"unknown action {action!r}")
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
