"""How the cluster benchmark shares this machine's cores among its emulated hosts."""

from __future__ import annotations

import pytest

from benchmarks.netns import host_cpus


def test_fewer_cores_than_hosts_gives_each_host_one_core_in_turn():
    assert host_cpus(5, [0, 1]) == [(0,), (1,), (0,), (1,), (0,)]
    # the cores this process may use, whatever their numbers and order
    assert host_cpus(3, [7, 3]) == [(3,), (7,), (3,)]


def test_more_cores_than_hosts_gives_each_host_its_own_contiguous_share():
    assert host_cpus(2, range(8)) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # leftover cores go to the first hosts, one each; no core is given twice
    shares = host_cpus(3, range(8))
    assert shares == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert sorted(c for share in shares for c in share) == list(range(8))
    assert host_cpus(2, [0, 1]) == [(0,), (1,)]
    assert host_cpus(1, [0, 1]) == [(0, 1)]
    assert host_cpus(0, [0, 1]) == []


def test_no_cores_or_a_negative_host_count_is_refused():
    with pytest.raises(ValueError, match="no cores"):
        host_cpus(2, [])
    with pytest.raises(ValueError, match="num_hosts must be >= 0"):
        host_cpus(-1, [0])
