"""The arithmetic of compressed pulls (kvstore.codecs.pulled), without sockets: versions,
replies, the workers' copies, and what is refused."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.codecs.pulled import (
    DELTA,
    DENSE,
    UNCHANGED,
    HeldWeights,
    PublishedWeights,
    pull_applies,
    pull_codec_from_spec,
)
from kvstore.errors import CodecError

SPECS = [
    {"type": "fp16"},
    {"type": "bf16"},
    {"type": "2bit", "threshold": 0.01},
    {"type": "topk", "ratio": 0.05},
    {"type": "threshold", "threshold": 0.01},
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["type"])
def test_workers_that_pull_at_different_times_hold_the_servers_w_pub(spec):
    codec = pull_codec_from_spec(spec)
    rng = np.random.default_rng(0)
    w = rng.standard_normal(10_007).astype(np.float32)
    server = PublishedWeights(codec, "k", w)
    every, sometimes = HeldWeights(codec, w.size), HeldWeights(codec, w.size)

    def pull(worker):
        kind, frames = server.reply(worker.version)
        worker.apply(kind, server.version, server.version - 1, frames)
        return kind

    assert pull(every) == DENSE and pull(every) == UNCHANGED  # the init value, then nothing
    kinds = []
    for step in range(30):
        w = (w + rng.normal(0, 0.01, w.size)).astype(np.float32)
        server.advance(w)
        kinds.append(pull(every))
        if step % 4 == 3:
            pull(sometimes)  # three rounds behind: w_pub whole
            assert sometimes.w_pub.tobytes() == server.w_pub.tobytes()
        assert every.w_pub.tobytes() == server.w_pub.tobytes()
    assert set(kinds) == {DELTA}
    # the error is carried, not lost: w_pub stays near w
    assert np.abs(w - server.w_pub).max() < 0.2


def test_a_2bit_delta_is_the_quantized_difference():
    codec = pull_codec_from_spec({"type": "2bit", "threshold": 0.5})
    server = PublishedWeights(codec, "k", np.zeros(8, np.float32))
    target = np.array([0.6, -0.6, 0.4, -0.4, 1.7, -3.0, 0.5, 0.0], np.float32)
    server.advance(target)
    assert server.w_pub.tolist() == [0.5, -0.5, 0, 0, 0.5, -0.5, 0.5, 0]
    server.advance(target)  # the rest goes in later rounds
    assert server.w_pub.tolist() == [0.5, -0.5, 0, 0, 1.0, -1.0, 0.5, 0]


def test_nan_weights_go_dense():
    codec = pull_codec_from_spec({"type": "bf16"})
    server = PublishedWeights(codec, "k", np.zeros(4, np.float32))
    held = HeldWeights(codec, 4)
    kind, frames = server.reply(-1)
    held.apply(kind, server.version, -1, frames)
    bad = np.array([1, np.nan, 2, 3], np.float32)
    server.advance(bad)
    assert server.delta is None
    kind, frames = server.reply(held.version)
    assert kind == DENSE
    held.apply(kind, server.version, server.version - 1, frames)
    assert np.array_equal(held.w_pub, bad, equal_nan=True)


def test_replies_that_do_not_fit_are_refused():
    codec = pull_codec_from_spec({"type": "bf16"})
    held = HeldWeights(codec, 4)
    with pytest.raises(CodecError, match="from version 3; this worker holds version -1"):
        held.apply(DELTA, 4, 3, [bytes(8)])
    with pytest.raises(CodecError, match="dense compressed-pull reply of 4 bytes"):
        held.apply(DENSE, 0, -1, [bytes(4)])
    held.apply(DENSE, 0, -1, [bytes(16)])
    with pytest.raises(CodecError, match="needs payload frames"):
        held.apply(DELTA, 1, 0, [bytes(6)])
    with pytest.raises(CodecError, match="unknown compressed-pull reply kind 7"):
        held.apply(7, 1, 0, [])
    assert held.version == 0  # nothing refused changed it


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"type": "dgc"}, "'dgc' is not supported"),
        ({"type": "2bit", "threshold": -1}, "threshold"),
        ("bf16", "must be a dict"),
    ],
)
def test_bad_specs_are_refused(spec, match):
    with pytest.raises(CodecError, match=match):
        pull_codec_from_spec(spec)


def test_none_means_dense_pulls_and_only_float32_keys_are_compressed():
    assert pull_codec_from_spec({"type": "none"}) is None and pull_codec_from_spec(None) is None
    codec = pull_codec_from_spec({"type": "fp16"})
    assert pull_applies(codec, "float32")
    assert not pull_applies(codec, "float16") and not pull_applies(codec, "int64")
    assert not pull_applies(None, "float32")
