"""The limits a server derives before it knows any key, and the settings behind them."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.codecs import codec_from_spec
from kvstore.config import (
    DEFAULT_PARTITION_BYTES,
    ServerConfig,
    WorkerOptions,
)
from kvstore.errors import ConfigError
from kvstore.topology import (
    VALUE_ITEMSIZES,
    max_payload_bytes,
    partition_elems_for,
    plan_chunks,
)


def test_no_chunk_is_larger_than_the_bound_a_server_derives():
    """Whatever the key, the servers and the settings, every chunk's values (what an INIT or a
    dense push carries, in the widest dtype) fit in max_payload_bytes, and so does every
    codec's payload of it: a server with that limit never drops a legitimate message."""
    rng = random.Random(35)
    codecs = [codec_from_spec({"type": "none"}), codec_from_spec({"type": "2bit"})]
    tight = 0
    for _ in range(3000):
        partition_bytes = rng.choice([64, 100, 1000, 65536, 1 << 20, DEFAULT_PARTITION_BYTES])
        partition_bytes += rng.randrange(64)
        limit = max_payload_bytes(partition_bytes)
        itemsize = rng.choice(VALUE_ITEMSIZES)
        elems = partition_elems_for(partition_bytes, itemsize)
        numel = rng.choice([0, 1, 15, 17, rng.randrange(40 * elems + 1), elems * 16 + 15])
        chunks = plan_chunks(
            rng.randrange(1000),
            numel,
            rng.randint(1, 6),
            bigarray_bound=rng.choice([1, 1000, 10**6]),
            partition_elems=elems,
            wire_fraction=rng.choice([0.0, 1 / 16, 1.0]),
        )
        for chunk in chunks:
            dense = chunk.numel * itemsize
            assert dense <= limit, (partition_bytes, numel, chunk)
            tight = max(tight, dense / limit)
            for codec in codecs:
                if itemsize == 4 or codec.name == "none":
                    dtype = {2: "float16", 4: "float32", 8: "float64"}[itemsize]
                    assert sum(codec.payload_nbytes(chunk.numel, dtype)) <= limit
    assert tight == 1.0  # the bound is reached: it is the largest chunk, not a guess above it


def test_the_default_limit_is_about_one_partition():
    assert max_payload_bytes(DEFAULT_PARTITION_BYTES) == DEFAULT_PARTITION_BYTES + 15 * 8


def test_message_limit_settings():
    assert ServerConfig.from_env({}).max_message_bytes is None
    assert (
        ServerConfig.from_env({"KVSTORE_MAX_MESSAGE_BYTES": "1048576"}).max_message_bytes == 1 << 20
    )
    with pytest.raises(ConfigError, match="KVSTORE_MAX_MESSAGE_BYTES='1000' must be >= 65536"):
        ServerConfig.from_env({"KVSTORE_MAX_MESSAGE_BYTES": "1000"})
    with pytest.raises(ConfigError, match="KVSTORE_MAX_MESSAGE_BYTES"):
        ServerConfig.from_env({"KVSTORE_MAX_MESSAGE_BYTES": "lots"})
    assert ServerConfig.from_env({}).partition_bytes == DEFAULT_PARTITION_BYTES
    assert ServerConfig.from_env({"KVSTORE_PARTITION_BYTES": "65536"}).partition_bytes == 65536
    with pytest.raises(ConfigError, match="max_message_bytes must be >= 65536"):
        ServerConfig(max_message_bytes=100)
    with pytest.raises(ConfigError, match="partition_bytes"):
        ServerConfig(partition_bytes=10)


def test_allow_nonfinite_switch():
    assert WorkerOptions.from_env({}).allow_nonfinite is False
    assert WorkerOptions.from_env({"KVSTORE_ALLOW_NONFINITE": "1"}).allow_nonfinite is True
    with pytest.raises(ConfigError, match="KVSTORE_ALLOW_NONFINITE='maybe' must be 0 or 1"):
        WorkerOptions.from_env({"KVSTORE_ALLOW_NONFINITE": "maybe"})


def test_the_value_itemsizes_are_the_wire_dtypes():
    from kvstore.wire import DTYPES

    assert sorted({np.dtype(d).itemsize for d in DTYPES}) == list(VALUE_ITEMSIZES)
