"""The README's main job: MNIST with 2-bit compression under kvstore-launch, and uncompressed;
its plot, its progress bars (on a terminal only), and its training steps through kvstore.torch
against the hand-written push and pull loop they replaced."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pty
import re
import select
import shlex
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from kvtest import REPO, connect, run_ranks

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TRAIN = REPO / "examples/mnist/train.py"

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _require_example_dependencies() -> None:
    for module in ("torch", "mlxtend", "tqdm"):
        pytest.importorskip(module)


def _train(*args: str) -> tuple[list[tuple[str, ...]], list[tuple[str, str]], str]:
    """Run the example on 2 workers x 2 servers; worker 0's epoch lines (epoch, loss, test
    accuracy, compression), every rank's final line (rank, accuracy), and the output (stdout,
    then stderr: the launcher forwards each child's streams to its own)."""
    _require_example_dependencies()
    command = [sys.executable, "-m", "kvstore.deploy", "-n", "2", "-s", "2", "--"]
    command += [sys.executable, str(TRAIN), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    epochs = re.findall(
        r"\[worker 0\] epoch (\d): loss ([\d.]+)  test accuracy ([\d.]+)%.*compression ([\d.]+)x",
        result.stdout,
    )
    done = re.findall(r"rank (\d) done: test accuracy ([\d.]+)%", result.stdout)
    return epochs, done, result.stdout + result.stderr


# A tqdm bar: "epoch 1:  53%|█████▎    | 8/15 [00:00<00:00, 77.90step/s, loss=2.3061]".
_BAR = re.compile(r"\d+/\d+ \[[^\]]*step/s")


def test_mnist_example_trains_uncompressed_plots_and_keeps_piped_output_free_of_bars(tmp_path):
    # Uncompressed, through the DistributedOptimizer: the job must train, both workers ending
    # with the same weights. (README's quickstart test trains the 2-bit default for 8 epochs,
    # and the convergence smoke test trains both for one.)
    plot = tmp_path / "mnist.png"
    epochs, done, output = _train(
        "--epochs", "2", "--batch-size", "128", "--compression", "none", "--plot", str(plot)
    )
    assert [int(e[0]) for e in epochs] == [1, 2], output
    assert float(epochs[-1][1]) < float(epochs[0][1])  # the loss falls
    assert float(epochs[-1][2]) > 50.0  # test accuracy after 30 steps, chance is 10%
    assert all(0.95 < float(e[3]) < 1.05 for e in epochs)  # dense: no compression
    assert sorted(r for r, _ in done) == ["0", "1"]
    assert len({acc for _, acc in done}) == 1  # both workers hold the same weights
    # worker 0 plots, after training, and worker 1 does not
    assert f"[worker 0] rank 0 wrote {plot}" in output and "rank 1 wrote" not in output
    # a whole PNG: the signature, the IHDR chunk first, the IEND chunk (and its CRC) last
    data = plot.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    assert data.endswith(b"IEND\xaeB`\x82"), "the PNG was cut short"
    width, height = struct.unpack(">II", data[16:24])
    assert width > height > 0  # two panels side by side
    # The launcher reads every child's output from pipes: no bar, no carriage return.
    assert not _BAR.search(output) and "\r" not in output, output


def _terminal() -> tuple[int, int]:
    """A new pseudo-terminal of 100 columns: (primary, secondary)."""
    primary, secondary = pty.openpty()
    # A terminal of 0 columns (the default of a new one) gets tqdm bars of nothing.
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    return primary, secondary


def _read_until_closed(primaries: list[int], timeout: float) -> dict[int, str]:
    """Everything written on these terminals until every writer has closed them."""
    chunks: dict[int, list[bytes]] = {primary: [] for primary in primaries}
    open_ends = set(primaries)
    while open_ends:
        readable, _, _ = select.select(list(open_ends), [], [], timeout)
        if not readable:
            break  # the caller's wait() reports the hang
        for primary in readable:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                chunk = b""
            if chunk:
                chunks[primary].append(chunk)
            else:
                open_ends.discard(primary)
    return {primary: b"".join(c).decode(errors="replace") for primary, c in chunks.items()}


def _run_on_terminals(args: list[str], cwd: Path) -> tuple[str, str]:
    """Run the example alone, without the launcher's variables, with stdout and stderr on two
    terminals of 100 columns; what it wrote on each."""
    (out, out_child), (err, err_child) = _terminal(), _terminal()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    try:
        process = subprocess.Popen(
            [sys.executable, str(TRAIN), *args],
            stdin=subprocess.DEVNULL, stdout=out_child, stderr=err_child, cwd=cwd, env=env,
        )  # fmt: skip
    finally:
        os.close(out_child)  # the child holds them now: reads end when the child is gone
        os.close(err_child)
    try:
        written = _read_until_closed([out, err], timeout=600)
        assert process.wait(timeout=60) == 0, written[out] + written[err]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(out)
        os.close(err)
    return written[out], written[err]


def test_mnist_example_alone_says_it_trains_in_local_mode_and_shows_progress_bars(tmp_path):
    """Without the launcher the example trains alone, in ``local`` mode, and says so once on
    stderr, with the command that trains with 2 workers and 2 servers. On a terminal it draws
    progress bars (on stderr, tqdm's stream) besides the lines it prints."""
    _require_example_dependencies()
    args = ["--epochs", "2", "--batch-size", "256"]  # 15 steps an epoch
    out, err = _run_on_terminals(args, tmp_path)
    lines = re.findall(r"epoch (\d): loss [\d.]+  test accuracy", out)
    assert lines == ["1", "2"], out  # the printed lines are there, as without bars
    assert "1 worker(s) x 1 server(s), local," in out, out
    launch = shlex.join(["kvstore-launch", "-n", "2", "-s", "2", "--", "python3", str(TRAIN)])
    notes = [line.strip() for line in err.splitlines() if "local mode" in line]
    assert notes == [
        "KVSTORE_SERVERS is not set: training alone in local mode (one worker and an in-process "
        f"server); to train with 2 workers and 2 servers: {launch} {shlex.join(args)}"
    ], err
    # one bar per epoch, counting that epoch's steps (tqdm redraws it as it goes)
    assert _BAR.search(err) and "/15 [" in err, err
    assert re.search(r"epoch 1: +\d+%\|", err) and re.search(r"epoch 2: +\d+%\|", err)


def _load_train():
    """The example as a module: its functions, without running main() (only a script does)."""
    _require_example_dependencies()
    spec = importlib.util.spec_from_file_location("mnist_train", TRAIN)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    return train


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:  # whatever the example prints goes nowhere
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(
    ("flags", "rank", "stdout_tty", "stderr_tty", "shown"),
    [
        ([], 0, True, True, True),
        (["--no-progress"], 0, True, True, False),
        ([], 1, True, True, False),  # one bar per job: worker 0's
        ([], 0, False, True, False),  # stdout to a file or pipe: its log stays readable
        ([], 0, True, False, False),  # the bar's own stream redirected
    ],
    ids=["terminal", "no-progress", "worker-1", "stdout-piped", "stderr-piped"],
)
def test_mnist_example_draws_bars_for_worker_0_on_a_terminal_only(
    monkeypatch, flags, rank, stdout_tty, stderr_tty, shown
):
    """Who decides to draw (the run above shows the drawing): cheaper than a process each."""
    train = _load_train()
    monkeypatch.setattr(sys, "argv", [str(TRAIN), *flags])
    args = train.parse_args()
    monkeypatch.setattr(sys, "stdout", _Stream(stdout_tty))
    monkeypatch.setattr(sys, "stderr", _Stream(stderr_tty))
    assert train.show_progress(args, rank) is shown


@pytest.mark.parametrize(
    ("flags", "codec", "momentum"),
    [
        ([], {"type": "2bit", "threshold": 0.02}, 0.5),  # the README's job
        (["--threshold", "0.05"], {"type": "2bit", "threshold": 0.05}, 0.5),
        (["--compression", "2bit:threshold=0.1"], {"type": "2bit", "threshold": 0.1}, 0.5),
        (["--compression", "none", "--momentum", "0.9"], {"type": "none"}, 0.9),
        (
            ["--compression", '{"type": "2bit", "threshold": 1}'],
            {"type": "2bit", "threshold": 1},
            0.5,
        ),
    ],
    ids=["default", "threshold-flag", "name-params", "none", "json"],
)
def test_mnist_example_reads_compression_specs(flags, codec, momentum):
    args = _load_train().parse_args(flags)
    assert args.codec == codec and args.momentum == momentum


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--compression", "nosuchcodec"], "unknown codec 'nosuchcodec'"),
        (["--compression", "2bit:threshold=-1"], "threshold must be a finite number > 0"),
        (["--compression", "2bit:colour=red"], "unknown parameter(s) ['colour']"),
        (["--compression", "2bit:threshold"], "expected key=value"),
        (["--compression", "2bit:threshold=1,threshold=2"], "'threshold' given twice"),
        (["--compression", "[2]"], "expected NAME or NAME:key=value"),
        (["--compression", "none", "--threshold", "0.1"], "--threshold is 2bit's threshold"),
        (["--optimizer", "local", "--mode", "dist_async"], "needs --mode dist_sync"),
        (["--bucket-bytes", "0"], "--bucket-bytes must be at least 1"),
        (["--compression", "powersgd", "--bucket-bytes", "4096"], "powersgd would send"),
    ],
    ids=[
        "unknown",
        "bad-value",
        "unknown-param",
        "no-value",
        "twice",
        "syntax",
        "threshold",
        "async",
        "bucket-bytes",
        "powersgd-buckets",
    ],
)
def test_mnist_example_refuses_bad_options_before_training(capsys, flags, message):
    train = _load_train()
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(flags)
    assert exit_info.value.code == 2  # argparse's usage error
    assert message in capsys.readouterr().err


def test_mnist_example_cnn_takes_flat_images():
    import torch

    models = _load_train().make_model  # the example's models module, as train.py uses it
    cnn = models("cnn")
    assert sum(p.numel() for p in cnn.parameters()) == 3_274_634
    convolutions = [m for m in cnn.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.padding) for c in convolutions] == [
        (32, (5, 5), (2, 2)),
        (64, (5, 5), (2, 2)),
    ]
    assert cnn(torch.rand(3, 784)).shape == (3, 10)


def test_mnist_example_runs_dgc_without_momentum_after_aggregation():
    from kvstore.codecs import registered_codecs

    if "dgc" not in registered_codecs():
        pytest.skip("no dgc codec registered")
    args = _load_train().parse_args(["--compression", "dgc:ratio=0.01", "--momentum", "0.9"])
    assert args.codec == {"type": "dgc", "ratio": 0.01}
    assert args.momentum == 0.0 and "dgc carries its own momentum" in args.momentum_note


def test_mnist_example_reports_the_timings_its_kvstore_counts():
    from types import SimpleNamespace

    epoch_record = _load_train().epoch_record
    traffic = {"pushed_bytes": 0, "pushed_raw_bytes": 0, "pulled_bytes": 0}
    first = SimpleNamespace(**traffic, encode_seconds=1.0)
    later = {"pushed_bytes": 100, "pushed_raw_bytes": 1600, "pulled_bytes": 1600}
    now = SimpleNamespace(**later, encode_seconds=3.0, wire_seconds=5.0)
    record = epoch_record(2, first, now, first, steps=4)
    assert record["density"] == 100 / 1600 and record["pushed_bytes_total"] == 100
    assert record["encode_ms_per_step"] == 500.0  # 2 s over 4 steps
    assert "wire_ms_per_step" not in record  # not counted at the epoch's start
    assert "d2h_ms_per_step" not in record  # not counted by this kvstore


STEPS = 3


def _hand_written_job(args, addresses, models, batches):
    """The example's training before it used kvstore.torch, on 2 workers (threads) that train
    ``models`` in place on ``batches[rank]``: each rank's losses."""
    import torch

    def rank_job(rank: int):
        model = models[rank]
        names = [name for name, _ in model.named_parameters()]
        params = [p for _, p in model.named_parameters()]
        with connect(addresses, rank, 2) as kv:
            kv.set_gradient_compression(args.codec)
            local_sgd = None
            if args.optimizer == "server":
                kv.set_optimizer(
                    "sgd", learning_rate=args.lr, momentum=args.momentum, wd=args.wd,
                    rescale_grad=1 / kv.num_workers,
                )  # fmt: skip
            else:
                local_sgd = torch.optim.SGD(
                    params, lr=args.lr, momentum=args.momentum, weight_decay=args.wd
                )
            summed = [torch.empty_like(p) for p in params]
            kv.init(names, [p.detach() for p in params])
            kv.pull(names, out=params)  # rank 0's initial weights
            losses = []
            for images, labels in batches[rank]:
                model.zero_grad(set_to_none=False)
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                loss.backward()
                losses.append(loss.item())
                grads = [p.grad for p in params]
                kv.push(names[::-1], grads[::-1], borrow=True)
                if local_sgd is None:
                    kv.pull(names, out=params)
                else:
                    kv.pull(names, out=summed)
                    for grad, total in zip(grads, summed, strict=True):
                        torch.div(total, kv.num_workers, out=grad)
                    local_sgd.step()
        return losses

    return run_ranks(2, rank_job)


def _example_job(args, addresses, models, batches, train):
    """The same job through the example's own setup and ``train_step``."""
    import torch

    def rank_job(rank: int):
        model = models[rank]
        with connect(addresses, rank, 2) as kv:
            train.kvt.broadcast_parameters(model, kv)
            opt = train.make_optimizer(args, model, kv)
            loss_fn = torch.nn.CrossEntropyLoss()
            return [train.train_step(model, opt, loss_fn, x, y) for x, y in batches[rank]]

    return run_ranks(2, rank_job)


@pytest.mark.parametrize("optimizer", ["local", "server"])
def test_mnist_example_trains_through_kvstore_torch_as_its_hand_written_loop_did(
    two_servers_two_workers, optimizer
):
    """Same seed, same options: the same losses and weights, bit for bit, on both workers.
    top-k's sampled threshold is drawn per key, so this also checks that the keys kept their
    names."""
    import copy

    import torch

    train = _load_train()
    args = train.parse_args(
        ["--optimizer", optimizer, "--compression", "topk:ratio=0.1", "--hidden", "16"]
    )
    starts = []
    for rank in range(2):  # different on each rank: both ways start every rank from rank 0's
        torch.manual_seed(rank)
        starts.append(train.make_model(args.model, args.hidden))
    batches = []
    for rank in range(2):
        data = torch.Generator().manual_seed(100 + rank)
        batches.append(
            [(torch.rand(8, 784, generator=data), torch.randint(0, 10, (8,), generator=data))]
            * STEPS  # the same batch every step: the residuals still change what is pushed
        )
    references = copy.deepcopy(starts)
    expected = _hand_written_job(args, two_servers_two_workers, references, batches)
    models = copy.deepcopy(starts)
    got = _example_job(args, two_servers_two_workers, models, batches, train)
    assert got == expected
    for model, reference in zip(models, references, strict=True):
        for name, param in model.named_parameters():
            assert torch.equal(param, reference.get_parameter(name)), name
            assert not torch.equal(param, starts[0].get_parameter(name)), name  # it trained
