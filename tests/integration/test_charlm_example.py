"""The character LM example: its corpus (the standard library's docstrings, split by hash), and
short jobs under kvstore-launch in both modes, synchronous data-parallel AdamW and DiLoCo, with
their JSON lines and the bytes each pushes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from kvtest import REPO

pytestmark = [pytest.mark.integration]

EXAMPLE = REPO / "examples/charlm"
TINY = ["--layers", "1", "--width", "32", "--heads", "4", "--context", "32"]
STEPS, EVAL_EVERY, SYNC_EVERY = 20, 5, 5


def _load(name: str) -> ModuleType:
    """An example module, loaded from its file under a name of its own (``corpus`` and
    ``model`` are common names)."""
    pytest.importorskip("torch")
    if f"charlm_{name}" in sys.modules:
        return sys.modules[f"charlm_{name}"]
    spec = importlib.util.spec_from_file_location(f"charlm_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# the corpus ------------------------------------------------------------------------------------


def _write(root: Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


def _fake_stdlib(root: Path) -> None:
    """A library of a few modules, with folders and files the corpus must skip."""
    for i in range(40):
        _write(
            root,
            f"pkg{i % 3}/mod{i}.py",
            f'"""Module {i}."""\n\n'
            f'class C{i}:\n    """Class {i}."""\n\n'
            f'    def method(self):\n        """Method of {i}."""\n\n'
            f'if True:\n    def nested():\n        """Shared text."""\n',
        )
    _write(root, "test/test_x.py", '"""A test suite."""\n')
    _write(root, "pkg0/tests/test_y.py", '"""Another test suite."""\n')
    _write(root, "idlelib/editor.py", '"""The IDLE editor."""\n')
    _write(root, "site-packages/thing.py", '"""An installed package."""\n')
    _write(root, "lib2to3/broken.py", '"""Does not parse."""\ndef (:\n')


def test_corpus_reads_docstrings_in_path_order_and_skips_tests_idle_and_packages(tmp_path):
    corpus = _load("corpus")
    _fake_stdlib(tmp_path)
    files = corpus.source_files(tmp_path)
    assert files == sorted(files) and len(files) == 41  # 40 modules and the broken file
    assert all(f.parent.name.startswith(("pkg", "lib2to3")) for f in files)
    found = corpus.documents(files)
    first = tmp_path / "pkg0/mod0.py"
    assert found[:4] == [b"Module 0.", b"Class 0.", b"Method of 0.", b"Shared text."], first
    assert len(found) == 40 * 4  # the broken file gives nothing, and stops nothing
    for skipped in (b"suite", b"IDLE", b"installed", b"parse"):
        assert not any(skipped in document for document in found)


def test_corpus_split_is_deterministic_disjoint_and_keeps_repeated_documents_on_one_side(
    tmp_path,
):
    corpus = _load("corpus")
    root = tmp_path / "lib"
    _fake_stdlib(root)
    once = corpus.load_corpus(root, cache=False)
    again = corpus.load_corpus(root, cache=False)
    assert bytes(once.train.numpy()) == bytes(again.train.numpy())
    assert bytes(once.validation.numpy()) == bytes(again.validation.numpy())
    train = set(bytes(once.train.numpy()).split(corpus.SEPARATOR))
    validation = set(bytes(once.validation.numpy()).split(corpus.SEPARATOR))
    assert train and validation and not train & validation
    assert train | validation == set(corpus.documents(corpus.source_files(root)))
    # "Shared text." is in every module: all 40 copies are on the side its hash says
    shared_side = once.validation if corpus.is_validation(b"Shared text.") else once.train
    assert bytes(shared_side.numpy()).count(b"Shared text.") == 40
    assert once.train_documents + once.validation_documents == 160


def test_corpus_of_this_interpreter_is_large_and_its_cache_reads_back_the_same(tmp_path):
    corpus = _load("corpus")
    cached = corpus.load_corpus()  # parses once per library, then reads the temp cache
    assert len(cached.train) > 500_000 and len(cached.validation) > 20_000
    assert 0.05 < cached.validation_documents / cached.train_documents < 0.2
    again = corpus.load_corpus()
    assert bytes(again.train.numpy()) == bytes(cached.train.numpy())
    assert bytes(again.validation.numpy()) == bytes(cached.validation.numpy())


def test_windows_come_from_the_seed_rank_and_step_alone():
    corpus = _load("corpus")
    torch = pytest.importorskip("torch")
    text = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    a = corpus.sample_windows(text, 4, 16, seed=1, rank=0, step=7)
    b = corpus.sample_windows(text, 4, 16, seed=1, rank=0, step=7)
    c = corpus.sample_windows(text, 4, 16, seed=1, rank=1, step=7)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are the next bytes
    assert [len(corpus.shard(text, r, 3)) for r in range(3)] == [333, 333, 333]


# the jobs --------------------------------------------------------------------------------------


def _launch(tmp_path: Path, name: str, *args: str) -> list[dict]:
    """Run the example on 2 workers x 1 server (in a session of its own, killed whole on a
    time-out); worker 0's JSON lines."""
    pytest.importorskip("torch")
    out = tmp_path / f"{name}.jsonl"
    command = [sys.executable, "-m", "kvstore.deploy", "-n", "2", "-s", "1", "--"]
    command += [sys.executable, str(EXAMPLE / "train.py"), *TINY, "--json", str(out)]
    command += ["--steps", str(STEPS), "--eval-every", str(EVAL_EVERY), "--warmup", "5"]
    process = subprocess.Popen(
        [*command, *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the {name} job did not finish in 300 s:\n{output}")
    assert process.returncode == 0, output
    assert output.count("[worker 0] step ") == STEPS // EVAL_EVERY, output
    assert "[worker 1] step " not in output  # worker 0 alone evaluates
    return [json.loads(line) for line in out.read_text().splitlines()]


def _check_records(records: list[dict], mode: str) -> None:
    assert [r["step"] for r in records] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    for record in records:
        assert record["mode"] == mode and record["workers"] == 2 and record["servers"] == 1
        assert record["samples"] == record["step"] * 16 * 2
        assert math.isfinite(record["loss"]) and math.isfinite(record["val_loss"])
        assert record["perplexity"] == pytest.approx(math.exp(record["val_loss"]))
        assert isinstance(record["seconds"], float)  # reported; its value is not bound
    assert records[-1]["perplexity"] < records[0]["perplexity"]
    pushed = [r["pushed_bytes_total"] for r in records]
    assert pushed == sorted(pushed) and pushed[0] > 0


@pytest.mark.slow
def test_sync_and_diloco_jobs_train_and_diloco_pushes_one_fifth_of_the_bytes(tmp_path):
    sync = _launch(tmp_path, "sync", "--mode", "sync")
    diloco = _launch(tmp_path, "diloco", "--mode", "diloco", "--sync-every", str(SYNC_EVERY))
    _check_records(sync, "sync")
    _check_records(diloco, "diloco")
    assert diloco[-1]["sync_every"] == SYNC_EVERY and diloco[-1]["fragments"] == 1
    params = sync[-1]["parameters"]
    assert params == diloco[-1]["parameters"]
    # Dense float32 values: sync pushes every gradient every step, DiLoCo every
    # pseudo-gradient every SYNC_EVERY steps; nothing else is pushed.
    assert sync[-1]["pushed_raw_bytes_total"] == STEPS * params * 4
    assert diloco[-1]["pushed_raw_bytes_total"] == STEPS // SYNC_EVERY * params * 4
    # On the wire, the same messages' headers on top: the ratio is 1/5 within them.
    ratio = diloco[-1]["pushed_bytes_total"] / sync[-1]["pushed_bytes_total"]
    assert ratio == pytest.approx(1 / SYNC_EVERY, rel=0.02)
