"""The sparse codec family (``threshold``, ``topk``, ``randomk``, ``dgc``): parameters, the numpy
reference against the compiled kernels, selection invariants, payload validation, the server's
scatter-add and the worker's relay of it, and the encoder state."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvstore import checkpoint
from kvstore.codecs import get_codec, sparse
from kvstore.codecs.base import ANY_RELAY_PUSHES, relay_fits
from kvstore.codecs.counter_rng import counter_hash
from kvstore.codecs.sparse import numba_kernels as sparse_numba
from kvstore.codecs.sparse.dgc import WARMUP_DENSITIES, density, sum_of_squares_reference
from kvstore.codecs.sparse.randomk import permuted_prefix_reference
from kvstore.codecs.sparse.topk import top_k_reference
from kvstore.errors import CheckpointError, CodecError

SPECS = [
    {"type": "threshold", "threshold": 1.2},
    {"type": "topk", "ratio": 0.05, "sample": 0},
    {"type": "topk", "ratio": 0.05},
    {"type": "topk", "ratio": 0.01, "sample": 0.2},
    {"type": "randomk", "ratio": 0.05, "seed": 7},
    {"type": "dgc", "ratio": 0.05},
    {"type": "dgc", "ratio": 0.01, "nesterov": True, "clip_norm": 3.0, "warmup_steps": 3},
    {"type": "dgc", "ratio": 0.02, "momentum": 0.5, "sample": 0},
]
SPEC_IDS = [
    "threshold",
    "topk-exact",
    "topk-sampled",
    "topk-wide-sample",
    "randomk",
    "dgc",
    "dgc-nesterov-clip-warmup",
    "dgc-exact",
]


def _codec(spec):
    return get_codec(spec["type"], **{k: v for k, v in spec.items() if k != "type"})


def _key_encoder(spec, numel, kernels, monkeypatch, key="w", chunks=2):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
    cut = [0, *(numel * i // chunks for i in range(1, chunks)), numel] if numel else [0, 0]
    bounds = list(zip(cut[:-1], cut[1:], strict=True))
    return _codec(spec).make_key_encoder(key, numel, "float32", bounds)


def _push(key_encoder, grad):
    """One push: the chunks' frames as bytes."""
    key_encoder.begin(grad)
    return [[bytes(memoryview(f)) for f in c.encode(None)] for c in key_encoder.chunks]


def _state_bytes(key_encoder):
    return [{k: v.tobytes() for k, v in c.state().items()} for c in key_encoder.chunks]


def _gradients(numel, steps, seed, kind="normal"):
    rng = np.random.default_rng(seed)
    for step in range(steps):
        if kind == "normal":
            yield rng.normal(0, 1, numel).astype(np.float32)
        elif kind == "heavy":
            yield (rng.standard_t(1.5, numel) * 0.1).astype(np.float32)
        elif kind == "spiky":
            g = np.zeros(numel, np.float32)
            g[rng.integers(0, max(numel, 1), max(1, numel // 200))] = 5.0
            yield g
        elif kind == "zeros":
            yield np.zeros(numel, np.float32)
        elif kind == "equal":
            yield np.full(numel, 0.25 * (step + 1), np.float32)


# parameters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"type": "threshold"}, "needs a threshold"),
        ({"type": "threshold", "threshold": 0}, "threshold must be a finite number > 0"),
        ({"type": "threshold", "threshold": -1.0}, "threshold"),
        ({"type": "threshold", "threshold": float("nan")}, "threshold"),
        ({"type": "threshold", "threshold": float("inf")}, "threshold"),
        ({"type": "threshold", "threshold": "1"}, "threshold must be a number"),
        ({"type": "topk", "ratio": 0}, r"ratio must be in \(0, 1\]"),
        ({"type": "topk", "ratio": 1.5}, "ratio"),
        ({"type": "topk", "ratio": float("nan")}, "ratio"),
        ({"type": "topk", "ratio": True}, "ratio must be a number"),
        ({"type": "topk", "sample": -0.1}, r"sample must be in \[0, 1\]"),
        ({"type": "topk", "sample": float("nan")}, "sample"),
        ({"type": "topk", "k": 3}, "unknown parameter"),
        ({"type": "randomk", "seed": -1}, "seed"),
        ({"type": "randomk", "seed": 1.5}, "seed must be an integer"),
        ({"type": "randomk", "ratio": 2}, "ratio"),
        ({"type": "dgc", "momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ({"type": "dgc", "momentum": float("nan")}, "momentum"),
        ({"type": "dgc", "nesterov": "yes"}, "nesterov"),
        ({"type": "dgc", "clip_norm": 0}, "clip_norm"),
        ({"type": "dgc", "clip_norm": float("inf")}, "clip_norm"),
        ({"type": "dgc", "warmup_steps": -1}, "warmup_steps"),
        ({"type": "dgc", "warmup_steps": 2.5}, "warmup_steps"),
    ],
)
def test_bad_parameters_name_the_parameter(spec, match):
    with pytest.raises(CodecError, match=match):
        _codec(spec)


def test_defaults_and_specs():
    assert _codec({"type": "topk"}).spec() == {"type": "topk", "ratio": 0.01, "sample": 0.01}
    assert _codec({"type": "randomk"}).params() == {"ratio": 0.01, "seed": 0}
    assert _codec({"type": "dgc"}).params() == {
        "ratio": 0.001,
        "momentum": 0.9,
        "nesterov": False,
        "sample": 0.01,
        "clip_norm": None,
        "warmup_steps": 0,
    }
    threshold = _codec({"type": "threshold", "threshold": 0.1})
    assert threshold.params() == {"threshold": float(np.float32(0.1))}
    with pytest.raises(CodecError, match="float32"):
        threshold.make_key_encoder("w", 4, "float64", [(0, 4)])


def test_counts_read_ratios_as_decimals():
    assert sparse.top_count(0.07, 100) == 7  # 0.07 * 100 is 7.000000000000001 in floats
    assert sparse.top_count(0.001, 10) == 1
    assert sparse.top_count(1.0, 5) == 5
    assert sparse.top_count(0.5, 0) == 0


def test_sample_plan_matches_dgc_worked_values():
    # DGC's sampling: a 3x3x512x512 conv at ratio 0.001 -> stride 97, 24,322
    # samples, threshold from the top 25; a 7x7x3x64 conv is sampled whole.
    plan = sparse.sample_plan(2_359_296, 0.001, 0.01, start_hash=1000)
    assert (plan.stride, plan.count, plan.top) == (97, 24_322, 25)
    assert plan.start == 1000 % 97
    assert sparse.sample_plan(9408, 0.001, 0.01, 5) == sparse.SamplePlan(0, 1, 9408, 10)


# the numpy reference and the compiled kernels agree bit for bit ------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 97, 1009, 65_537])
def test_numpy_and_numba_give_identical_payloads_and_state(spec, numel, monkeypatch):
    encoders = [_key_encoder(spec, numel, k, monkeypatch) for k in ("numpy", "numba")]
    for grad in _gradients(numel, steps=5, seed=numel):
        assert _push(encoders[0], grad) == _push(encoders[1], grad)
        assert _state_bytes(encoders[0]) == _state_bytes(encoders[1])


@pytest.mark.parametrize("kind", ["heavy", "spiky", "zeros", "equal"])
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_kernels_agree_on_ties_zeros_and_outliers(spec, kind, monkeypatch):
    encoders = [_key_encoder(spec, 4099, k, monkeypatch) for k in ("numpy", "numba")]
    for grad in _gradients(4099, steps=6, seed=3, kind=kind):
        assert _push(encoders[0], grad) == _push(encoders[1], grad)
        assert _state_bytes(encoders[0]) == _state_bytes(encoders[1])


def test_kernels_agree_on_a_large_key(monkeypatch):
    spec = {"type": "dgc", "ratio": 0.01, "nesterov": True, "clip_norm": 100.0}
    encoders = [_key_encoder(spec, 1_000_003, k, monkeypatch, chunks=3) for k in ("numpy", "numba")]
    for grad in _gradients(1_000_003, steps=2, seed=11):
        assert _push(encoders[0], grad) == _push(encoders[1], grad)
    assert _state_bytes(encoders[0]) == _state_bytes(encoders[1])


def test_the_norm_reduction_is_the_same_everywhere():
    g = np.random.default_rng(0).normal(0, 3, 3 * 4096 + 17).astype(np.float32)
    assert sum_of_squares_reference(g) == sparse_numba.blocked_sum_of_squares(g, 4096)
    assert math.isclose(sum_of_squares_reference(g), float(np.sum(g.astype(np.float64) ** 2)))


# selection semantics ---------------------------------------------------------------------------


def _sent(frames_per_chunk, bounds):
    """The global indices a push sent (ascending)."""
    parts = [
        start + np.frombuffer(idx, np.uint32).astype(np.int64)
        for (start, _), (idx, _) in zip(bounds, frames_per_chunk, strict=True)
    ]
    return np.concatenate(parts)


def _dense(frames_per_chunk, bounds, numel):
    out = np.zeros(numel, np.float32)
    for (start, _), (idx, val) in zip(bounds, frames_per_chunk, strict=True):
        out[start + np.frombuffer(idx, np.uint32).astype(np.int64)] = np.frombuffer(val, np.float32)
    return out


@pytest.mark.parametrize("spec", SPECS[:5], ids=SPEC_IDS[:5])
@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_error_feedback_keeps_every_bit(spec, kernels, monkeypatch):
    """r_before + g == sent + r_after exactly: what is not sent stays, what is sent is zeroed."""
    numel = 5003
    encoder = _key_encoder(spec, numel, kernels, monkeypatch, chunks=3)
    for grad in _gradients(numel, steps=12, seed=5, kind="heavy"):
        before = encoder.state["residual"].copy()
        frames = _push(encoder, grad)
        sent = _dense(frames, encoder.bounds, numel)
        chosen = np.zeros(numel, bool)
        chosen[_sent(frames, encoder.bounds)] = True
        after = encoder.state["residual"]
        expected = before + grad
        assert np.array_equal(np.where(chosen, sent, after), expected)
        assert not after[chosen].any()


def test_exact_topk_takes_the_k_largest_and_breaks_ties_by_lower_index(monkeypatch):
    for kernels in ("numpy", "numba"):
        encoder = _key_encoder(
            {"type": "topk", "ratio": 0.1, "sample": 0}, 40, kernels, monkeypatch
        )
        grad = np.full(40, 0.5, np.float32)
        grad[[3, 30]] = [-2.0, 1.0]
        sent = _sent(_push(encoder, grad), encoder.bounds)
        assert sent.tolist() == [0, 1, 3, 30]  # k = 4: -2 and 1, then the first two of the ties
    magnitudes = np.array([0, 3, 3, 1, 3, 0], np.float32)
    assert top_k_reference(magnitudes, 2).tolist() == [1, 2]
    assert top_k_reference(magnitudes, 4).tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("kind", ["normal", "heavy", "spiky", "equal", "zeros"])
@pytest.mark.parametrize("numel", [50, 3001, 200_003])
def test_sampled_topk_sends_between_half_and_1_3_k_of_the_largest(kind, numel, monkeypatch):
    ratio = 0.01
    k = sparse.top_count(ratio, numel)
    encoder = _key_encoder({"type": "topk", "ratio": ratio}, numel, "numba", monkeypatch)
    for grad in _gradients(numel, steps=4, seed=numel, kind=kind):
        magnitudes = np.abs(encoder.state["residual"] + grad)
        sent = _sent(_push(encoder, grad), encoder.bounds)
        assert (np.diff(sent) > 0).all()
        chosen = np.zeros(numel, bool)
        chosen[sent] = True
        assert k / 2 <= sent.size <= 1.3 * k
        assert magnitudes[chosen].min() >= magnitudes[~chosen].max()


def test_a_key_split_into_chunks_selects_over_the_whole_key(monkeypatch):
    grad = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    grad[:500] *= 10  # the largest are all in the first chunk
    spec = {"type": "topk", "ratio": 0.02, "sample": 0}
    whole = _key_encoder(spec, 1000, "numba", monkeypatch, chunks=1)
    split = _key_encoder(spec, 1000, "numba", monkeypatch, chunks=2)
    (frames,) = _push(whole, grad)
    first, second = _push(split, grad)
    assert len(frames[0]) // 4 == 20 and len(first[0]) // 4 == 20 and second == [b"", b""]
    assert first == frames
    local = _key_encoder(spec, 1000, "numba", monkeypatch, chunks=4)
    parts = _push(local, grad)
    assert all(np.frombuffer(idx, np.uint32).max(initial=0) < 250 for idx, _ in parts)
    assert np.array_equal(_dense(parts, local.bounds, 1000), _dense([frames], whole.bounds, 1000))


def test_randomk_is_reproducible_rank_independent_and_fresh_every_step(monkeypatch):
    spec = {"type": "randomk", "ratio": 0.05, "seed": 3}

    def indices(encoder, grad):
        return _sent(_push(encoder, grad), encoder.bounds)

    rng = np.random.default_rng(0)
    grads = [rng.normal(size=2000).astype(np.float32) + 10 for _ in range(3)]  # never zero
    rank0 = _key_encoder(spec, 2000, "numba", monkeypatch)
    rank1 = _key_encoder(spec, 2000, "numpy", monkeypatch, chunks=3)
    seen = []
    for step in range(3):
        a = indices(rank0, grads[step])
        b = indices(rank1, grads[(step + 1) % 3])  # another worker's gradients
        assert a.tolist() == b.tolist() and a.size == 100
        seen.append(a.tolist())
    assert seen[0] != seen[1] != seen[2]
    other_key = _key_encoder(spec, 2000, "numba", monkeypatch, key="v")
    other_seed = _key_encoder({**spec, "seed": 4}, 2000, "numba", monkeypatch)
    assert indices(other_key, grads[0]).tolist() != seen[0]
    assert indices(other_seed, grads[0]).tolist() != seen[0]


@pytest.mark.parametrize("numel", [1, 2, 5, 16, 17, 1000])
def test_the_keyed_permutation_is_a_permutation(numel):
    for step in range(3):
        keys = counter_hash(1, step), counter_hash(2, step)
        keys = tuple(k & 0xFFFFFFFF for k in (*keys, *keys))
        from kvstore.codecs.sparse.randomk import half_bits

        full = permuted_prefix_reference(numel, numel, half_bits(numel), keys)
        assert sorted(full.tolist()) == list(range(numel))
        compiled = np.empty(numel, np.int64)
        sparse_numba.permuted_prefix(numel, half_bits(numel), np.array(keys, np.uint64), compiled)
        assert compiled.tolist() == full.tolist()


def test_dgc_warmup_stages_and_factor_masking(monkeypatch):
    assert [density(s, 0.001, 8) for s in range(10)] == [
        0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.004, 0.004, 0.001, 0.001,
    ]  # fmt: skip
    assert density(0, 0.5, 4) == 0.5  # never sparser than the final ratio
    assert WARMUP_DENSITIES == (0.25, 0.0625, 0.015625, 0.004)
    spec = {"type": "dgc", "ratio": 0.001, "warmup_steps": 8, "sample": 0, "momentum": 0.5}
    numel = 4000
    encoder = _key_encoder(spec, numel, "numba", monkeypatch)
    m = np.float32(0.5)
    for step, grad in enumerate(_gradients(numel, steps=10, seed=2)):
        u0, v0 = encoder.state["u"].copy(), encoder.state["v"].copy()
        frames = _push(encoder, grad)
        sent = _dense(frames, encoder.bounds, numel)
        chosen = np.zeros(numel, bool)
        chosen[_sent(frames, encoder.bounds)] = True
        assert chosen.sum() == sparse.top_count(density(step, 0.001, 8), numel)
        u1 = m * u0 + grad
        v1 = v0 + u1
        assert np.array_equal(sent[chosen], v1[chosen])
        assert not encoder.state["u"][chosen].any() and not encoder.state["v"][chosen].any()
        assert np.array_equal(encoder.state["u"][~chosen], u1[~chosen])
        assert np.array_equal(encoder.state["v"][~chosen], v1[~chosen])


def test_dgc_clipping_scales_the_gradient_before_momentum(monkeypatch):
    spec = {"type": "dgc", "ratio": 1.0, "momentum": 0.0, "clip_norm": 1.0, "sample": 0}
    for kernels in ("numpy", "numba"):
        encoder = _key_encoder(spec, 8, kernels, monkeypatch)
        grad = np.full(8, 2.0, np.float32)  # norm 4*sqrt(2)
        sent = _dense(_push(encoder, grad), encoder.bounds, 8)
        assert np.array_equal(sent, grad * np.float32(1 / math.sqrt(32)))


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_nan_or_inf_is_refused_before_the_state_changes(spec, kernels, monkeypatch):
    encoder = _key_encoder(spec, 300, kernels, monkeypatch)
    _push(encoder, np.linspace(-3, 3, 300, dtype=np.float32))
    saved = _state_bytes(encoder)
    for bad in (np.nan, np.inf):
        grad = np.ones(300, np.float32)
        grad[250] = bad
        with pytest.raises(CodecError, match="NaN or infinite"):
            encoder.begin(grad)
        assert _state_bytes(encoder) == saved


# payloads, aggregation and relay -------------------------------------------------------------


def _pair(indices, values):
    return [np.array(indices, np.uint32).tobytes(), np.array(values, np.float32).tobytes()]


@pytest.mark.parametrize(
    "payloads, match",
    [
        ([b"\0" * 4], "needs 2 payload frames"),
        ([b"\0" * 6, b"\0" * 8], "not whole"),
        (_pair([1, 2], [1.0]), "2 indices but 1 values"),
        (_pair([1, 1], [1.0, 2.0]), "strictly ascending, but index 1 is 1 after 1"),
        (_pair([5, 2], [1.0, 2.0]), "strictly ascending"),
        (_pair([2, 10], [1.0, 2.0]), "index 10 is out of range"),
        (_pair(range(11), [1.0] * 11), "more than the chunk's elements"),
    ],
)
def test_malformed_payloads_are_refused_with_the_reason(payloads, match):
    codec = _codec({"type": "topk"})
    with pytest.raises(CodecError, match=match):
        codec.validate_payloads(payloads, 10, "float32")
    aggregator = codec.make_aggregator(10, "float32")
    aggregator.result[:] = 7
    with pytest.raises(CodecError):
        aggregator.add(payloads, first=True)
    assert (aggregator.result == 7).all()  # untouched


def test_long_unordered_payloads_are_found_by_the_kernel_too(monkeypatch):
    indices = np.arange(0, 2000, 2, dtype=np.uint32)
    indices[700] = indices[699]
    for kernels in ("numpy", "numba"):
        monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
        with pytest.raises(CodecError, match="index 700"):
            sparse.validate_payloads([indices, np.ones(1000, np.float32)], 4000, "float32")


def _round(numel, workers, seed):
    rng = np.random.default_rng(seed)
    pushes = []
    for _ in range(workers):
        idx = np.sort(rng.choice(numel, numel // 7, replace=False)).astype(np.uint32)
        pushes.append(_pair(idx, rng.normal(0, 1, idx.size) * 0.1))
    pushes.append(_pair([], []))  # a push that sent nothing
    return pushes


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
@pytest.mark.parametrize("numel", [1, 17, 4099, 100_003])
def test_the_relay_repeats_the_server_sum_bit_for_bit(kernels, numel, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
    codec = _codec({"type": "dgc"})
    pushes = _round(numel, 5, seed=numel)
    aggregator = codec.make_aggregator(numel, "float32")
    aggregator.result[:] = np.nan  # the first push must overwrite every element
    expected = np.zeros(numel, np.float32)
    for i, payloads in enumerate(pushes):
        aggregator.add(payloads, first=i == 0)
        idx = np.frombuffer(payloads[0], np.uint32)
        expected[idx] += np.frombuffer(payloads[1], np.float32)
    assert aggregator.finish() is None
    assert aggregator.result.tobytes() == expected.tobytes()
    out = np.full(numel, np.nan, np.float32)
    codec.sum_relay(pushes, numel, "float32", out)
    assert out.tobytes() == aggregator.result.tobytes()


def test_relays_are_asked_for_by_bytes():
    codec = _codec({"type": "topk"})
    assert codec.relayable and codec.payload_nbytes(100, "float32") is None
    assert codec.relay_limit(100, "float32") == ANY_RELAY_PUSHES
    assert codec.relay_limit(0, "float32") == 0
    assert relay_fits([_pair(range(5), [1.0] * 5)] * 2, 40, "float32")  # 80 of 160 bytes
    assert not relay_fits([_pair(range(5), [1.0] * 5)] * 2, 39, "float32")
    with pytest.raises(CodecError, match="at least one push"):
        codec.sum_relay([], 10, "float32", np.zeros(10, np.float32))


# state and checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_saved_state_resumes_bit_identically(spec, monkeypatch):
    grads = list(_gradients(3000, steps=6, seed=9))
    straight = _key_encoder(spec, 3000, "numba", monkeypatch, chunks=3)
    expected = [_push(straight, g) for g in grads]
    first = _key_encoder(spec, 3000, "numba", monkeypatch, chunks=3)
    for g in grads[:3]:
        _push(first, g)
    saved = [c.state() for c in first.chunks]
    assert all(s["step"].shape == () and int(s["step"]) == 3 for s in saved)
    resumed = _key_encoder(spec, 3000, "numpy", monkeypatch, chunks=3)
    for encoder, state in zip(resumed.chunks, saved, strict=True):
        encoder.load_state(state)
    assert [_push(resumed, g) for g in grads[3:]] == expected[3:]


def test_state_cut_for_other_chunks_keeps_the_step(monkeypatch):
    encoder = _key_encoder({"type": "randomk"}, 100, "numba", monkeypatch, chunks=2)
    _push(encoder, np.ones(100, np.float32))
    pieces = [
        (a, b - a, c.state()) for (a, b), c in zip(encoder.bounds, encoder.chunks, strict=True)
    ]
    cut = checkpoint.cut(pieces, 20, 70, "key 'w'")
    assert cut["residual"].tobytes() == encoder.state["residual"][20:70].tobytes()
    assert int(cut["step"]) == 1
    single = _key_encoder({"type": "randomk"}, 100, "numba", monkeypatch, chunks=1)
    single.chunks[0].load_state(checkpoint.cut(pieces, 0, 100, "key 'w'"))
    assert single.step == 1
    with pytest.raises(CodecError, match="keeps state"):
        single.chunks[0].load_state({"residual": np.zeros(100, np.float32)})
    with pytest.raises(CodecError, match="float32"):
        single.chunks[0].load_state({"residual": np.zeros(99, np.float32), "step": np.array(1)})
    with pytest.raises(CheckpointError, match="not in the checkpoint"):
        checkpoint.cut(pieces, 0, 101, "key 'w'")


def test_a_standalone_encoder_is_one_chunk(monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numba")
    encoder = _codec({"type": "topk", "ratio": 0.1}).make_encoder(50, "float32")
    idx, val = encoder.encode(np.arange(50, dtype=np.float32))
    assert np.frombuffer(idx, np.uint32).tolist() == list(range(45, 50))
    assert sorted(encoder.state()) == ["residual", "step"]
    quality = encoder.quality(np.arange(50, dtype=np.float32))
    assert quality.sent_nonzero == 5 and quality.residual_sq == float(np.sum(np.arange(45) ** 2))


def test_dgc_refuses_server_momentum_and_the_others_do_not():
    dgc = _codec({"type": "dgc"})
    with pytest.raises(CodecError, match="double momentum"):
        dgc.check_optimizer("sgd", {"momentum": 0.9})
    with pytest.raises(CodecError, match="beta1"):
        dgc.check_optimizer("adam", {"beta1": 0.9})
    with pytest.raises(CodecError, match="double momentum"):
        dgc.check_optimizer("dcasgd", {"momentum": 0.9})
    dgc.check_optimizer("sgd", {"momentum": 0.0})
    dgc.check_optimizer("dcasgd", {"momentum": 0.0})
    _codec({"type": "topk"}).check_optimizer("sgd", {"momentum": 0.9})
