"""The torchft peer's workers (:mod:`benchmarks.torchft_peer`, :mod:`benchmarks.torchft_mnist`,
:mod:`benchmarks.torchft_charlm`): the address helpers, the model they evaluate, and two workers
of each workload training on loopback (skipped where torchft is not installed)."""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import sys

import pytest
from kvtest import reports_of_workers

from benchmarks.common import REPO
from benchmarks.torchft_mnist import parse_args
from benchmarks.torchft_peer import interface_of, lighthouse_url, split_address

needs_torchft = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None, reason="torchft (the bench extra) not installed"
)


def test_split_address_reads_host_and_port() -> None:
    assert split_address("10.77.0.1:29510") == ("10.77.0.1", 29510)
    assert split_address("[::1]:29510") == ("::1", 29510)


@pytest.mark.parametrize("address", ["10.77.0.1", "10.77.0.1:", ":29510", "host:port"])
def test_split_address_refuses_what_is_no_host_and_port(address: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address(address)


def test_lighthouse_url_brackets_ipv6_hosts() -> None:
    assert lighthouse_url("10.77.0.1:29510") == "http://10.77.0.1:29510"
    assert lighthouse_url("[::1]:29510") == "http://[::1]:29510"


def test_interface_of_finds_loopback_and_nothing_else() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: on no interface
    assert interface_of("not an address") is None


def test_parse_args_keeps_the_lighthouse_on_rank_0() -> None:
    common = ["--num-workers", "2", "--host", "127.0.0.1", "--lighthouse", "127.0.0.1:1"]
    args = parse_args(["--rank", "0", *common, "--start-lighthouse"])
    assert args.start_lighthouse and args.mode == "diloco"
    assert (args.outer_lr, args.outer_momentum) == (0.7, 0.9)
    with pytest.raises(SystemExit):
        parse_args(["--rank", "1", *common, "--start-lighthouse"])
    with pytest.raises(SystemExit):
        parse_args(["--rank", "0", *common, "--sync-every", "0"])


def test_synced_model_takes_the_weights_only_after_a_sync() -> None:
    torch = pytest.importorskip("torch")
    from benchmarks.torchft_peer import SyncedModel

    model = torch.nn.Linear(3, 2)
    syncs = [0]
    synced = SyncedModel(model, lambda: syncs[0])
    evaluated = synced.model.get_parameter("weight")
    start = evaluated.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # a local step
    assert not synced.refresh()
    assert torch.equal(evaluated, start)
    syncs[0] = 1  # the manager committed a sync: the model holds the global weights
    assert synced.refresh()
    assert torch.equal(evaluated, model.weight)
    assert evaluated.data_ptr() != model.weight.data_ptr()


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


TINY_LM = ["--layers", "1", "--width", "32", "--heads", "4", "--context", "32",
           "--steps", "6", "--eval-every", "3", "--warmup", "2", "--val-windows", "8"]  # fmt: skip
"""A language model small enough to train six steps in seconds."""


def _train_on_loopback(module: str, mode: str, training: list[str]) -> list[dict]:
    """Two workers of ``module`` in ``mode`` syncing every 3 steps (MNIST: 8), on loopback;
    worker 0's reports, once both exited 0 having said nothing else on stdout."""
    lighthouse, *ports = _free_ports(5)
    common = ["--num-workers", "2", "--host", "127.0.0.1", "--lighthouse",
              f"127.0.0.1:{lighthouse}", "--mode", mode, *training]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    argvs = [
        [sys.executable, "-m", module, "--rank", str(rank), *common,
         "--store-port", str(ports[2 * rank]), "--manager-port", str(ports[2 * rank + 1]),
         *(["--start-lighthouse"] if rank == 0 else [])]
        for rank in range(2)
    ]  # fmt: skip
    return reports_of_workers(argvs, cwd=REPO, env=env)


@needs_torchft
@pytest.mark.parametrize("mode", ["diloco", "localsgd"])
def test_two_workers_train_an_epoch_on_loopback_and_exit(mode: str) -> None:
    training = ["--sync-every", "8", "--model", "mlp", "--epochs", "1"]
    lines = _train_on_loopback("benchmarks.torchft_mnist", mode, training)
    assert [line["epoch"] for line in lines] == [1]
    assert lines[0]["accuracy"] > 0.3  # trained past chance (0.1) on the synced weights


@needs_torchft
def test_two_workers_train_the_language_model_and_report_the_synced_model() -> None:
    lines = _train_on_loopback("benchmarks.torchft_charlm", "diloco",
                               ["--sync-every", "3", *TINY_LM])  # fmt: skip
    assert [line["step"] for line in lines] == [3, 6]
    assert [line["samples"] for line in lines] == [3 * 16 * 2, 6 * 16 * 2]
    # the synced model after one and two outer steps: better than uniform bytes (256)
    assert all(math.isfinite(line["perplexity"]) for line in lines)
    assert lines[1]["perplexity"] < lines[0]["perplexity"] < 256
