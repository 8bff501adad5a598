"""The codec interface, registry and identity codec."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.codecs import (
    Codec,
    accumulator_dtype,
    codec_from_spec,
    get_codec,
    register_codec,
    registered_codecs,
)
from kvstore.errors import CodecError


def test_registry_lists_builtins_and_rejects_duplicates():
    assert {"2bit", "none"} <= set(registered_codecs())

    class Again(Codec):
        name = "2bit"

    with pytest.raises(CodecError, match="already registered"):
        register_codec(Again)


def test_spec_round_trip_and_equality():
    codec = codec_from_spec({"type": "2bit", "threshold": 0.1})
    assert codec.spec() == {"type": "2bit", "threshold": float(np.float32(0.1))}
    assert codec == codec_from_spec(codec.spec())
    assert codec != get_codec("2bit", threshold=0.2)
    assert codec_from_spec({"type": "none"}) == get_codec("none")


@pytest.mark.parametrize(
    "spec, match",
    [
        ("2bit", "must be a dict"),
        ({"threshold": 0.5}, "need a 'type'"),
        ({"type": 2}, "expected str for codec"),
        ({"type": "zip"}, "unknown codec 'zip'"),
        ({"type": "none", "level": 3}, "unknown parameter"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(CodecError, match=match):
        codec_from_spec(spec)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int32", "int64"])
def test_identity_codec_round_trip_and_sums_in_the_accumulator_dtype(dtype):
    codec = get_codec("none")
    values = (np.arange(40) - 20).astype(dtype)
    encoder = codec.make_encoder(40, dtype)
    (payload,) = encoder.encode(values)
    assert codec.payload_nbytes(40, dtype) == (values.nbytes,)
    values[:] = 0  # the caller's memory is free after encode
    aggregator = codec.make_aggregator(40, dtype)
    aggregator.add([bytes(payload)], first=True)
    aggregator.add([bytes(payload)], first=False)
    assert aggregator.finish() is None
    assert aggregator.result.dtype == accumulator_dtype(dtype)
    assert aggregator.result.tolist() == [2 * (i - 20) for i in range(40)]


@pytest.mark.parametrize("pushes", [1, 2, 3, 5])
def test_identity_rounds_of_any_size_sum_exactly_and_reuse_the_accumulator(pushes):
    codec = get_codec("none")
    aggregator = codec.make_aggregator(33, "float16")
    rng = np.random.default_rng(pushes)
    for _ in range(2):  # the second round must not see the first
        rounds = [rng.normal(0, 1, 33).astype(np.float16) for _ in range(pushes)]
        for i, values in enumerate(rounds):
            aggregator.add([values.tobytes()], first=i == 0)
        aggregator.finish()
        expected = rounds[0].astype(np.float32)
        for values in rounds[1:]:
            expected = expected + values.astype(np.float32)  # fp16 pushes summed in fp32
        assert aggregator.result.tobytes() == expected.tobytes()


def test_only_the_dense_codec_lends_the_values_themselves():
    values = np.arange(40, dtype=np.float32)
    (frame,) = get_codec("none").make_encoder(40, "float32").borrow(values)
    assert frame is values  # sent from the caller's memory: no copy
    assert get_codec("2bit").make_encoder(40, "float32").borrow(values) is None  # must encode


def test_payload_sizes_are_validated():
    codec = get_codec("2bit")
    codec.validate_payloads([b"\0" * 8], 17, "float32")
    with pytest.raises(CodecError, match=r"payload frames of \[8\] bytes, got \[4\]"):
        codec.validate_payloads([b"\0" * 4], 17, "float32")
    with pytest.raises(CodecError):
        codec.validate_payloads([b"\0" * 8, b""], 17, "float32")


def test_unsupported_dtypes():
    with pytest.raises(CodecError, match="supported"):
        accumulator_dtype("complex64")
    with pytest.raises(CodecError, match="supports"):
        get_codec("none").make_encoder(4, "uint8")
