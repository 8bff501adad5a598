"""Checkpoint and resume against real processes on 127.0.0.1 (docs/operations.md#checkpoints).

The central test: a ``dist_sync`` job (2 workers, 2 servers, 2-bit compression, a server
optimizer) runs 20 steps, saves, is killed with SIGKILL (workers and servers), and new processes
load the checkpoint and run 20 more steps; the pulled values and the workers' residuals must be
bit-identical to a job that ran 40 steps without stopping. ``dist_async`` keeps exactly what
was saved (values, optimizer state, residuals). A save interrupted half-way never leaves
anything that loads, and a corrupted or foreign checkpoint is refused before anything changes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import checkpoint_worker as cw
import numpy as np
import pytest
from kvtest import RawClient, start_servers, stop_processes

import kvstore
from kvstore import checkpoint

pytestmark = pytest.mark.integration

N, S = 2, 2
WORKER = str(Path(cw.__file__).resolve())
SGD = ["sgd", {"learning_rate": 0.125, "momentum": 0.875, "wd": 0.0625, "rescale_grad": 0.5}]
ADAM = ["adam", {"learning_rate": 0.01, "wd": 0.001}]
BIGARRAY_BOUND = 4000  # "big" (5003) is split over both servers; the others live whole on one


class Job:
    """S servers and N workers running ``checkpoint_worker.py``, all children of the test."""

    def __init__(self, folder: Path, mode: str, optimizer, plans, partition_bytes=4096):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.servers = start_servers(S, N)
        self.outs = [folder / f"rank{rank}.npz" for rank in range(N)]
        self.logs = [folder / f"rank{rank}.log" for rank in range(N)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env.update(
            KVSTORE_SERVERS=",".join(s.address for s in self.servers),
            KVSTORE_NUM_WORKERS=str(N),
            KVSTORE_BIGARRAY_BOUND=str(BIGARRAY_BOUND),
            KVSTORE_PARTITION_BYTES=str(partition_bytes),
            KVSTORE_LOG_LEVEL="ERROR",
        )
        self.workers = []
        try:
            for rank in range(N):
                config = folder / f"rank{rank}.json"
                plan = plans(rank) if callable(plans) else plans
                config.write_text(
                    json.dumps(
                        {"mode": mode, "optimizer": optimizer, "plan": plan,
                         "out": str(self.outs[rank])}
                    )
                )  # fmt: skip
                with open(self.logs[rank], "w") as log:
                    self.workers.append(
                        subprocess.Popen(
                            [sys.executable, WORKER, str(config)],
                            env={**env, "KVSTORE_RANK": str(rank)},
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
        except BaseException:
            self.kill()
            raise

    def _log(self) -> str:
        return "\n".join(f"--- rank {r}\n{log.read_text()}" for r, log in enumerate(self.logs))

    def finish(self, timeout: float = 180) -> list[dict]:
        """Wait for every worker to succeed; stop the servers; the workers' kept arrays."""
        try:
            for worker in self.workers:
                worker.wait(timeout)
            codes = [w.returncode for w in self.workers]
            assert codes == [0] * N, f"worker exit codes {codes}\n{self._log()}"
        finally:
            self.kill()
        return self.results()

    def wait_for_outs(self, timeout: float = 180) -> None:
        """Wait until every worker dumped its arrays (they then hang)."""
        deadline = time.monotonic() + timeout
        while not all(out.exists() for out in self.outs):
            failed = [w.returncode for w in self.workers if w.poll() is not None]
            assert not failed, f"a worker exited ({failed})\n{self._log()}"
            assert time.monotonic() < deadline, f"workers did not dump\n{self._log()}"
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the workers and servers that still run (by pid), as a crash would."""
        processes = self.workers + [s.process for s in self.servers]
        for process in processes:
            if process.poll() is None:
                process.kill()
        stop_processes(processes)

    def results(self) -> list[dict]:
        results = []
        for out in self.outs:
            with np.load(out, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
            arrays["errors"] = json.loads(arrays["errors"].tobytes().decode())
            results.append(arrays)
        return results


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer, resume_partition_bytes",
    [(SGD, 4096), (ADAM, 2048)],  # Adam's resumed job cuts its keys into other chunks
    ids=["sgd-momentum", "adam-rechunked"],
)
def test_dist_sync_resume_is_bit_identical(tmp_path, optimizer, resume_partition_bytes):
    ckpt = tmp_path / "ckpt"
    reference = Job(
        tmp_path / "reference",
        "dist_sync",
        optimizer,
        [["steps", 0, 40], ["pull", "final"], ["residuals", "residual"], ["dump"]],
    )
    first = Job(
        tmp_path / "first",
        "dist_sync",
        optimizer,
        [["steps", 0, 20], ["save", str(ckpt)], ["pull", "saved"], ["dump"], ["hang"]],
    )
    try:
        first.wait_for_outs()
    finally:
        first.kill()  # SIGKILL: nothing of the first job survives but the checkpoint
    assert sorted(os.listdir(ckpt)) == sorted([checkpoint.MANIFEST, *checkpoint.part_names(S, N)])
    resumed = Job(
        tmp_path / "resumed",
        "dist_sync",
        optimizer,
        [
            ["load", str(ckpt)],
            ["pull", "loaded"],
            ["steps", 20, 40],
            ["pull", "final"],
            ["residuals", "residual"],
            ["dump"],
        ],
        partition_bytes=resume_partition_bytes,
    )
    expected, got, saved = reference.finish(), resumed.finish(), first.results()
    for rank in range(N):
        for key in cw.KEYS:
            assert _same_bits(got[rank][f"loaded/{key}"], saved[rank][f"saved/{key}"]), key
            assert _same_bits(got[rank][f"final/{key}"], expected[rank][f"final/{key}"]), key
            residual = expected[rank][f"residual/{key}"]
            assert np.count_nonzero(residual), key  # (so that restoring it matters)
            assert _same_bits(got[rank][f"residual/{key}"], residual), key
    # The workers' residuals differ (per-rank gradients): each worker restored its own.
    assert not _same_bits(expected[0]["residual/big"], expected[1]["residual/big"])


def _meta(arrays: dict[str, np.ndarray]) -> dict:
    """A part's metadata, without the workers' push counts (not restored: the servers'
    matching counts start over too)."""
    meta = json.loads(arrays[checkpoint.META].tobytes().decode())
    for key in meta.get("keys", []):
        for chunk in key["chunks"]:
            chunk.pop("pushes")
    return meta


def _part_arrays(folder: Path, name: str) -> dict[str, np.ndarray]:
    with np.load(folder / name, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.slow
def test_dist_async_keeps_values_optimizer_state_and_residuals(tmp_path):
    ckpt, again, broken = tmp_path / "ckpt", tmp_path / "again", tmp_path / "broken"
    first = Job(
        tmp_path / "first",
        "dist_async",
        SGD,
        [["steps", 0, 20], ["save", str(ckpt)], ["pull", "saved"], ["dump"], ["hang"]],
    )
    try:
        first.wait_for_outs()
    finally:
        first.kill()
    shutil.copytree(ckpt, broken)
    part = broken / checkpoint.server_file(1)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    resumed = Job(
        tmp_path / "resumed",
        "dist_async",
        SGD,
        [
            ["load_fails", str(broken)],
            ["pull", "before"],
            ["load", str(ckpt)],
            ["pull", "loaded"],
            ["save", str(again)],
            ["steps", 20, 30],
            ["dump"],
        ],
    )
    got, saved = resumed.finish(), first.results()
    for rank in range(N):
        (error,) = got[rank]["errors"]
        assert "server-1.npz does not match the manifest" in error
        for key in cw.KEYS:
            # The refused load changed nothing, on server 0 either (a load is all or nothing).
            assert _same_bits(got[rank][f"before/{key}"], cw.init_value(key)), key
            assert _same_bits(got[rank][f"loaded/{key}"], saved[rank][f"saved/{key}"]), key
    # Saved again right after the load: the same state, bit for bit (values, momentum,
    # residuals), in every part.
    for name in checkpoint.part_names(S, N):
        original, restored = _part_arrays(ckpt, name), _part_arrays(again, name)
        assert sorted(original) == sorted(restored), name
        for array in original:
            if array != checkpoint.META:
                assert _same_bits(original[array], restored[array]), (name, array)
        assert _meta(original) == _meta(restored), name
    assert any(k.endswith(".opt.mom") for k in _part_arrays(ckpt, checkpoint.server_file(0)))


@pytest.mark.slow
def test_an_interrupted_save_never_loads_and_keeps_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    go = tmp_path / "go"
    job = Job(
        tmp_path / "job",
        "dist_sync",
        SGD,
        [
            ["steps", 0, 3],
            ["save", str(ckpt)],
            ["steps", 3, 6],
            ["dump"],
            ["wait_for", str(go)],
            ["save", str(ckpt)],
            ["hang"],
        ],
    )
    try:
        job.wait_for_outs()
        complete = checkpoint.read_manifest(ckpt)
        stopped = job.servers[1].process
        stopped.send_signal(signal.SIGSTOP)  # server 1 never writes its part of the 2nd save
        go.touch()
        staging = checkpoint.staging_path(ckpt)
        deadline = time.monotonic() + 60
        wanted = [checkpoint.server_file(0), *[checkpoint.worker_file(r) for r in range(N)]]
        while not all((staging / name).exists() for name in wanted):
            assert time.monotonic() < deadline, "the second save did not start"
            time.sleep(0.05)
    finally:
        job.kill()  # SIGKILL works on a stopped process
    # Half a checkpoint in the staging directory: no manifest, so it never loads.
    with pytest.raises(kvstore.CheckpointError, match="no manifest.json"):
        checkpoint.read_manifest(staging)
    # The previous checkpoint is untouched and whole.
    assert checkpoint.read_manifest(ckpt) == complete
    checkpoint.verify_parts(ckpt, complete)


# Fast checks in local mode (one worker, an in-process server) ----------------------------------


def _local(keys=(("w", 100), (3, 33)), optimizer=("sgd", {"momentum": 0.5}), codec="2bit"):
    kv = kvstore.create("local", timeout=30)
    kv.set_gradient_compression(
        {"type": "2bit", "threshold": 0.5} if codec == "2bit" else {"type": codec}
    )
    if optimizer is not None:
        kv.set_optimizer(optimizer[0], **optimizer[1])
    kv.init([k for k, _ in keys], [np.linspace(-1, 1, n, dtype=np.float32) for _, n in keys])
    return kv


def _step(kv, keys=("w", 3), sizes=(100, 33), seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    kv.push(list(keys), [rng.normal(0, 0.4, n).astype(np.float32) for n in sizes])
    outs = [np.empty(n, np.float32) for n in sizes]
    kv.pull(list(keys), out=outs)
    return outs


def test_local_save_and_load_continue_bit_identically(tmp_path):
    with _local() as kv:
        for seed in range(6):
            expected = _step(kv, seed=seed)
    with _local() as kv:
        for seed in range(3):
            _step(kv, seed=seed)
        kv.save_checkpoint(tmp_path / "ckpt")
        kv.save_checkpoint(tmp_path / "ckpt")  # replaces the first, atomically
    assert not checkpoint.staging_path(tmp_path / "ckpt").exists()
    with _local(optimizer=None) as kv:  # no set_optimizer: the load sets the saved one
        kv.load_checkpoint(tmp_path / "ckpt")
        assert kv.optimizer.name == "sgd" and kv.optimizer["momentum"] == 0.5
        for seed in range(3, 6):
            got = _step(kv, seed=seed)
    for a, b in zip(got, expected, strict=True):
        assert _same_bits(a, b)


@pytest.mark.parametrize(
    "dtype, optimizer",
    [("float16", ("sgd", {"momentum": 0.9})), ("float64", ("adam", {})), ("int64", None)],
)
def test_uncompressed_keys_of_every_dtype_resume_bit_identically(tmp_path, dtype, optimizer):
    """float16 keys keep a float32 master copy on the server; it is saved too."""
    rng = np.random.default_rng(3)
    grads = [(rng.normal(0, 8, 50)).astype(dtype) for _ in range(6)]

    def run(steps, load=None, save=None):
        with kvstore.create("local", timeout=30) as kv:
            if optimizer is not None:
                kv.set_optimizer(optimizer[0], learning_rate=0.01, **optimizer[1])
            kv.init("w", np.arange(50).astype(dtype))
            if load is not None:
                kv.load_checkpoint(load)
            out = np.empty(50, dtype)
            for step in steps:
                kv.push("w", grads[step])
                kv.pull("w", out=out)
            if save is not None:
                kv.save_checkpoint(save)
            return out

    expected = run(range(6))
    run(range(3), save=tmp_path / "ckpt")
    assert _same_bits(run(range(3, 6), load=tmp_path / "ckpt"), expected)


def test_a_load_rolls_a_running_job_back(tmp_path):
    with _local() as kv:
        _step(kv, seed=0)
        kv.save_checkpoint(tmp_path / "ckpt")
        after = _step(kv, seed=1)
        _step(kv, seed=2)
        kv.load_checkpoint(tmp_path / "ckpt")
        again = _step(kv, seed=1)
    for a, b in zip(after, again, strict=True):
        assert _same_bits(a, b)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(keys=(("w", 100), (4, 33))), "key 4 is initialised in this job but not in"),
        (dict(keys=(("w", 100),)), r"has key\(s\) \[3\] that this job did not initialise"),
        (dict(keys=(("w", 101), (3, 33))), r"key 'w': the checkpoint has shape \(100,\)"),
        (dict(codec="none"), "compression"),
        (dict(optimizer=("adam", {})), "saved with optimizer sgd"),
        (dict(optimizer=("sgd", {"momentum": 0.9})), "saved with optimizer sgd"),
    ],
    ids=["other-key", "missing-key", "other-shape", "other-codec", "other-opt", "other-hyper"],
)
def test_a_checkpoint_of_another_job_is_refused_and_changes_nothing(tmp_path, change, match):
    with _local() as kv:
        _step(kv)
        kv.save_checkpoint(tmp_path / "ckpt")
    with _local(**change) as kv:
        sizes = [n for _, n in change.get("keys", (("w", 100), (3, 33)))]
        keys = [k for k, _ in change.get("keys", (("w", 100), (3, 33)))]
        before = [np.empty(n, np.float32) for n in sizes]
        kv.pull(keys, out=before)
        with pytest.raises(kvstore.CheckpointError, match=match):
            kv.load_checkpoint(tmp_path / "ckpt")
        after = [np.empty(n, np.float32) for n in sizes]
        kv.pull(keys, out=after)
        for a, b in zip(before, after, strict=True):
            assert _same_bits(a, b)


def _saved(tmp_path: Path) -> Path:
    with _local() as kv:
        _step(kv)
        kv.save_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit_manifest(path: Path, **fields) -> None:
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    manifest.update(fields)
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def _two_workers(path: Path) -> None:
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    files = {**manifest["files"], "worker-1.npz": manifest["files"]["worker-0.npz"]}
    _edit_manifest(path, num_workers=2, files=files)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: (p / checkpoint.MANIFEST).unlink(), "no manifest.json"),
        (lambda p: (p / "worker-0.npz").unlink(), "worker-0.npz"),
        (lambda p: (p / "server-0.npz").write_bytes(b"PK"), "server-0.npz does not match"),
        (lambda p: _edit_manifest(p, version=99), "format version 99, newer than this pskv"),
        (_two_workers, "checkpoint is of a local job of 2 worker"),
        (lambda p: _edit_manifest(p, mode="dist_sync"), "checkpoint is of a dist_sync job"),
        (lambda p: (p / checkpoint.MANIFEST).write_text("{"), "not valid JSON"),
    ],
    ids=["no-manifest", "missing-part", "corrupt-part", "newer", "other-n", "other-mode", "json"],
)
def test_a_damaged_checkpoint_is_refused(tmp_path, damage, match):
    path = _saved(tmp_path)
    damage(path)
    with _local() as kv, pytest.raises(kvstore.CheckpointError, match=match):
        kv.load_checkpoint(path)


def test_a_save_that_cannot_write_fails_everywhere_and_leaves_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with _local() as kv:
        _step(kv)
        with pytest.raises(kvstore.CheckpointError):
            kv.save_checkpoint(blocker / "ckpt")
        (tmp_path / "user-data").mkdir()
        (tmp_path / "user-data" / "notes.txt").write_text("mine")
        with pytest.raises(kvstore.CheckpointError, match="not a pskv checkpoint"):
            kv.save_checkpoint(tmp_path / "user-data")
        assert (tmp_path / "user-data" / "notes.txt").read_text() == "mine"
        _step(kv)  # the store still works


def test_a_save_with_a_round_in_flight_is_refused(tmp_path):
    """Two raw workers of one server: rank 0 pushed, rank 1 did not; both ask to save."""
    (server,) = start_servers(1, 2)
    clients = [RawClient(server.address) for _ in range(2)]
    try:
        spec = {"k": "w", "c": 0, "o": 0, "n": 16, "dt": "float32", "sh": [16], "cd": "none"}
        for rank, client in enumerate(clients):
            assert client.hello(rank=rank, num_workers=2).op.name == "REPLY"
        rid0 = clients[0].send("INIT", {**spec, "cp": {}}, [np.zeros(16, np.float32)])
        assert clients[1].request("INIT", {**spec, "cp": {}}).op.name == "REPLY"
        assert clients[0].receive().rid == rid0
        clients[0].send("PUSH", {"k": "w", "c": 0, "n": 16}, [np.ones(16, np.float32)])
        staging = str(checkpoint.staging_path(tmp_path / "ckpt"))
        rids = [client.send("SAVE", {"p": staging}) for client in clients]
        for client, rid in zip(clients, rids, strict=True):
            reply = client.receive()
            assert (reply.rid, reply.op.name, reply.body.code) == (rid, "ERROR", "checkpoint")
            assert "round in flight (pushes of rank(s) [0])" in reply.body.message
        assert not (Path(staging) / checkpoint.server_file(0)).exists()
    finally:
        for client in clients:
            client.close()
        stop_processes([server.process])
