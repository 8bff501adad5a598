"""The hivemind peer's workers' helpers (:mod:`benchmarks.hivemind_peer`): the peer file by
which workers find rank 0, the listen address, the choice of parameter averaging period and of
hivemind's compression, the lockstep of rounds; and the workers' options."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kvtest import reports_of_workers

from benchmarks.common import REPO
from benchmarks.hivemind_mnist import parse_args
from benchmarks.hivemind_peer import (
    COMPRESSIONS,
    announce_batch,
    check_compression,
    compression_named,
    listen_maddr,
    read_peer_file,
    state_averaging_period,
    write_peer_file,
)

MADDRS = [
    "/ip4/10.0.0.1/tcp/4100/p2p/12D3KooWPkhEpwjgLKv3ybpuAozhTj1aHWtEwgajW3fkaR5iymBV",
    "/ip4/10.0.0.1/tcp/4100/p2p/12D3KooWQmq3dqYJ2oSykCxJ8wVJrKuoAf9FAaR7vqZP3b7qjCv4",
]


@dataclass
class Progress:
    """What hivemind's progress tracker knows of the swarm's round."""

    epoch: int
    samples_accumulated: int


@dataclass
class Tracker:
    """hivemind's progress tracker, as far as announce_batch uses it."""

    target_batch_size: int
    global_progress: Progress
    reports: list[tuple[int, int]] = field(default_factory=list)

    def report_local_progress(self, local_epoch: int, samples_accumulated: int) -> None:
        self.reports.append((local_epoch, samples_accumulated))
        self.global_progress.samples_accumulated += samples_accumulated


@dataclass
class Optimizer:
    """hivemind's optimizer, as far as announce_batch uses it."""

    tracker: Tracker
    use_local_updates: bool = False
    local_epoch: int = 3


def optimizer(workers: int, *, local_updates: bool = False) -> Optimizer:
    tracker = Tracker(target_batch_size=workers * 32, global_progress=Progress(3, 0))
    return Optimizer(tracker, use_local_updates=local_updates)


def worker_args(*extra: str) -> list[str]:
    return ["--rank", "1", "--num-workers", "4", "--peer-file", "peers", *extra]


def test_listen_maddr_is_tcp_on_the_given_address() -> None:
    assert listen_maddr("10.0.0.2", 4100) == "/ip4/10.0.0.2/tcp/4100"
    assert listen_maddr("127.0.0.1", 0) == "/ip4/127.0.0.1/tcp/0"


def test_peer_file_round_trips_every_maddr(tmp_path: Path) -> None:
    path = tmp_path / "peers"
    write_peer_file(path, MADDRS)
    assert read_peer_file(path, timeout=0) == MADDRS
    assert [entry.name for entry in tmp_path.iterdir()] == ["peers"]  # no partial file left


def test_peer_file_replaces_a_stale_one(tmp_path: Path) -> None:
    path = tmp_path / "peers"
    write_peer_file(path, MADDRS)
    write_peer_file(path, MADDRS[1:])
    assert read_peer_file(path, timeout=0) == MADDRS[1:]


def test_reader_waits_for_the_file_to_appear(tmp_path: Path) -> None:
    path = tmp_path / "peers"
    writer = threading.Timer(0.2, write_peer_file, args=(path, MADDRS))
    writer.start()
    try:
        assert read_peer_file(path, timeout=60, poll=0.01) == MADDRS
    finally:
        writer.join()


def test_reader_gives_up_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "peers"
    with pytest.raises(TimeoutError, match="start rank 0 first") as raised:
        read_peer_file(path, timeout=0.05, poll=0.01)
    assert str(path) in str(raised.value)


def test_an_empty_peer_file_is_not_an_answer(tmp_path: Path) -> None:
    path = tmp_path / "peers"
    path.write_text("\n")
    with pytest.raises(TimeoutError):
        read_peer_file(path, timeout=0.05, poll=0.01)


def test_parameters_are_averaged_every_round_with_local_updates() -> None:
    assert state_averaging_period(parse_args(worker_args("--local-updates"))) == 1
    assert state_averaging_period(parse_args(worker_args())) == 10
    chosen = parse_args(worker_args("--local-updates", "--average-state-every", "4"))
    assert state_averaging_period(chosen) == 4


def test_options_mirror_the_ddp_worker() -> None:
    args = parse_args(worker_args("--model", "mlp", "--lr", "0.1", "--wd", "0"))
    assert (args.rank, args.num_workers, args.model, args.lr, args.wd) == (1, 4, "mlp", 0.1, 0.0)
    assert (args.batch_size, args.momentum, args.seed, args.epochs) == (32, 0.9, 0, 8)
    assert args.compression == "none" and not args.local_updates


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("none", "NoCompression"),
        ("fp16", "Float16Compression"),
        ("uint8", "Uniform8BitQuantization"),
    ],
)
def test_compression_names_are_hivemind_s(name: str, kind: str) -> None:
    pytest.importorskip("hivemind")
    assert name in COMPRESSIONS
    assert type(compression_named(name)).__name__ == kind


def test_a_batch_is_announced_for_the_current_round_and_counted_once() -> None:
    alone = optimizer(1)
    assert announce_batch(alone, 32, timeout=60) == 32  # step accumulates it: reports no more
    assert alone.tracker.reports == [(3, 32)]
    local = optimizer(1, local_updates=True)
    assert announce_batch(local, 32, timeout=60) == 0  # step adds its batch size to the report


def test_announcing_waits_for_the_other_workers_batches() -> None:
    opt = optimizer(2)
    progress = opt.tracker.global_progress

    def other_worker_reports() -> None:
        progress.samples_accumulated += 32

    other = threading.Timer(0.2, other_worker_reports)
    other.start()
    try:
        announce_batch(opt, 32, timeout=60)
        assert progress.samples_accumulated == 64  # it returned only once the round was whole
    finally:
        other.join()


def test_announcing_stops_waiting_once_a_peer_is_past_the_round() -> None:
    opt = optimizer(4)
    opt.tracker.global_progress.epoch = 4
    assert announce_batch(opt, 32, timeout=60) == 32


def test_announcing_gives_up_after_its_timeout() -> None:
    opt = optimizer(2)
    assert announce_batch(opt, 32, timeout=0.05) == 32
    assert opt.tracker.global_progress.samples_accumulated == 32


@pytest.mark.parametrize("name", ["none", "fp16"])
def test_lossless_and_half_precision_codecs_pass_the_check(name: str) -> None:
    pytest.importorskip("hivemind")
    check_compression(compression_named(name))


@pytest.mark.parametrize("local_updates", [False, True])
def test_two_workers_train_the_language_model_on_loopback(
    tmp_path: Path, local_updates: bool
) -> None:
    pytest.importorskip("hivemind")
    tiny = ["--layers", "1", "--width", "32", "--heads", "4", "--context", "32",
            "--steps", "4", "--eval-every", "2", "--warmup", "1", "--val-windows", "8"]  # fmt: skip
    common = ["--num-workers", "2", "--host", "127.0.0.1", "--peer-file",
              str(tmp_path / "rank0"), "--compression", "fp16",
              *(["--local-updates"] if local_updates else []), *tiny]  # fmt: skip
    argvs = [
        [sys.executable, "-m", "benchmarks.hivemind_charlm", "--rank", str(rank), *common]
        for rank in range(2)
    ]
    lines = reports_of_workers(argvs, cwd=REPO)
    assert [line["step"] for line in lines] == [2, 4]
    assert lines[-1]["hivemind_epoch"] == 4  # one collective round per step of every worker
    assert lines[-1]["hivemind_peers"] == 2
    assert lines[1]["perplexity"] < lines[0]["perplexity"] < 256  # better than uniform bytes
