"""Replication's pure parts: where each shard's replicas are, and the packing of a round's
pushes into the one frame a primary forwards."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.config import ServerConfig, WorkerOptions
from kvstore.errors import ConfigError
from kvstore.server.errors import RequestError
from kvstore.server.replication import ALIGN, pack_pushes, unpack_pushes
from kvstore.topology import backed_up_shards, replica_servers


def test_each_shard_lives_on_its_primary_and_the_next_servers():
    assert replica_servers(0, 3, 1) == (0,)
    assert replica_servers(1, 3, 2) == (1, 2)
    assert replica_servers(2, 3, 2) == (2, 0)
    assert replica_servers(3, 4, 3) == (3, 0, 1)


def test_a_server_backs_up_the_shards_of_the_servers_before_it():
    assert backed_up_shards(0, 3, 1) == ()
    assert backed_up_shards(0, 3, 2) == (2,)
    assert backed_up_shards(1, 4, 3) == (0, 3)
    for server in range(5):
        for shard in backed_up_shards(server, 5, 3):
            assert server in replica_servers(shard, 5, 3)


def test_packed_pushes_come_back_frame_for_frame_and_aligned():
    pushes = [
        [np.arange(5, dtype=np.float32), b"abc"],
        [b""],
        [np.arange(130, dtype=np.uint8)],
    ]
    packed, sizes, frames = pack_pushes(pushes)
    assert sizes == [20, 3, 0, 130] and frames == [2, 1, 1]
    back = unpack_pushes(bytes(packed), sizes, frames)
    assert [[bytes(f) for f in push] for push in back] == [
        [bytes(memoryview(f).cast("B")) for f in push] for push in pushes
    ]
    offsets = [f.obj is back[0][0].obj for push in back for f in push]
    assert all(offsets)  # views of the one frame, not copies
    assert len(packed) % ALIGN == 0


def test_sizes_that_do_not_add_up_are_refused():
    packed, sizes, frames = pack_pushes([[b"abcd"]])
    with pytest.raises(RequestError, match="do not add up"):
        unpack_pushes(bytes(packed), [4, 4], frames)
    with pytest.raises(RequestError, match="do not add up"):
        unpack_pushes(bytes(packed) + bytes(ALIGN), sizes, frames)


def test_replicas_are_bounded_by_the_servers():
    with pytest.raises(ConfigError, match="KVSTORE_REPLICAS must be >= 1"):
        WorkerOptions(replicas=0)
    with pytest.raises(ConfigError, match="needs at least 3 servers"):
        ServerConfig(num_servers=2, replicas=3)
    with pytest.raises(ConfigError, match="lists 1 servers"):
        ServerConfig(num_servers=2, replicas=2, peers=("tcp://a:1",))
    assert ServerConfig.from_env(
        {"KVSTORE_REPLICAS": "2", "KVSTORE_SERVERS": "tcp://a:1,tcp://b:2"}, num_servers=2
    ).peers == ("tcp://a:1", "tcp://b:2")
