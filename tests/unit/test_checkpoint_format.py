"""The checkpoint format without sockets: parts, manifest, atomicity, versions, re-cutting
chunks, and the state methods of encoders and optimizers (kvstore.checkpoint)."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from kvstore import checkpoint
from kvstore.codecs import get_codec
from kvstore.errors import CheckpointError, CodecError, OptimizerError
from kvstore.optimizer_spec import make_optimizer_spec
from kvstore.server.optimizers import make_optimizer

JOB = {"mode": "dist_sync", "num_workers": 1, "num_servers": 1, "keys": []}
PARTS = checkpoint.part_names(1, 1)


def _write_parts(staging: Path, value: float = 1.0) -> None:
    arrays = {"0.value": np.full(5, value, np.float32), "0.opt.mom": np.arange(5.0)}
    checkpoint.write_part(staging, checkpoint.server_file(0), arrays, {"kind": "server"})
    checkpoint.write_part(staging, checkpoint.worker_file(0), {}, {"kind": "worker"})


def _saved(tmp_path: Path, value: float = 1.0) -> Path:
    target = tmp_path / "ckpt"
    staging = checkpoint.staging_path(target)
    _write_parts(staging, value)
    checkpoint.finalize(target, staging, JOB, PARTS)
    return target


def test_a_checkpoint_is_a_manifest_and_one_npz_per_process(tmp_path):
    target = _saved(tmp_path)
    assert sorted(os.listdir(target)) == ["manifest.json", "server-0.npz", "worker-0.npz"]
    assert os.listdir(tmp_path) == ["ckpt"]  # the staging directory was renamed
    manifest = checkpoint.read_manifest(target)
    assert manifest["format"] == "pskv-checkpoint"
    assert manifest["version"] == checkpoint.FORMAT_VERSION
    for name in PARTS:
        sha, size = checkpoint.file_sha256(target / name)
        assert manifest["files"][name] == {"sha256": sha, "bytes": size}
    arrays, meta = checkpoint.read_part(target, checkpoint.server_file(0), manifest)
    assert meta == {"kind": "server", "version": checkpoint.FORMAT_VERSION}
    np.testing.assert_array_equal(arrays["0.value"], np.ones(5, np.float32))
    assert arrays["0.value"].dtype == np.float32


def test_parts_are_plain_npz_files_without_pickles(tmp_path):
    target = _saved(tmp_path)
    with zipfile.ZipFile(target / "server-0.npz") as archive:
        assert sorted(archive.namelist()) == ["0.opt.mom.npy", "0.value.npy", "__meta__.npy"]
    with np.load(target / "server-0.npz", allow_pickle=False) as data:
        assert all(data[name].dtype != object for name in data.files)
    with pytest.raises(CheckpointError, match="not a plain numeric array"):
        checkpoint.write_part(tmp_path, "x.npz", {"a": np.array([{}], dtype=object)}, {})


def test_a_staging_directory_never_loads(tmp_path):
    target = tmp_path / "ckpt"
    staging = checkpoint.staging_path(target)
    _write_parts(staging)  # every part, and a crash before the manifest
    for path in (target, staging):
        with pytest.raises(CheckpointError):
            checkpoint.read_manifest(path)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        checkpoint.read_manifest(staging)


def test_a_stale_manifest_in_the_staging_directory_is_cleared(tmp_path):
    # A crash after the manifest was written but before the rename, then a new save starts:
    # rank 0 removes the manifest before any part is rewritten.
    target = tmp_path / "ckpt"
    staging = checkpoint.staging_path(target)
    _write_parts(staging)
    (staging / checkpoint.MANIFEST).write_text("{}")
    checkpoint.clear_stale_manifest(staging)
    assert not (staging / checkpoint.MANIFEST).exists()
    checkpoint.clear_stale_manifest(staging)  # nothing there: fine


def test_a_new_save_replaces_the_old_one_whole(tmp_path):
    _saved(tmp_path, 1.0)
    target = _saved(tmp_path, 2.0)
    manifest = checkpoint.read_manifest(target)
    arrays, _ = checkpoint.read_part(target, "server-0.npz", manifest)
    np.testing.assert_array_equal(arrays["0.value"], np.full(5, 2.0, np.float32))
    assert os.listdir(tmp_path) == ["ckpt"]  # the old one was moved aside, then deleted


def test_finalize_never_replaces_something_that_is_not_a_checkpoint(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    staging = checkpoint.staging_path(target)
    _write_parts(staging)
    with pytest.raises(CheckpointError, match="not a pskv checkpoint"):
        checkpoint.finalize(target, staging, JOB, PARTS)
    assert (target / "mine.txt").read_text() == "keep me"


def test_finalize_needs_every_part(tmp_path):
    target = tmp_path / "ckpt"
    staging = checkpoint.staging_path(target)
    _write_parts(staging)
    (staging / "worker-0.npz.sha256").unlink()  # worker 0 did not finish
    with pytest.raises(CheckpointError, match="checksum of worker-0.npz is missing"):
        checkpoint.finalize(target, staging, JOB, PARTS)
    assert not target.exists()


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda t: (t / "server-0.npz").unlink(), "cannot read"),
        (lambda t: (t / "server-0.npz").write_bytes(b"x"), "does not match the manifest"),
        (lambda t: _flip_a_byte(t / "server-0.npz"), "does not match the manifest"),
    ],
    ids=["missing", "truncated", "flipped"],
)
def test_a_part_that_differs_from_the_manifest_is_refused(tmp_path, damage, match):
    target = _saved(tmp_path)
    damage(target)
    manifest = checkpoint.read_manifest(target)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.read_part(target, "server-0.npz", manifest)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.verify_parts(target, manifest)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _rewrite_manifest(target: Path, **fields) -> None:
    manifest = json.loads((target / checkpoint.MANIFEST).read_text())
    manifest.update(fields)
    (target / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"version": checkpoint.FORMAT_VERSION + 1}, "newer than this pskv reads"),
        ({"version": 0}, "format version 0 is not valid"),
        ({"format": "other"}, "not a pskv checkpoint manifest"),
        ({"keys": "w"}, "'keys' is missing or malformed"),
        ({"num_workers": 2}, "lists files"),
    ],
)
def test_a_manifest_that_this_version_cannot_read_is_refused(tmp_path, fields, match):
    target = _saved(tmp_path)
    _rewrite_manifest(target, **fields)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.read_manifest(target)


def test_check_job_names_what_differs(tmp_path):
    manifest = checkpoint.read_manifest(_saved(tmp_path))
    checkpoint.check_job(manifest, mode="dist_sync", num_workers=1, num_servers=1)
    with pytest.raises(CheckpointError, match="1 worker.*this is a dist_sync job of 2 worker"):
        checkpoint.check_job(manifest, mode="dist_sync", num_workers=2, num_servers=1)
    with pytest.raises(CheckpointError, match="dist_async"):
        checkpoint.check_job(manifest, mode="dist_async", num_workers=1, num_servers=1)


def test_compare_keys_tells_int_and_str_keys_apart():
    spec = checkpoint.key_spec(3, (4,), "float32", {"type": "none"})
    same = checkpoint.key_spec(3, [4], "float32", {"type": "none"})
    checkpoint.compare_keys([spec], [same])
    with pytest.raises(CheckpointError, match="key '3' is initialised in this job but not"):
        checkpoint.compare_keys([spec], [checkpoint.key_spec("3", (4,), "float32", spec["codec"])])
    with pytest.raises(CheckpointError, match=r"key 3: the checkpoint has shape \(4,\) float32"):
        checkpoint.compare_keys([spec], [checkpoint.key_spec(3, (4,), "float64", spec["codec"])])
    with pytest.raises(CheckpointError, match=r"key\(s\) \[3\] that this job did not init"):
        checkpoint.compare_keys([spec], [])


def test_cut_recuts_elementwise_state_and_refuses_gaps():
    pieces = [
        (0, 4, {"r": np.arange(4.0), "m": np.arange(4.0) + 10}),
        (4, 6, {"r": np.arange(4.0, 10.0), "m": np.arange(4.0, 10.0) + 10}),
    ]
    got = checkpoint.cut(pieces, 2, 7, "key 'w'")
    np.testing.assert_array_equal(got["r"], [2, 3, 4, 5, 6])
    np.testing.assert_array_equal(got["m"], [12, 13, 14, 15, 16])
    exact = checkpoint.cut([(4, 2, {"q": np.ones((2, 2))})], 4, 6, "x")  # any state, same chunk
    assert exact["q"].shape == (2, 2)
    with pytest.raises(CheckpointError, match=r"elements \[8, 12\) are not in the checkpoint"):
        checkpoint.cut(pieces, 8, 12, "key 'w'")
    with pytest.raises(CheckpointError, match="not in the checkpoint"):
        checkpoint.cut([pieces[0], (6, 4, pieces[1][2])], 2, 8, "key 'w'")  # a gap at 4..6
    with pytest.raises(CheckpointError, match="different state"):
        checkpoint.cut([pieces[0], (4, 6, {"r": np.zeros(6)})], 2, 7, "key 'w'")


# encoder state -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_a_restored_2bit_encoder_encodes_exactly_as_the_original(monkeypatch, kernels):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", kernels)
    codec = get_codec("2bit", threshold=0.5)
    rng = np.random.default_rng(1)
    grads = [rng.normal(0, 0.4, 1001).astype(np.float32) for _ in range(6)]
    original = codec.make_encoder(1001, "float32")
    for g in grads[:3]:
        original.encode(g)
    saved = original.state()
    assert set(saved) == {"residual"} and np.count_nonzero(saved["residual"])
    restored = codec.make_encoder(1001, "float32")
    restored.load_state(saved)
    saved["residual"][:] = 99  # state() is a copy, and load_state copied it in
    for g in grads[3:]:
        assert original.encode(g)[0].tobytes() == restored.encode(g)[0].tobytes()
    assert original.state()["residual"].tobytes() == restored.state()["residual"].tobytes()


def test_load_state_refuses_state_of_another_shape_or_codec():
    encoder = get_codec("2bit", threshold=0.5).make_encoder(16, "float32")
    with pytest.raises(CodecError, match="keeps state"):
        encoder.load_state({})
    with pytest.raises(CodecError, match=r"float32\[16\], the saved state is float32\[8\]"):
        encoder.load_state({"residual": np.zeros(8, np.float32)})
    with pytest.raises(CodecError, match="float64"):
        encoder.load_state({"residual": np.zeros(16, np.float64)})
    identity = get_codec("none").make_encoder(16, "float32")
    assert identity.state() == {}
    identity.load_state({})


# optimizer state ---------------------------------------------------------------------------------


def test_optimizer_state_round_trips_and_is_checked():
    adam = make_optimizer(make_optimizer_spec("adam", {}))
    state = adam.import_state(
        {"mean": np.ones(4, np.float32), "var": np.ones(4, np.float32)},
        {"t": 7},
        4,
        np.dtype(np.float32),
        "key 'w'",
    )
    assert state["t"] == 7 and state["mean"].dtype == np.float32
    with pytest.raises(OptimizerError, match="'t' is None"):
        adam.import_state(
            {"mean": np.ones(4, np.float32), "var": np.ones(4, np.float32)}, {}, 4, np.float32, "w"
        )
    with pytest.raises(OptimizerError, match="'var' is missing"):
        adam.import_state({"mean": np.ones(4, np.float32)}, {"t": 1}, 4, np.float32, "w")
    sgd = make_optimizer(make_optimizer_spec("sgd", {"momentum": 0.9}))
    made_on_first_use = {"mom": None, "buf": None, "count": None}
    assert sgd.import_state({}, {}, 4, np.dtype(np.float32), "w") == made_on_first_use
    with pytest.raises(OptimizerError, match=r"expected float32\[4\]"):
        sgd.import_state({"mom": np.ones(5, np.float32)}, {}, 4, np.dtype(np.float32), "w")
    with pytest.raises(OptimizerError, match="keeps no state named"):
        sgd.import_state({"mean": np.ones(4, np.float32)}, {}, 4, np.dtype(np.float32), "w")
