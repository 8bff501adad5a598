"""The stochastic quantizers ``terngrad`` and ``qsgd`` and the counter generator they draw from:
the numpy reference against a per-element oracle written from the design doc, the numba
kernels against the reference (payload bytes and state), edge values, unbiasedness,
determinism, parameters, decoding, aggregation and checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvstore.codecs import codec_from_spec
from kvstore.codecs.counter_rng import key_halves, stream_key, uniforms_reference
from kvstore.codecs.quantize import ChunkPlace
from kvstore.codecs.quantize import numba_kernels as quant_numba
from kvstore.codecs.stochastic import qsgd, terngrad
from kvstore.errors import CodecError

M32 = 0xFFFFFFFF
LENGTHS = [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 4095, 4097, 10007]
SPECS = [
    {"type": "terngrad", "seed": 3},
    {"type": "terngrad", "clip": 0, "seed": 4},
    {"type": "terngrad", "clip": 1.0},
    {"type": "qsgd", "seed": 3},
    {"type": "qsgd", "levels": 1, "bucket": 7},
    {"type": "qsgd", "levels": 3, "bucket": 100, "seed": 9},
    {"type": "qsgd", "levels": 127, "bucket": 5000},
    {"type": "qsgd", "levels": 6, "bucket": 1},
]
SPEC_IDS = [
    "tern",
    "tern-noclip",
    "tern-clip1",
    "qsgd",
    "qsgd-1-7",
    "qsgd-3-100",
    "qsgd-127-5000",
    "qsgd-b1",
]


# a per-element oracle, from the design doc --------------------------------------------------


def _hash32(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _uniform(key, i):
    lo, hi = key & M32, key >> 32
    return np.float32((_hash32((_hash32(i ^ lo) + hi) & M32) >> 8) * 2.0**-24)


def _lane_sum(terms):
    lanes = [0.0] * 32
    for j, term in enumerate(terms):
        lanes[j % 32] += term
    total = 0.0
    for lane in lanes:
        total += lane
    return total


def _blocked_sum(terms):
    return _lane_sum([_lane_sum(terms[b : b + 4096]) for b in range(0, len(terms), 4096)])


def _pack(codes, width):
    stream = 0
    for j, code in enumerate(codes):
        stream |= int(code) << (j * width)
    return stream.to_bytes(-(-len(codes) * width // 8), "little")


def _terngrad_oracle(g, clip, key, start):
    """(s, codes) of one chunk."""
    n = len(g)
    if n == 0:
        return np.float32(0.0), []
    s = max(abs(x) for x in g)
    if clip > 0:
        xs = [float(x) for x in g]
        mean = _blocked_sum(xs) / n
        var = max(_blocked_sum([x * x for x in xs]) / n - mean * mean, 0.0)
        with np.errstate(over="ignore"):
            s = min(s, np.float32(clip * math.sqrt(var)))
    if s == 0:
        return np.float32(0.0), [0] * n
    codes = []
    for j, x in enumerate(g):
        a = min(abs(x), s)
        codes.append((1 if x > 0 else 2) if _uniform(key, start + j) * s < a else 0)
    return np.float32(s), codes


def _terngrad_decode_oracle(s, codes):
    return [s if c == 1 else (-s if c == 2 else np.float32(0.0)) for c in codes]


def _qsgd_oracle(v, levels, bucket, key, start):
    """(norms, codes) of one chunk."""
    top = np.float32(levels)
    norms, codes = [], []
    for q0 in range(0, len(v), bucket):
        values = v[q0 : q0 + bucket]
        with np.errstate(over="ignore"):
            norm = np.float32(math.sqrt(_blocked_sum([float(x) * float(x) for x in values])))
        norms.append(norm)
        for k, x in enumerate(values):
            level = 0
            if norm != 0:
                with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                    t = abs(x) * (top / norm) + _uniform(key, start + q0 + k)
                if not math.isnan(t):
                    level = levels if t >= top else math.floor(t)
            codes.append(level << 1 | (1 if x < 0 and level > 0 else 0))
    return norms, codes


def _qsgd_decode_oracle(norms, codes, levels, bucket):
    out = []
    for j, code in enumerate(codes):
        level = code >> 1
        with np.errstate(invalid="ignore"):  # inf * 0: a level 0 in an inf-norm bucket
            magnitude = norms[j // bucket] / np.float32(levels) * np.float32(level)
        out.append(np.float32(0.0) if level == 0 else (-magnitude if code & 1 else magnitude))
    return out


# helpers -------------------------------------------------------------------------------------


def _encoder(spec, n, kernels, monkeypatch, start=0, key_hash=77, worker=0):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
    return codec_from_spec(spec).make_chunk_encoder(ChunkPlace(start, n, key_hash, worker))


def _frames(encoder, g):
    return [bytes(f) for f in encoder.encode(g)]


def _purpose(spec):
    return terngrad.PURPOSE if spec["type"] == "terngrad" else qsgd.PURPOSE


def _edge_inputs(n, seed):
    """Finite values that stress the arithmetic: mixed magnitudes with signed zeros,
    subnormals, values near float32's largest, all-zero and all-equal chunks."""
    rng = np.random.default_rng(seed)
    mixed = rng.standard_normal(n).astype(np.float32)
    picks = rng.integers(0, 6, n)
    mixed[picks == 0] = 0.0
    mixed[picks == 1] = -0.0
    mixed[picks == 2] = rng.uniform(-1e-38, 1e-38, n)[picks == 2]  # many subnormal
    mixed[picks == 3] *= 1e30
    return [
        mixed,
        rng.uniform(-1e-39, 1e-39, n).astype(np.float32),  # all subnormal
        (np.sign(rng.standard_normal(n)) * rng.uniform(1e38, 3.4e38, n)).astype(np.float32),
        np.where(rng.random(n) < 0.5, 0.0, -0.0).astype(np.float32),
        np.full(n, 0.375, np.float32),
        np.full(n, -3.0e38, np.float32),
    ]


# the reference against the oracle ------------------------------------------------------------


@pytest.mark.parametrize("clip", [2.5, 0.0, 0.5])
@pytest.mark.parametrize("n", [0, 1, 5, 33, 100, 4099])
def test_terngrad_reference_matches_the_oracle(clip, n, monkeypatch):
    spec = {"type": "terngrad", "clip": clip, "seed": 11}
    encoder = _encoder(spec, n, "numpy", monkeypatch, start=1000, worker=2)
    rng = np.random.default_rng(n)
    for g in (rng.standard_normal(n).astype(np.float32), _edge_inputs(n, n)[0]):
        key = encoder.stream_key(terngrad.PURPOSE)
        s, codes = _terngrad_oracle(list(g), clip, key, 1000)
        scales, packed = _frames(encoder, g)
        assert scales == s.tobytes()
        assert packed == _pack(codes, 2)
        out = np.full(n, 7.0, np.float32)
        encoder.codec.decode_into(
            [np.frombuffer(f, np.uint8) for f in (scales, packed)], n, out, False, "numpy"
        )
        assert out.tobytes() == np.array(_terngrad_decode_oracle(s, codes), np.float32).tobytes()


@pytest.mark.parametrize("levels, bucket", [(15, 512), (1, 3), (4, 40), (127, 4100)])
@pytest.mark.parametrize("n", [0, 1, 9, 100, 4101])
def test_qsgd_reference_matches_the_oracle(levels, bucket, n, monkeypatch):
    spec = {"type": "qsgd", "levels": levels, "bucket": bucket, "seed": 5}
    encoder = _encoder(spec, n, "numpy", monkeypatch, start=70, worker=1)
    width = qsgd.code_width(levels)
    rng = np.random.default_rng(n + levels)
    for g in (rng.standard_normal(n).astype(np.float32), *_edge_inputs(n, n)[:3]):
        key = encoder.stream_key(qsgd.PURPOSE)
        norms, codes = _qsgd_oracle(list(g), levels, bucket, key, 70)
        scales, packed = _frames(encoder, g)
        assert scales == np.array(norms, np.float32).tobytes()
        assert packed == _pack(codes, width)
        out = np.zeros(n, np.float32)
        frames = [np.frombuffer(f, np.uint8) for f in (scales, packed)]
        encoder.codec.decode_into(frames, n, out, False, "numpy")
        want = np.array(_qsgd_decode_oracle(norms, codes, levels, bucket), np.float32)
        assert out.tobytes() == want.tobytes()


def test_worked_examples():
    # terngrad, clip off: s = 2; an element at +-s is always sent, a zero never
    codec = codec_from_spec({"type": "terngrad", "clip": 0})
    encoder = codec.make_chunk_encoder(ChunkPlace(0, 3))
    scales, packed = encoder.encode(np.array([2.0, 0.0, -2.0], np.float32))
    assert scales.view(np.float32).tolist() == [2.0] and packed.tolist() == [0b10_00_01]
    # qsgd, one level: the norm of (3, 4) is 5; x = |v| / 5, so both are sent iff u >= 1 - x
    codec = codec_from_spec({"type": "qsgd", "levels": 1})
    assert codec.code_bits() == 2 and codec.payload_nbytes(2, "float32") == (4, 1)
    encoder = codec.make_chunk_encoder(ChunkPlace(0, 2))
    norms, packed = encoder.encode(np.array([3.0, -4.0], np.float32))
    assert norms.view(np.float32).tolist() == [5.0]
    assert packed[0] & 0b0001 == 0 and packed[0] >> 4 == 0  # no sign on +3, nothing past 2


# numba against numpy -------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_numba_matches_the_reference(spec, monkeypatch):
    for n in LENGTHS:
        numpy_encoder = _encoder(spec, n, "numpy", monkeypatch, start=3)
        numba_encoder = _encoder(spec, n, "numba", monkeypatch, start=3)
        codec = numba_encoder.codec
        for g in _edge_inputs(n, n)[:1] + [
            np.random.default_rng(n).standard_normal(n).astype(np.float32)
        ]:
            want = _frames(numpy_encoder, g)
            assert _frames(numba_encoder, g) == want, (spec, n)
            frames = [np.frombuffer(f, np.uint8) for f in want]
            for accumulate in (False, True):
                by_numpy = np.linspace(-1, 1, n, dtype=np.float32)
                by_numba = by_numpy.copy()
                codec.decode_into(frames, n, by_numpy, accumulate, "numpy")
                codec.decode_into(frames, n, by_numba, accumulate, "numba")
                assert by_numba.tobytes() == by_numpy.tobytes(), (spec, n, accumulate)
        assert numba_encoder.state()["step"] == numpy_encoder.state()["step"] == 2


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[3]], ids=["tern", "qsgd"])
def test_numba_matches_the_reference_on_a_million_elements(spec, monkeypatch):
    n = 1_000_003
    g = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    g[::1000] = 0.0
    g[5::777] *= 1e-40
    numpy_encoder = _encoder(spec, n, "numpy", monkeypatch, start=12345)
    numba_encoder = _encoder(spec, n, "numba", monkeypatch, start=12345)
    want = _frames(numpy_encoder, g)
    assert _frames(numba_encoder, g) == want
    frames = [np.frombuffer(f, np.uint8) for f in want]
    by_numpy = np.ones(n, np.float32)
    by_numba = np.ones(n, np.float32)
    numba_encoder.codec.decode_into(frames, n, by_numpy, True, "numpy")
    numba_encoder.codec.decode_into(frames, n, by_numba, True, "numba")
    assert by_numba.tobytes() == by_numpy.tobytes()


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_edge_values_match(spec, monkeypatch):
    for n in (1, 8, 33, 4097):
        numpy_encoder = _encoder(spec, n, "numpy", monkeypatch)
        numba_encoder = _encoder(spec, n, "numba", monkeypatch)
        for g in _edge_inputs(n, n + 1):
            want = _frames(numpy_encoder, g)
            assert _frames(numba_encoder, g) == want, (spec, n, g[:3])


def test_edge_semantics(monkeypatch):
    for kernels in ("numpy", "numba"):
        # all zero, or all equal under clipping (sigma == 0): s = +0.0 and nothing is sent
        tern = _encoder({"type": "terngrad"}, 8, kernels, monkeypatch)
        for g in (np.array([0.0, -0.0] * 4, np.float32), np.ones(8, np.float32)):
            scales, packed = _frames(tern, g)
            assert scales == np.float32(0.0).tobytes() and packed == bytes(2)
        # a norm beyond float32 is inf: every level 0
        q = _encoder({"type": "qsgd", "bucket": 4}, 8, kernels, monkeypatch)
        g = np.array([3e38, -3e38, 1, 2, 0, 0, 0, 0], np.float32)
        scales, packed = _frames(q, g)
        assert np.frombuffer(scales, np.float32).tolist() == [np.inf, 0.0]
        assert packed == bytes(5)
        # a subnormal norm: levels / norm overflows, nonzero elements get the top level
        g = np.array([1e-45, -1e-45, 0, 0], np.float32)
        scales, packed = _frames(
            _encoder({"type": "qsgd", "bucket": 4}, 4, kernels, monkeypatch), g
        )
        codes = [(int.from_bytes(packed, "little") >> (5 * j)) & 31 for j in range(4)]
        assert codes == [30, 31, 0, 0]


def test_terngrad_rounds_the_product_u_times_s_to_float32(monkeypatch):
    # Elements equal to float32(u * s) where that rounded up: the exact product is below the
    # clipped magnitude, the float32 one is not, so they must not be sent.
    n = 4000
    s = np.float32(3.0)
    encoders = [
        _encoder({"type": "terngrad", "clip": 0}, n, k, monkeypatch) for k in ("numpy", "numba")
    ]
    u = uniforms_reference(encoders[0].stream_key(terngrad.PURPOSE), 0, n)
    g = u * s
    rounded_up = g.astype(np.float64) > u.astype(np.float64) * 3.0
    g[0] = s
    assert rounded_up[1:].sum() > 100
    for encoder in encoders:
        packed = int.from_bytes(_frames(encoder, g)[1], "little")
        codes = np.array([(packed >> (2 * j)) & 3 for j in range(n)])
        assert codes[0] == 1 and not np.any(codes[1:][rounded_up[1:]])


@pytest.mark.parametrize("spec", SPECS[:2] + SPECS[3:5], ids=SPEC_IDS[:2] + SPEC_IDS[3:5])
def test_many_steps_carry_the_push_count(spec, monkeypatch):
    numpy_encoder = _encoder(spec, 50, "numpy", monkeypatch)
    numba_encoder = _encoder(spec, 50, "numba", monkeypatch)
    g = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    seen = set()
    for step in range(30):
        frames = _frames(numba_encoder, g)
        assert frames == _frames(numpy_encoder, g), step
        seen.add(frames[1])
        assert int(numba_encoder.state()["step"]) == step + 1
    assert len(seen) > 25  # each push draws new uniforms


# unbiasedness --------------------------------------------------------------------------------


def _check_unbiased(spec, g, expected, pushes, kernels, monkeypatch):
    encoder = _encoder(spec, g.size, kernels, monkeypatch)
    codec = encoder.codec
    decoded = np.empty((pushes, g.size), np.float64)
    out = np.empty(g.size, np.float32)
    for p in range(pushes):
        frames = [np.frombuffer(f, np.uint8) for f in _frames(encoder, g)]
        codec.decode_into(frames, g.size, out, False, kernels)
        decoded[p] = out
    mean = decoded.mean(axis=0)
    stderr = decoded.std(axis=0, ddof=1) / math.sqrt(pushes)
    exact = stderr == 0
    assert np.array_equal(mean[exact], expected[exact])
    assert np.all(np.abs(mean - expected)[~exact] <= 4 * stderr[~exact])
    assert exact.sum() < g.size  # the test tests something


def _unbiased_gradient(n):
    rng = np.random.default_rng(42)
    # magnitudes from 0.5 to 3: every element is sent in a good share of the pushes, so the
    # sample variance is a fair estimate (a rarely sent one would look too certain)
    g = (np.sign(rng.standard_normal(n)) * rng.uniform(0.5, 3.0, n)).astype(np.float32)
    g[:4] = [0.0, -0.0, 30.0, -25.0]  # zeros, and spikes the clip cuts
    return g


@pytest.mark.parametrize("kernels, n, pushes", [("numba", 300, 2000), ("numpy", 64, 300)])
def test_terngrad_is_unbiased_for_the_clipped_gradient(kernels, n, pushes, monkeypatch):
    g = _unbiased_gradient(n)
    s = terngrad.scale_reference(g, 2.5)
    assert s < 25.0  # the spikes are clipped (the other elements are not)
    expected = np.sign(g) * np.minimum(np.abs(g), s).astype(np.float64)
    _check_unbiased({"type": "terngrad", "seed": 1}, g, expected, pushes, kernels, monkeypatch)


@pytest.mark.parametrize("kernels, n, pushes", [("numba", 300, 2000), ("numpy", 64, 300)])
def test_qsgd_is_unbiased(kernels, n, pushes, monkeypatch):
    g = _unbiased_gradient(n)
    spec = {"type": "qsgd", "levels": 3, "bucket": 50, "seed": 2}
    _check_unbiased(spec, g, g.astype(np.float64), pushes, kernels, monkeypatch)


# determinism and the generator's keys --------------------------------------------------------


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[3]], ids=["tern", "qsgd"])
def test_same_seed_worker_and_key_give_the_same_bytes(spec, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numba")
    n = 1000
    bounds = [(0, 600), (600, 1000)]
    grads = [np.random.default_rng(s).standard_normal(n).astype(np.float32) for s in range(3)]

    def pushes(spec, key="w", worker=0):
        encoder = codec_from_spec(spec).make_key_encoder(key, n, "float32", bounds, worker=worker)
        result = []
        for g in grads:
            encoder.begin(g)
            result.append(
                [
                    bytes(f)
                    for c, (a, b) in zip(encoder.chunks, bounds, strict=True)
                    for f in c.encode(g[a:b])
                ]
            )
        return result

    first = pushes(spec)
    assert pushes(spec) == first
    for other in (pushes(spec, worker=1), pushes({**spec, "seed": 99}), pushes(spec, key="v")):
        for mine, theirs in zip(first, other, strict=True):
            assert mine[1] != theirs[1] and mine[3] != theirs[3]  # the codes differ


def _codes_per_element(spec, g, bounds, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numba")
    codec = codec_from_spec(spec)
    encoder = codec.make_key_encoder(("layer", 3), g.size, "float32", bounds, worker=5)
    encoder.begin(g)
    width = codec.code_bits()
    codes = []
    for chunk, (a, b) in zip(encoder.chunks, bounds, strict=True):
        stream = int.from_bytes(bytes(chunk.encode(g[a:b])[1]), "little")
        codes += [(stream >> (width * j)) & ((1 << width) - 1) for j in range(b - a)]
    return codes


def test_chunk_bounds_change_no_elements_uniform(monkeypatch):
    rng = np.random.default_rng(3)
    # qsgd: bounds on bucket boundaries give the same buckets, so the same codes
    g = rng.standard_normal(640).astype(np.float32)
    spec = {"type": "qsgd", "bucket": 64, "seed": 8}
    whole = _codes_per_element(spec, g, [(0, 640)], monkeypatch)
    assert _codes_per_element(spec, g, [(0, 192), (192, 640)], monkeypatch) == whole
    assert _codes_per_element(spec, g, [(0, 64), (64, 128), (128, 640)], monkeypatch) == whole
    # terngrad without clip: one largest magnitude in every chunk, so the same scale
    g = rng.uniform(-1, 1, 600).astype(np.float32)
    g[[0, 100, 300]] = 4.0
    spec = {"type": "terngrad", "clip": 0, "seed": 8}
    split = _codes_per_element(spec, g, [(0, 300), (300, 600)], monkeypatch)
    assert _codes_per_element(spec, g, [(0, 100), (100, 600)], monkeypatch) == split
    assert split.count(0) < 550


def test_generator_kernels_match_the_reference():
    for key in (0, 1, 0xDEADBEEF_12345678, stream_key(1, 2, 3, 4, terngrad.PURPOSE)):
        lo, hi = key_halves(key)
        for start, count in ((0, 1000), (2**32 - 500, 500), (123_456_789, 77)):
            want = uniforms_reference(key, start, count)
            assert np.array_equal(want, [_uniform(key, start + j) for j in range(count)])
            for kernel in (quant_numba.uniforms,):
                got = np.empty(count, np.float32)
                kernel(np.uint64(lo), np.uint64(hi), start, got)
                assert got.tobytes() == want.tobytes(), (key, start, kernel)


def test_generator_statistics():
    n = 1_000_000
    u = uniforms_reference(stream_key(0, 0, 0, 0, 1), 0, n).astype(np.float64)
    v = uniforms_reference(stream_key(0, 1, 0, 0, 1), 0, n).astype(np.float64)
    w = uniforms_reference(stream_key(0, 0, 0, 1, 1), 0, n).astype(np.float64)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)  # var of (u - 1/2)^2 is 1/180
    for a, b in ((u, v), (u, w), (u[1:], u[:-1])):  # other worker, other step, next element
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(n)
    counts = np.bincount((u * 16).astype(int), minlength=16)
    assert np.all(np.abs(counts - n / 16) < 5 * math.sqrt(n / 16))


# checks, parameters, payload -----------------------------------------------------------------


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[3]], ids=["tern", "qsgd"])
@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_nonfinite_values_are_refused_with_the_state_unchanged(spec, kernels, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
    codec = codec_from_spec(spec)
    good = np.random.default_rng(0).standard_normal(40).astype(np.float32)

    def push(key_encoder, g):
        key_encoder.begin(g)
        chunks = zip(key_encoder.chunks, (0, 20), strict=True)
        return [bytes(f) for c, a in chunks for f in c.encode(g[a : a + 20])]

    key_encoder = codec.make_key_encoder("k", 40, "float32", [(0, 20), (20, 40)])
    push(key_encoder, good)
    for bad in (np.nan, np.inf, -np.inf):
        g = good.copy()
        g[33] = bad
        with pytest.raises(CodecError, match="NaN or infinite"):
            key_encoder.begin(g)
        with pytest.raises(CodecError, match="NaN or infinite"):
            key_encoder.chunks[1].encode(g[20:])
        assert [int(c.state()["step"]) for c in key_encoder.chunks] == [1, 1]
    replay = codec.make_key_encoder("k", 40, "float32", [(0, 20), (20, 40)])
    push(replay, good)
    assert push(key_encoder, good) == push(replay, good)  # the refused pushes drew nothing


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"type": "terngrad", "clip": -1}, "clip"),
        ({"type": "terngrad", "clip": float("nan")}, "clip"),
        ({"type": "terngrad", "clip": float("inf")}, "clip"),
        ({"type": "terngrad", "clip": True}, "clip"),
        ({"type": "terngrad", "clip": "2.5"}, "clip"),
        ({"type": "terngrad", "seed": -1}, "seed"),
        ({"type": "terngrad", "seed": 2**63}, "seed"),
        ({"type": "qsgd", "seed": 1.5}, "seed"),
        ({"type": "qsgd", "seed": True}, "seed"),
        ({"type": "qsgd", "levels": 0}, "levels"),
        ({"type": "qsgd", "levels": 128}, "levels"),
        ({"type": "qsgd", "levels": 3.0}, "levels"),
        ({"type": "qsgd", "levels": True}, "levels"),
        ({"type": "qsgd", "bucket": 0}, "bucket"),
        ({"type": "qsgd", "bucket": 2**32 + 1}, "bucket"),
        ({"type": "qsgd", "bucket": "512"}, "bucket"),
        ({"type": "qsgd", "buckets": 512}, "buckets"),
    ],
)
def test_bad_parameters_are_refused(spec, match):
    with pytest.raises(CodecError, match=match):
        codec_from_spec(spec)


def test_parameters_and_payload_sizes():
    tern = codec_from_spec({"type": "terngrad"})
    assert tern.spec() == {"type": "terngrad", "clip": 2.5, "seed": 0}
    assert codec_from_spec({"type": "terngrad", "clip": 3}).params()["clip"] == 3.0
    assert tern.payload_nbytes(0, "float32") == (4, 0)
    assert tern.payload_nbytes(17, "float32") == (4, 5)
    q = codec_from_spec({"type": "qsgd"})
    assert q.spec() == {"type": "qsgd", "levels": 15, "bucket": 512, "seed": 0}
    assert [qsgd.code_width(levels) for levels in (1, 2, 3, 4, 7, 8, 15, 16, 127)] == [
        2,
        3,
        3,
        4,
        4,
        5,
        5,
        6,
        8,
    ]
    assert q.payload_nbytes(0, "float32") == (0, 0)
    assert q.payload_nbytes(1025, "float32") == (12, 641)
    assert q.stochastic and tern.stochastic
    with pytest.raises(CodecError, match="float32"):
        q.make_encoder(10, "float16")


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[5]], ids=["tern", "qsgd"])
def test_sent_nonzero_counts_the_nonzero_codes(spec, monkeypatch):
    encoder = _encoder(spec, 1001, "numba", monkeypatch)
    g = np.random.default_rng(0).standard_normal(1001).astype(np.float32)
    frames = encoder.encode(g)
    decoded = np.empty(1001, np.float32)
    encoder.codec.decode_into(frames, 1001, decoded, False, "numpy")
    sent = int(np.count_nonzero(decoded))
    assert 0 < sent < 1001
    assert encoder.quality(g).sent_nonzero == sent
    if spec["type"] == "qsgd":
        assert qsgd.count_sent_reference(frames[1], spec["levels"], 1001) == sent


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[3]], ids=["tern", "qsgd"])
@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_aggregator_sums_the_decoded_pushes(spec, kernels, monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
    codec = codec_from_spec(spec)
    n = 3000
    aggregator = codec.make_aggregator(n, "float32")
    expected = np.zeros(n, np.float32)
    for worker in range(3):
        encoder = codec.make_key_encoder("k", n, "float32", [(0, n)], worker=worker).chunks[0]
        g = np.random.default_rng(worker).standard_normal(n).astype(np.float32)
        frames = [bytes(f) for f in encoder.encode(g)]
        decoded = np.empty(n, np.float32)
        codec.decode_into([np.frombuffer(f, np.uint8) for f in frames], n, decoded, False, "numpy")
        expected = decoded if worker == 0 else expected + decoded
        aggregator.add(frames, first=worker == 0)
    assert aggregator.result.tobytes() == expected.tobytes()


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[3]], ids=["tern", "qsgd"])
def test_checkpoint_round_trip(spec, monkeypatch):
    g = np.random.default_rng(0).standard_normal(700).astype(np.float32)
    original = _encoder(spec, 700, "numba", monkeypatch)
    for _ in range(4):
        original.encode(g)
    saved = original.state()
    assert set(saved) == {"step"} and int(saved["step"]) == 4
    restored = _encoder(spec, 700, "numpy", monkeypatch)
    restored.load_state(saved)
    assert _frames(restored, g) == _frames(original, g)
    for bad in ({"step": np.array(-1)}, {"step": np.array([1, 2])}, {"step": np.array(1.5)}, {}):
        with pytest.raises(CodecError):
            restored.load_state(bad)
