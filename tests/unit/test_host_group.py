"""The host group of hierarchical aggregation (:mod:`kvstore.worker.host_group`) on its own: how
a key's elements and chunks are shared out, the host's meetings and what they pass on, and the
shared memory a key maps. Workers of a "host" are threads here (no servers)."""

from __future__ import annotations

import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvstore.config import ClusterConfig
from kvstore.errors import ConfigError, KVStoreError, KVStoreTimeoutError, WorkerLostError
from kvstore.topology import Chunk
from kvstore.worker.host_group import HostGroup, group_tag, reduce_slice, sum_slots
from kvstore.worker.request import Deadline

SERVERS = ("tcp://127.0.0.1:1",)


def _chunks(sizes: list[int]) -> list[Chunk]:
    chunks, start = [], 0
    for index, size in enumerate(sizes):
        chunks.append(Chunk(index=index, server=0, start=start, stop=start + size))
        start += size
    return chunks


def _group(size: int, servers: tuple[str, ...] = SERVERS) -> list[HostGroup]:
    """The ``size`` workers of host 0, made at once (each waits for the others' hellos)."""
    clusters = [ClusterConfig(servers, rank, size, rank, size) for rank in range(size)]
    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(lambda c: HostGroup(c, connect_timeout=10), clusters))


def _together(groups: list[HostGroup], work) -> list:
    with ThreadPoolExecutor(len(groups)) as pool:
        futures = [pool.submit(work, group) for group in groups]
        return [f.exception() or f.result() for f in futures]


def test_reduce_slices_cover_the_key_once_on_word_boundaries():
    for numel in (0, 1, 15, 16, 17, 1000, 4099):
        for parts in (1, 2, 3, 4, 8):
            slices = [reduce_slice(numel, parts, part) for part in range(parts)]
            assert slices[0][0] == 0 and slices[-1][1] == numel
            for (_, stop), (start, _) in zip(slices, slices[1:], strict=False):
                assert stop == start and (start % 16 == 0 or start == numel)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_a_slice_sums_its_slots_in_row_order_block_by_block(monkeypatch, rows):
    import kvstore.worker.host_group as host_group

    monkeypatch.setattr(host_group, "_SUM_BLOCK", 64)  # many blocks, the last one short
    slots = np.random.default_rng(rows).normal(size=(rows, 1000)).astype(np.float32)
    out = np.full(1000, -1.0, np.float32)
    sum_slots(slots, 37, 901, out)
    expected = slots[0].copy()
    for slot in slots[1:]:
        expected += slot  # one float32 add per row, in row order: the same bits
    np.testing.assert_array_equal(out[37:901], expected[37:901])
    assert (out[:37] == -1).all() and (out[901:] == -1).all()


def test_chunks_go_to_the_least_loaded_worker_and_whole_key_codecs_to_one():
    groups = _group(2)
    try:
        shared = _chunks([100, 100, 100, 100])
        owned = [g.plan("a", shared, 4, whole=False) for g in groups]
        assert owned == [{0, 2}, {1, 3}]  # alternating, each half of the bytes
        whole = [g.plan("b", _chunks([50, 50]), 4, whole=True) for g in groups]
        assert whole == [{0, 1}, set()]  # both chunks to one worker (loads were equal)
        later = [g.plan("c", _chunks([10]), 4, whole=False) for g in groups]
        assert later == [set(), {0}]  # to the less loaded one
    finally:
        for group in groups:
            group.close()


def test_a_host_sums_its_workers_pushes_and_shares_a_pull():
    groups = _group(3)
    try:
        deadline = Deadline(10)
        _together(groups, lambda g: g.add_key("w", 40, "float32", deadline))

        def step(group: HostGroup) -> np.ndarray:
            value = np.full(40, group.local_rank + 1, np.float32)
            [total] = group.host_sums([("w", value)], deadline)
            seen = total.copy()
            [result] = group.pull_into(["w"], deadline)
            if group.local_rank == 0:
                result[:] = np.arange(40)  # as an owner's pulled chunks would land
            out = np.empty(40, np.float32)
            group.pulled(["w"], [out], deadline)
            return np.stack([seen, out])

        for seen, out in _together(groups, step):
            np.testing.assert_array_equal(seen, np.full(40, 6.0))  # 1 + 2 + 3
            np.testing.assert_array_equal(out, np.arange(40))
    finally:
        for group in groups:
            group.close()
    # every segment was unlinked once all had mapped it: nothing is left in /dev/shm
    if Path("/dev/shm").is_dir():
        assert not [p for p in Path("/dev/shm").iterdir() if groups[0].tag in p.name]


def test_a_failure_is_passed_on_to_the_host_s_other_workers():
    groups = _group(2)
    try:
        deadline = Deadline(10)

        def meet(group: HostGroup) -> None:
            lost = WorkerLostError("worker 7 went away", rank=7)
            group.meet(("step", 1), deadline, lost if group.local_rank == 0 else None)

        mine, theirs = _together(groups, meet)
        assert isinstance(mine, WorkerLostError) and str(mine) == "worker 7 went away"
        assert isinstance(theirs, WorkerLostError) and theirs.rank == 7
        assert "worker rank 0 of this host failed" in str(theirs)

        def fail(group: HostGroup) -> None:
            oops = ValueError("bad value") if group.local_rank == 1 else None
            group.meet(("step", 2), deadline, oops)

        first, second = _together(groups, fail)
        assert isinstance(second, ValueError)
        assert isinstance(first, KVStoreError) and "ValueError: bad value" in str(first)
    finally:
        for group in groups:
            group.close()


def test_a_worker_that_does_not_come_times_out_naming_it_and_a_dead_one_is_lost():
    groups = _group(2)
    try:
        with pytest.raises(KVStoreTimeoutError, match=r"rank\(s\) \[1\] on this host"):
            groups[0].meet(("alone", 1), Deadline(0.3))
        groups[0]._pids[1] = _dead_pid()  # as if local worker 1's process had died
        with pytest.raises(WorkerLostError, match="local rank 1 on this host") as lost:
            groups[0].meet(("alone", 2), Deadline(10))
        assert lost.value.rank == 1
    finally:
        for group in groups:
            group.close()


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_hosts_and_jobs_get_groups_of_their_own():
    assert group_tag(SERVERS, 0) == group_tag(list(SERVERS), 0)
    assert group_tag(SERVERS, 0) != group_tag(SERVERS, 1)
    assert group_tag(SERVERS, 0) != group_tag(("tcp://127.0.0.1:2",), 0)


@pytest.mark.parametrize(
    ("rank", "num_workers", "local_rank", "local_size", "message"),
    [
        (1, 4, 0, 2, "cannot be local rank 0 of 2 per host"),  # ranks must be consecutive
        (0, 3, 0, 2, "every host must run KVSTORE_LOCAL_SIZE workers"),
        (0, 4, 2, 2, "local rank 2 is out of range"),
    ],
)
def test_a_place_on_a_host_that_cannot_be_is_refused(
    rank, num_workers, local_rank, local_size, message
):
    with pytest.raises(ConfigError, match=message):
        ClusterConfig(SERVERS, rank, num_workers, local_rank, local_size)


def test_meetings_are_told_apart_by_their_tag():
    groups = _group(2)
    try:
        deadline = Deadline(10)
        barrier = threading.Barrier(2)

        def two_meetings(group: HostGroup) -> None:
            # worker 1 reaches the second meeting's message before worker 0 leaves the first
            group.meet(("first",), deadline)
            barrier.wait()
            group.meet(("second",), deadline)

        assert _together(groups, two_meetings) == [None, None]
    finally:
        for group in groups:
            group.close()


def test_a_worker_waiting_long_for_its_host_says_why(monkeypatch, caplog):
    import kvstore.worker.host_group as host_group

    monkeypatch.setattr(host_group, "_WARN_AFTER", 0.1)
    groups = _group(2)
    try:
        with pytest.raises(KVStoreTimeoutError):
            groups[0].meet(("alone",), Deadline(0.6))
        assert "must make the same calls in the same order" in caplog.text
        assert "KVSTORE_HIERARCHY=0" in caplog.text
    finally:
        for group in groups:
            group.close()


def test_a_key_of_gpu_values_that_cannot_be_mapped_is_summed_in_host_memory(caplog):
    # Workers that are threads of one process can never map each other's GPU memory (CUDA IPC
    # refuses a handle in its own process), and without CuPy there is nothing to map: either
    # way the host agrees to keep the key in host memory, and says why.
    groups = _group(2)
    try:
        deadline = Deadline(10)
        _together(groups, lambda g: g.add_key("w", 40, "float32", deadline, device=0))
        assert [g.summed_on_gpu("w") for g in groups] == [False, False]
        assert "summed in host memory, not on the GPUs through CUDA IPC" in caplog.text

        def step(group: HostGroup) -> np.ndarray:
            [total] = group.host_sums(
                [("w", np.full(40, group.local_rank + 1, np.float32))], deadline
            )
            return total.copy()

        for total in _together(groups, step):
            np.testing.assert_array_equal(total, np.full(40, 3.0))
    finally:
        for group in groups:
            group.close()
