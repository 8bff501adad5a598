"""``kv.codec_state`` / ``kv.load_codec_state``: one worker's codec state in memory, and the torch
wrapper's ``state_dict`` that carries it (docs/torch.md, "Checkpoints").

The store tests run in ``local`` mode (one worker, an in-process server): with one worker and no
optimizer a pull returns the decoded push of the round, so comparing pulls compares, bit for
bit, what the worker pushed. Small partitions give every key several chunks. The wrapper test
runs two workers against two ``kvstore-server`` processes.
"""

from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest
from kvtest import connect, run_ranks

import kvstore
from kvstore.errors import CheckpointError, CodecError, KeyNotInitializedError

pytestmark = pytest.mark.integration

KEYS = ["m", 3]
SHAPES = [(40, 8), (100,)]  # "m" is a matrix whose chunks PowerSGD compresses at rank 1
TWOBIT = {"type": "2bit", "threshold": 0.5}
CODECS = [
    TWOBIT,
    {"type": "topk", "ratio": 0.1},
    {"type": "dgc", "ratio": 0.1},
    {"type": "powersgd", "rank": 1},
    {"type": "qsgd"},
    {"type": "1bit"},
]


def store(codec=TWOBIT, partition_bytes=256, keys=KEYS, shapes=SHAPES) -> kvstore.KVStore:
    kv = kvstore.create("local", timeout=30, partition_bytes=partition_bytes)
    kv.init(list(keys), [np.zeros(shape, np.float32) for shape in shapes], compression=codec)
    return kv


def step(kv: kvstore.KVStore, seed: int) -> list[np.ndarray]:
    """Push a gradient of every key (drawn from ``seed``); the pulled values: what was pushed."""
    rng = np.random.default_rng(seed)
    kv.push(KEYS, [rng.normal(0, 0.4, shape).astype(np.float32) for shape in SHAPES])
    outs = [np.empty(shape, np.float32) for shape in SHAPES]
    kv.pull(KEYS, out=outs)
    return outs


def same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(
        np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b, strict=True)
    )


def assert_same_state(a: dict, b: dict) -> None:
    """Two codec states are equal, arrays bit for bit."""
    assert [k["key"] for k in a["keys"]] == [k["key"] for k in b["keys"]]
    for key_a, key_b in zip(a["keys"], b["keys"], strict=True):
        for chunk_a, chunk_b in zip(key_a["chunks"], key_b["chunks"], strict=True):
            if chunk_a["state"] is None:
                assert chunk_b["state"] is None
                continue
            assert chunk_a["state"].keys() == chunk_b["state"].keys()
            for name, array in chunk_a["state"].items():
                other = chunk_b["state"][name]
                assert array.dtype == other.dtype and array.tobytes() == other.tobytes(), name


@pytest.mark.parametrize("codec", CODECS, ids=[c["type"] for c in CODECS])
def test_a_fresh_store_that_loads_the_state_pushes_what_the_saving_store_pushed(codec):
    with store(codec) as kv:
        for seed in range(3):
            step(kv, seed)
        saved = kv.codec_state(KEYS)
        expected = [step(kv, seed) for seed in (3, 4)]
    with store(codec) as kv:
        kv.load_codec_state(saved)
        got = [step(kv, seed) for seed in (3, 4)]
    with store(codec) as kv:  # without the state: the residuals (or push counts) are missing
        control = [step(kv, seed) for seed in (3, 4)]
    for a, b in zip(expected, got, strict=True):
        assert same_bits(a, b)
    assert not all(same_bits(a, b) for a, b in zip(expected, control, strict=True))


def test_the_state_is_plain_data_per_key_and_chunk():
    with store() as kv:
        never_pushed = kv.codec_state(KEYS)
        step(kv, 0)
        saved = kv.codec_state(KEYS)
        chunks = kv._shared.keys["m"].chunks
    for state in (never_pushed, saved):  # JSON-able but for the arrays
        json.dumps(state, default=lambda array: array.shape)
    assert [k["key"] for k in saved["keys"]] == KEYS
    assert saved["rank"] == 0 and saved["keys"][0]["codec"] == TWOBIT
    described = saved["keys"][0]["chunks"]
    assert [(c["index"], c["start"], c["numel"]) for c in described] == [
        (c.index, c.start, c.numel) for c in chunks
    ]
    assert len(chunks) > 1 and all(c["pushes"] == 1 for c in described)
    assert all(c["state"]["residual"].shape == (c["numel"],) for c in described)
    assert all(c["state"] is None for k in never_pushed["keys"] for c in k["chunks"])
    with store() as kv, pytest.raises(KeyNotInitializedError, match="'nope'"):
        kv.codec_state(["m", "nope"])


def test_a_load_into_a_running_store_rolls_its_encoders_back():
    """Loaded into encoders that exist (and a state saved before any push: back to zero)."""
    with store() as kv:
        fresh = kv.codec_state(KEYS)
        first = step(kv, 0)
        saved = kv.codec_state(KEYS)
        expected = step(kv, 1)
        step(kv, 2)
        kv.load_codec_state(saved)
        assert_same_state(kv.codec_state(KEYS), saved)  # (waiting for the next push)
        assert same_bits(step(kv, 1), expected)
        kv.load_codec_state(fresh)
        assert same_bits(step(kv, 0), first)


def _mismatches(saved: dict) -> list[tuple[dict, type[Exception], str]]:
    """States that must be refused, each with its error and message."""
    other_rank = {**saved, "rank": 1}
    newer = {**saved, "version": 2}
    bad_shape = copy.deepcopy(saved)
    chunk = bad_shape["keys"][1]["chunks"][1]
    chunk["state"]["residual"] = chunk["state"]["residual"][:-1]
    bad_dtype = copy.deepcopy(saved)
    chunk = bad_dtype["keys"][1]["chunks"][0]
    chunk["state"]["residual"] = chunk["state"]["residual"].astype(np.float64)
    not_an_array = copy.deepcopy(saved)
    chunk = not_an_array["keys"][1]["chunks"][0]
    chunk["state"]["residual"] = chunk["state"]["residual"].tolist()
    half = copy.deepcopy(saved)
    half["keys"][1]["chunks"][0]["state"] = None
    twice = {**saved, "keys": [saved["keys"][0], saved["keys"][0]]}
    return [
        ({"format": "something else"}, CheckpointError, "expected a codec state"),
        (other_rank, CheckpointError, "worker 1's, this is worker 0"),
        (newer, CheckpointError, "newer"),
        (bad_shape, CodecError, r"key 3 chunk 1: .*float32\[\d+\]"),
        (bad_dtype, CodecError, "key 3 chunk 0: .*float64"),
        (not_an_array, CodecError, "not a numpy array"),
        (half, CheckpointError, "key 3 chunk 0"),
        (twice, CheckpointError, "twice"),
    ]


def test_a_state_that_does_not_fit_is_refused_and_changes_nothing():
    with store() as kv:
        step(kv, 0)
        saved = kv.codec_state(KEYS)
    with store() as kv:
        step(kv, 10)
        before = kv.codec_state(KEYS)
        for bad, error, match in _mismatches(saved):
            with pytest.raises(error, match=match):
                kv.load_codec_state(bad)
            assert_same_state(kv.codec_state(KEYS), before)  # key "m" was fine: unchanged too
    with store(codec={"type": "topk", "ratio": 0.1}) as kv:
        with pytest.raises(CheckpointError, match="key 'm': .*'2bit'.*'topk'"):
            kv.load_codec_state(saved)
    with store(keys=["m", 4]) as kv:
        with pytest.raises(CheckpointError, match="key 3, which this store did not initialise"):
            kv.load_codec_state(saved)
        assert all(
            c["state"] is None for k in kv.codec_state(["m", 4])["keys"] for c in k["chunks"]
        )
    with store(partition_bytes=512) as kv:
        with pytest.raises(CheckpointError, match="key 'm' was saved in chunks"):
            kv.load_codec_state(saved)


# the torch wrapper -------------------------------------------------------------------------------


def test_the_wrappers_state_dict_resumes_compressed_training_exactly(two_servers_two_workers):
    """2-bit residuals travel in ``opt.state_dict()`` through ``torch.save`` / ``torch.load``
    (with ``weights_only=True``, its default): a new job that loads the model's and the
    wrapper's state dicts continues bit for bit; without the codec state it does not; a
    wrapper with another codec or other keys refuses the state dict and keeps its own state."""
    torch = pytest.importorskip("torch")
    import kvstore.torch as kvt

    workers = 2

    torch.manual_seed(0)  # (made once: rank threads would race on the global generator)
    start = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def loss_of(model, rank: int, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        return torch.nn.functional.cross_entropy(model(x), y)

    def wrapper(model, kv, codec, prefix="kvt.param/"):
        return kvt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model.named_parameters(),
            kv=kv,
            compression=codec,
            bucket_plan={"bucket_bytes": 256},
            key_prefix=prefix,
        )

    twobit = {"type": "2bit", "threshold": 0.01}
    saved: list[bytes] = [b""] * workers

    def run(rank: int, steps: range, resume: str | None = None) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(start)
        with connect(two_servers_two_workers, rank, workers) as kv:
            opt = wrapper(model, kv, twobit)
            if resume is not None:
                state = torch.load(io.BytesIO(saved[rank]), weights_only=True)
                model.load_state_dict(state["model"])
                if resume == "without codec state":
                    del state["opt"][kvt.optimizer.CODEC_STATE_ENTRY]
                opt.load_state_dict(state["opt"])
            for step in steps:
                if step == 2 and resume is None:
                    buffer = io.BytesIO()
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
                    saved[rank] = buffer.getvalue()
                opt.zero_grad()
                loss_of(model, rank, step).backward()
                opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def refuse(rank: int) -> None:
        """Wrappers of another codec or other keys refuse the state dict, unchanged."""
        state = torch.load(io.BytesIO(saved[rank]), weights_only=True)
        with connect(two_servers_two_workers, rank, workers) as kv:
            for codec, prefix, error, match in [
                ({"type": "topk", "ratio": 0.5}, "kvt.param/", CheckpointError, "'topk'"),
                (twobit, "other/", ValueError, "other keys"),
            ]:
                opt = wrapper(copy.deepcopy(start), kv, codec, prefix)
                opt.remove_hooks()
                with pytest.raises(error, match=match):
                    opt.load_state_dict(state["opt"])
                assert opt.state_dict()["state"] == {}  # no momentum buffers yet
                codec_state = kv.codec_state(list(opt.keys))
                assert all(c["state"] is None for k in codec_state["keys"] for c in k["chunks"])

    straight = run_ranks(workers, lambda rank: run(rank, range(4)))
    resumed = run_ranks(workers, lambda rank: run(rank, range(2, 4), "with codec state"))
    forgetful = run_ranks(workers, lambda rank: run(rank, range(2, 4), "without codec state"))
    for a, b in zip(straight, resumed, strict=True):
        assert all(torch.equal(a[name], b[name]) for name in a)
    assert not all(torch.equal(straight[0][name], forgetful[0][name]) for name in straight[0])
    run_ranks(workers, refuse)
