"""The 2-bit codec's ``residual_clip`` variant and its runaway-residual warning.

The variant's kernels (numpy reference, numba, CuPy) against a per-element oracle built on the
MXNet one; the MXNet-exact default left as it was; the encoder's warning, once per key.
"""

from __future__ import annotations

import logging
import zlib

import numpy as np
import pytest
from kvtest import oracle_encode

from kvstore.codecs import codec_from_spec, get_codec, twobit
from kvstore.errors import CodecError

KERNELS = ["numpy", "numba"]
LENGTHS = [0, 1, 3, 15, 16, 17, 33, 2047, 2048, 2049, 4097]  # around 16 and 2048 blocks
THRESHOLDS = [1e-3, 0.5, 3.75]
CLIPS = [1.0, 1.5, 4.0]


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 bit patterns: -0.0 != 0.0, NaNs compare by payload."""
    return a.view(np.uint32)


def oracle_encode_clipped(grad, residual, threshold, clip) -> bytes:
    """MXNet's per-element encode, then each residual clipped to the float32 ``clip * t``."""
    packed, _ = oracle_encode(grad, residual, threshold)
    limit = np.float32(np.float32(clip) * np.float32(threshold))
    for i in range(len(residual)):
        if residual[i] > limit:
            residual[i] = limit
        elif residual[i] < -limit:
            residual[i] = -limit
    return packed


def _inputs(rng: np.random.Generator, n: int, threshold: float, kind: str) -> np.ndarray:
    if kind == "normal":  # often beyond the clip, so the clip is exercised
        return (rng.standard_normal(n) * threshold * 3).astype(np.float32)
    if kind == "ties":  # exactly at +-t, at the limits, and their neighbours
        t = np.float32(threshold)
        pool = [t, -t, 0.0, -0.0, np.nextafter(t, 0), 2 * t, -2 * t, np.nextafter(2 * t, 9)]
        return rng.choice(np.array(pool, dtype=np.float32), n).astype(np.float32)
    if kind == "special":  # inf becomes +-limit, NaN stays NaN
        pool = np.array([np.inf, -np.inf, np.nan, 0.3, -0.7, 1e30, -1e-40], dtype=np.float32)
        return rng.choice(pool, n).astype(np.float32)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
def test_clipped_encode_matches_the_oracle(kind):
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    for n in LENGTHS:
        for threshold in THRESHOLDS:
            for clip in CLIPS:
                r_oracle = (rng.standard_normal(n) * threshold).astype(np.float32)
                r_kernels = {kernels: r_oracle.copy() for kernels in KERNELS}
                for step in range(2):  # the clipped residual carries into the next push
                    g = _inputs(rng, n, threshold, kind)
                    expected = oracle_encode_clipped(g, r_oracle, threshold, clip)
                    for kernels, residual in r_kernels.items():
                        words = twobit.encode(
                            g, residual, threshold, kernels=kernels, residual_clip=clip
                        )
                        where = (kernels, n, threshold, clip, step)
                        assert words.view(np.uint8).tobytes() == expected, where
                        assert np.array_equal(_bits(residual), _bits(r_oracle)), where


@pytest.mark.parametrize("kernels", KERNELS)
def test_the_clip_changes_the_residual_only(kernels):
    """Same codes as MXNet's encode of the same input; the residual is its residual clipped."""
    rng = np.random.default_rng(11)
    g = (rng.standard_normal(5000) * 2).astype(np.float32)
    start = (rng.standard_normal(5000) * 0.5).astype(np.float32)
    r_mxnet, r_clipped = start.copy(), start.copy()
    plain = twobit.encode(g, r_mxnet, 0.5, kernels=kernels)
    clipped = twobit.encode(g, r_clipped, 0.5, kernels=kernels, residual_clip=2)
    assert plain.tobytes() == clipped.tobytes()
    assert np.array_equal(r_clipped, np.clip(r_mxnet, np.float32(-1), np.float32(1)))
    assert np.abs(r_clipped).max() == 1.0 < np.abs(r_mxnet).max()


def test_a_clip_of_one_bounds_the_backlog_to_one_push():
    # 1.3 with t = 0.5: MXNet sends 0.5 and keeps 0.8; clip 1 keeps 0.5, sent by the next push.
    g = np.array([1.3, -1.3, 0.2], dtype=np.float32)
    r = np.zeros(3, np.float32)
    words = twobit.encode(g, r, 0.5, residual_clip=1)
    assert twobit.decode(words, 3, 0.5).tolist() == [0.5, -0.5, 0.0]
    np.testing.assert_allclose(r, [0.5, -0.5, 0.2], atol=1e-7)


@pytest.mark.parametrize("kernels", KERNELS)
def test_count_at_least(kernels):
    _, count = twobit.cpu_variant_kernels(kernels)
    values = np.array([0.0, -3.0, 2.999, 3.0, np.nan, -np.inf, 1e-40] * 700, np.float32)
    assert count(values, np.float32(3.0)) == 3 * 700
    assert count(values[:0], np.float32(3.0)) == 0


def test_the_mxnet_default_keeps_its_spec():
    assert get_codec("2bit").spec() == {"type": "2bit", "threshold": 0.5}
    assert get_codec("2bit", threshold=0.25, residual_clip=None).params() == {"threshold": 0.25}
    assert codec_from_spec({"type": "2bit", "threshold": 0.25, "residual_clip": None}) == (
        get_codec("2bit", threshold=0.25)
    )
    clipped = get_codec("2bit", threshold=0.25, residual_clip=1)
    assert clipped.spec() == {"type": "2bit", "threshold": 0.25, "residual_clip": 1.0}
    assert clipped != get_codec("2bit", threshold=0.25)
    assert codec_from_spec(clipped.spec()) == clipped


@pytest.mark.parametrize("bad", [0, 0.5, -1, float("nan"), float("inf"), 1e39, "1", True])
def test_bad_residual_clips_are_rejected(bad):
    with pytest.raises(CodecError, match="residual_clip"):
        get_codec("2bit", residual_clip=bad)
    with pytest.raises(CodecError, match="residual_clip"):
        twobit.encode(np.zeros(4, np.float32), np.zeros(4, np.float32), 0.5, residual_clip=bad)


def test_the_clipped_encoder_matches_the_function_and_saves_its_residual():
    codec = get_codec("2bit", threshold=0.25, residual_clip=1)
    encoder = codec.make_encoder(1000, "float32")
    residual = np.zeros(1000, np.float32)
    rng = np.random.default_rng(3)
    for _ in range(3):
        g = rng.standard_normal(1000).astype(np.float32)
        (payload,) = encoder.encode(g)
        assert bytes(payload) == bytes(twobit.encode(g, residual, 0.25, residual_clip=1))
        assert np.array_equal(encoder.state()["residual"], residual)
    assert np.abs(residual).max() <= 0.25


# the runaway warning ---------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    """The WARNING messages of the 2-bit module's logger (kvstore's loggers may not propagate)."""
    handler = _Records()
    log = logging.getLogger(twobit.__name__)
    level = log.level
    log.setLevel(logging.WARNING)
    log.addHandler(handler)
    yield handler.messages
    log.removeHandler(handler)
    log.setLevel(level)


def _push(encoder, value: float, times: int) -> None:
    g = np.full(encoder.numel, value, np.float32)
    for _ in range(times):
        encoder.encode(g)


def test_a_runaway_residual_is_reported_once_per_key(warnings_logged):
    codec = get_codec("2bit", threshold=0.01)
    chunks = [codec.make_encoder(100, "float32") for _ in range(2)]  # two chunks of one key
    for encoder in chunks:
        encoder.label = "key 'fc1.weight' (shape (10, 20), float32)"
    # +0.9 per push with t = 0.01: the residual grows by 89 thresholds a push, past 1,000 in
    # 12 pushes; the check runs every RUNAWAY_CHECK_EVERY pushes.
    _push(chunks[0], 0.9, twobit.RUNAWAY_CHECK_EVERY - 1)
    assert warnings_logged == []
    _push(chunks[0], 0.9, 1)
    (message,) = warnings_logged
    assert "key 'fc1.weight' (shape (10, 20), float32)" in message
    largest = np.abs(chunks[0].residual).max() / np.float32(0.01)
    assert largest > 89 * (twobit.RUNAWAY_CHECK_EVERY - 1)
    assert f"holds {largest:.0f} thresholds" in message
    assert "'residual_clip': 1" in message and "momentum" in message
    assert "raise the threshold" in message
    _push(chunks[0], 0.9, 64)
    _push(chunks[1], 0.9, 64)  # the key's other chunk: same key, no second warning
    assert len(warnings_logged) == 1
    other = codec.make_encoder(100, "float32")
    other.label = "key 'fc2.weight' (shape (10, 10), float32)"
    _push(other, -0.9, twobit.RUNAWAY_CHECK_EVERY)
    assert len(warnings_logged) == 2 and "fc2.weight" in warnings_logged[1]


def test_no_warning_below_the_bound_or_with_the_clip(warnings_logged):
    healthy = get_codec("2bit", threshold=0.01).make_encoder(100, "float32")
    assert healthy.label == "a key"
    # 49 thresholds a push: 980 after 20 pushes, below 1,000, then draining one threshold a
    # push; checked twice.
    _push(healthy, 0.5, 20)
    _push(healthy, 0.0, 2 * twobit.RUNAWAY_CHECK_EVERY - 20)
    assert 900 < np.abs(healthy.residual).max() / np.float32(0.01) < 1000
    clipped = get_codec("2bit", threshold=0.01, residual_clip=1).make_encoder(100, "float32")
    _push(clipped, 0.9, 200)
    assert warnings_logged == []
    assert np.abs(clipped.residual).max() <= 0.01


def test_the_watch_costs_one_count_every_few_pushes(monkeypatch):
    encoder = get_codec("2bit", threshold=0.01).make_encoder(64, "float32")
    counted = []
    monkeypatch.setattr(encoder, "_count", lambda r, bound: counted.append(bound) or 0)
    _push(encoder, 0.001, 5 * twobit.RUNAWAY_CHECK_EVERY)
    assert counted == [np.float32(1000 * np.float32(0.01))] * 5


# GPU twin ---------------------------------------------------------------------------------------


def _same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit, except that a NaN matches any NaN: CUDA's arithmetic returns its canonical
    NaN (0x7fffffff), numpy keeps the input's payload (the MXNet-exact GPU kernel does the
    same; its tests leave NaNs out)."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(_bits(a[~nan]), _bits(b[~nan])))


@pytest.mark.gpu
@pytest.mark.parametrize("threshold", [1e-3, 0.5])
def test_the_cupy_clipped_encode_matches_the_reference(threshold):
    from kvtest import require_cupy

    cupy = require_cupy()
    from kvstore.codecs.twobit import cuda_variant_kernels

    rng = np.random.default_rng(5)
    for n in [1, 15, 16, 17, 33, 1000, 4097, 65_537, 1_000_003]:
        for offset in (0, 1):  # aligned (float4 path) and a view one element in (per element)
            base_g = cupy.zeros(n + offset, cupy.float32)
            base_r = cupy.zeros(n + offset, cupy.float32)
            g_gpu, r_gpu = base_g[offset:], base_r[offset:]
            r_cpu = (rng.standard_normal(n) * threshold).astype(np.float32)
            r_gpu[...] = cupy.asarray(r_cpu)
            for kind in ("normal", "ties", "special"):
                g = _inputs(rng, n, threshold, kind)
                g_gpu[...] = cupy.asarray(g)
                cpu = twobit.encode(g, r_cpu, threshold, kernels="numpy", residual_clip=1.5)
                gpu = twobit.encode(g_gpu, r_gpu, threshold, residual_clip=1.5)
                assert gpu.get().tobytes() == cpu.tobytes(), (n, offset, kind)
                assert _same_floats(r_gpu.get(), r_cpu), (n, offset, kind)
            bound = np.float32(threshold)
            assert cuda_variant_kernels.count_at_least(r_gpu, bound) == (
                twobit.count_at_least_reference(r_cpu, bound)
            )


@pytest.mark.gpu
def test_the_cupy_encoder_warns_and_clips_like_the_host_one(warnings_logged):
    from kvtest import require_cupy

    cupy = require_cupy()
    device = cupy.cuda.Device(0)
    runaway = get_codec("2bit", threshold=0.01).make_encoder(1000, "float32", device=device)
    runaway.label = "key 'gpu.weight'"
    g = cupy.full(1000, 0.9, cupy.float32)
    for _ in range(twobit.RUNAWAY_CHECK_EVERY):
        runaway.encode(g)
    (message,) = warnings_logged
    largest = float(cupy.abs(runaway.residual).max()) / np.float32(0.01)
    assert "key 'gpu.weight'" in message and f"holds {largest:.0f} thresholds" in message
    codec = get_codec("2bit", threshold=0.01, residual_clip=1)
    gpu = codec.make_encoder(1000, "float32", device=device)
    cpu = codec.make_encoder(1000, "float32")
    for _ in range(3):
        (frame_gpu,) = gpu.encode(g)
        (frame_cpu,) = cpu.encode(g.get())
        assert bytes(frame_gpu) == bytes(frame_cpu)
    assert np.array_equal(gpu.state()["residual"], cpu.state()["residual"])
