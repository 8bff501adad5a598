"""Topology: stable placement of small keys, 16-aligned splits of big ones, chunking."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstore.topology import (
    WORD_ELEMS,
    chunk_sizes,
    interleaved_order,
    min_chunk_elems,
    plan_chunks,
    server_for_key,
    slice_chunking,
    split_bounds,
    stable_key_hash,
)

MB = 1_000_000


def test_hash_is_stable_across_runs_and_processes():
    values = [stable_key_hash(k) for k in (0, 1, -1, 2**62, "w", "conv1.weight", "")]
    code = (
        "from kvstore.topology import stable_key_hash as h;"
        "print([h(k) for k in (0, 1, -1, 2**62, 'w', 'conv1.weight', '')])"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        assert out.strip() == str(values)


def test_golden_hash_values():
    # Frozen: a change here moves every key of every existing job to another server.
    assert [stable_key_hash(k) for k in (0, 1, "w")] == [
        0x36A9A4603B97BEC7,
        0xB5C1FA3EA5B662FA,
        0xCE8654649BBD6FCC,
    ]
    assert [server_for_key(k, 4) for k in ("w", "conv1.weight", 3, 7)] == [0, 0, 3, 2]


def test_int_and_str_keys_differ():
    assert stable_key_hash(1) != stable_key_hash("1")


def test_hash_rejects_other_types():
    with pytest.raises(TypeError, match="int or str"):
        stable_key_hash(1.0)
    with pytest.raises(TypeError):
        stable_key_hash(True)


def test_small_keys_spread_over_servers():
    counts = [0, 0, 0, 0]
    for key in range(4000):
        counts[server_for_key(key, 4)] += 1
    assert min(counts) > 800


@pytest.mark.parametrize("numel", [MB, 1_500_000, 1_000_007, 25_557_032])
@pytest.mark.parametrize("servers", [2, 3, 4, 7])
def test_split_bounds_are_contiguous_balanced_and_16_aligned(numel, servers):
    bounds = split_bounds(numel, servers)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, stop), (start, _) in zip(bounds, bounds[1:], strict=False):
        assert stop == start
    for start, stop in bounds[:-1]:
        assert start % WORD_ELEMS == 0 and stop % WORD_ELEMS == 0
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= WORD_ELEMS


def test_key_of_1_5m_elements_over_two_servers():
    chunks = plan_chunks("big", 1_500_000, 2, bigarray_bound=MB, partition_elems=2**30)
    slices = {}
    for c in chunks:
        lo, hi = slices.get(c.server, (c.start, c.stop))
        slices[c.server] = (min(lo, c.start), max(hi, c.stop))
    assert slices == {0: (0, 750_000), 1: (750_000, 1_500_000)}


def test_slices_are_cut_into_16_chunks_and_long_ones_into_32_within_bounds():
    p = 1 << 20
    assert min_chunk_elems(p) == p // 4 and min_chunk_elems(p, 8) == p // 8
    # Slices under 4 partitions: 16 chunks, but none shorter than a quarter partition.
    assert slice_chunking(p, p) == (p // 4, p // 4)
    assert slice_chunking(100, p) == (p // 4, p // 4)
    assert slice_chunking(4 * p - 16, p) == (p // 4, p // 4)
    # Long slices: 32 chunks of at least an eighth, none longer than the partition.
    assert slice_chunking(4 * p, p) == (p // 8, p // 8)
    assert slice_chunking(8 * p, p) == (p // 4, p // 8)
    assert slice_chunking(40 * p, p) == (p, p // 8)
    chunks = plan_chunks("w", 40_000_000, 4, bigarray_bound=MB, partition_elems=p)
    per_server = [[c for c in chunks if c.server == s] for s in range(4)]
    for mine in per_server:
        assert len(mine) >= 32
        assert max(c.numel for c in mine) <= 10_000_000 // 32 + 16


def test_a_slice_is_long_by_the_bytes_of_its_whole_key():
    p = 1 << 20
    # A 10M-element key over 4 servers: 2.5M-element slices of a 10M-element (long) key, cut
    # into 19 chunks of at least an eighth partition each; the slice alone would not be long.
    assert slice_chunking(2_500_000, p) == (p // 4, p // 4)
    assert slice_chunking(2_500_000, p, key_elems=10_000_000) == (p // 8, p // 8)
    chunks = plan_chunks("w", 10_000_000, 4, bigarray_bound=MB, partition_elems=p)
    per_server = [[c for c in chunks if c.server == s] for s in range(4)]
    assert [len(mine) for mine in per_server] == [19] * 4
    assert min(c.numel for c in chunks) >= p // 8
    # A key under 4 partitions keeps 16 chunks of at least a quarter partition, whole on one
    # server or split; so do compressed pushes and loopback of a long key.
    for servers, bound in ((4, 10 * MB), (4, MB), (1, MB)):
        short = plan_chunks("w", 2_359_296, servers, bigarray_bound=bound, partition_elems=p)
        assert min(c.numel for c in short) >= p // 4
    for fraction in (1 / 16, 0.0):
        kwargs = dict(bigarray_bound=MB, partition_elems=p, wire_fraction=fraction)
        assert len(plan_chunks("w", 10_000_000, 4, **kwargs)) == 36


def test_a_slice_is_long_by_the_bytes_its_pushes_carry():
    p = 1 << 20
    # 2-bit pushes carry 1/16 of the value's bytes: a 10M-element slice is not long for them
    # (16 chunks of at least a quarter partition), a dense one is (32 of at least an eighth).
    assert slice_chunking(10_000_000, p, 1 / 16) == (625_008, p // 4)
    assert slice_chunking(10_000_000, p) == (312_512, p // 8)
    assert slice_chunking(64 * p, p, 1 / 16) == (p, p // 8)
    dense = plan_chunks("w", 10_000_000, 1, bigarray_bound=MB, partition_elems=p)
    compressed = plan_chunks(
        "w", 10_000_000, 1, bigarray_bound=MB, partition_elems=p, wire_fraction=1 / 16
    )
    assert len(dense) >= 32 and 16 <= len(compressed) < 20
    # Over loopback nothing crosses a link (wire fraction 0): never long.
    assert slice_chunking(40 * p, p, 0.0) == (p, p // 4)


def test_no_chunk_is_shorter_than_a_quarter_partition_unless_its_slice_is():
    p = 1 << 20
    for numel, servers in ((10_000_000, 1), (10_000_000, 4), (2_359_296, 1), (262_144, 1)):
        chunks = plan_chunks("w", numel, servers, bigarray_bound=MB, partition_elems=p)
        slices: dict[int, int] = {}
        for c in chunks:
            slices[c.server] = slices.get(c.server, 0) + c.numel
        for c in chunks:
            # ... or an eighth in a long slice (of a key of at least 4 partitions)
            shortest = p // 8 if numel >= 4 * p else p // 4
            assert c.numel >= min(shortest, slices[c.server]), (numel, servers, c)
    # A middle-sized tensor is a few chunks, not a ramp of small ones.
    middle = plan_chunks("w", 589_824, 1, bigarray_bound=MB, partition_elems=p)
    assert [c.numel for c in middle] == [294_912, 294_912]
    assert len(plan_chunks("w", 65_536, 1, bigarray_bound=MB, partition_elems=p)) == 1


def test_chunk_sizes_ramp_up_and_down():
    p = 1 << 20
    e = p // 8
    q = 13 * p // 16  # the 3.25 partitions between the ramps, cut evenly in 4
    assert chunk_sizes(5 * p, p) == [e, 2 * e, 4 * e, q, q, q, q, 4 * e, 2 * e, e]
    # Ramp steps below the minimum are left out.
    r = 7 * p // 8  # 3.5 partitions cut evenly in 4
    assert chunk_sizes(5 * p, p, p // 4) == [2 * e, 4 * e, r, r, r, r, 4 * e, 2 * e]
    assert chunk_sizes(100, p) == [100]
    assert chunk_sizes(0, p) == [0]
    assert chunk_sizes(40, 16) == [16, 24]  # the 8 left over join the last chunk
    for length in (10_000_000, 1_000_007, 5 * p + 3, 160_000, 33):
        for minimum in (16, p // 4):
            sizes = chunk_sizes(length, p, minimum)
            assert sum(sizes) == length
            assert all(s % 16 == 0 for s in sizes[:-1])  # boundaries on whole 2-bit words
            assert max(sizes) <= p + 15
            assert min(sizes) >= min(minimum, length)


def test_keys_below_the_bound_stay_whole():
    chunks = plan_chunks("w", MB - 1, 4, bigarray_bound=MB, partition_elems=2**30)
    assert len(chunks) == 1
    assert chunks[0].server == server_for_key("w", 4)
    assert (chunks[0].start, chunks[0].stop) == (0, MB - 1)


def test_the_bound_itself_splits():
    chunks = plan_chunks("w", MB, 4, bigarray_bound=MB, partition_elems=2**30)
    assert [c.server for c in chunks] == [0, 1, 2, 3]


def test_partitions_cut_slices_on_16_element_boundaries():
    chunks = plan_chunks(5, 1_000_007, 2, bigarray_bound=MB, partition_elems=16_000)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert chunks[0].start == 0 and chunks[-1].stop == 1_000_007
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.stop == b.start
        assert a.stop % WORD_ELEMS == 0
        assert a.numel <= 16_000
    assert {c.server for c in chunks} == {0, 1}
    # chunks of one server are contiguous and in order
    assert [c.server for c in chunks] == sorted(c.server for c in chunks)


def test_tiny_big_array_skips_empty_slices_and_empty_keys_have_one_chunk():
    chunks = plan_chunks("t", 20, 4, bigarray_bound=1, partition_elems=16)
    assert sum(c.numel for c in chunks) == 20
    assert all(c.numel > 0 for c in chunks)
    empty = plan_chunks("e", 0, 4, bigarray_bound=MB, partition_elems=16)
    assert len(empty) == 1 and empty[0].numel == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 16"):
        plan_chunks(1, 10, 1, bigarray_bound=MB, partition_elems=10)
    with pytest.raises(ValueError):
        plan_chunks(1, -1, 1, bigarray_bound=MB, partition_elems=16)
    with pytest.raises(ValueError):
        server_for_key(1, 0)


def test_interleaved_order_takes_each_slices_next_chunk_in_turn():
    chunks = plan_chunks("k", 1000, 2, bigarray_bound=1, partition_elems=160)
    by_server = [[c.index for c in chunks if c.server == s] for s in (0, 1)]
    order = [c.index for c in interleaved_order(chunks)]
    assert sorted(order) == [c.index for c in chunks]  # every chunk once
    # first chunks of both slices, then the second ones, and so on
    expected = [i for pair in zip(*by_server, strict=False) for i in pair]
    assert order[: len(expected)] == expected
    assert len(by_server[0]) > 1 and len(by_server[1]) > 1
