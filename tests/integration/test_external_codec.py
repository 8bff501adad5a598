"""A codec from another distribution reaches every process of a job through the ``kvstore.codecs``
entry-point group.

The test writes a tiny distribution (a pyproject and one module: ``scaled``, whose servers sum
each push times ``scale``), installs it with pip into a folder of its own, and runs a real job
with that folder on the path of the ``kvstore-server`` processes and of the workers: the workers
encode with it, the servers resolve it by name when the keys are initialised and aggregate with
it, and the pulls carry its sums. This process never has the distribution on its path, so the
codec is unknown here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from kvtest import start_servers, stop_processes

from kvstore.codecs import codec_from_spec, registered_codecs
from kvstore.errors import CodecError

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PYPROJECT = """
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "kvstore-scaled-codec"
version = "0.1"
dependencies = []

[project.entry-points."kvstore.codecs"]
scaled = "kvstore_scaled:ScaledCodec"

[tool.setuptools]
py-modules = ["kvstore_scaled"]
"""

MODULE = '''
"""``scaled``: workers send their values as they are; a server sums each push times ``scale``.

numpy reference: ``sum = scale * push_1 + scale * push_2 + ...`` in float32.
"""

import numpy as np

from kvstore.codecs.base import Aggregator, Codec, Encoder, frame_array


class ScaledEncoder(Encoder):
    def __init__(self, numel, dtype):
        super().__init__(numel, dtype)
        self._sent = np.empty(numel, np.float32)

    def encode(self, values):
        np.copyto(self._sent, values)
        return [self._sent]


class ScaledAggregator(Aggregator):
    def __init__(self, numel, dtype, scale):
        super().__init__(numel, dtype)
        self.scale = np.float32(scale)

    def add(self, payloads, first):
        contribution = frame_array(payloads[0], np.float32, self.numel) * self.scale
        if first:
            np.copyto(self.result, contribution)
        else:
            self.result += contribution


class ScaledCodec(Codec):
    name = "scaled"
    dtypes = frozenset({"float32"})
    param_defaults = {"scale": 1.0}

    def payload_nbytes(self, numel, dtype):
        return (4 * numel,)

    def make_encoder(self, numel, dtype, device=None):
        self.check_dtype(dtype)
        return ScaledEncoder(numel, dtype)

    def make_aggregator(self, numel, dtype):
        self.check_dtype(dtype)
        return ScaledAggregator(numel, dtype, self._params["scale"])
'''

WORKERS = """
import json, sys, threading
import numpy as np
import kvstore

servers = sys.argv[1].split(",")
BIG, SMALL = 3001, 10
pulled = {}

def worker(rank):
    with kvstore.create("dist_sync", servers=servers, rank=rank, num_workers=2, timeout=60,
                        bigarray_bound=1000, partition_bytes=4096) as kv:
        kv.set_gradient_compression({"type": "scaled", "scale": 3.0})
        kv.init(["big", 7], [np.zeros(BIG, np.float32), np.zeros(SMALL, np.float32)])
        chunks = len(kv._shared.keys["big"].chunks)
        grads = [np.arange(n, dtype=np.float32) * (rank + 1) for n in (BIG, SMALL)]
        outs = [np.empty(BIG, np.float32), np.empty(SMALL, np.float32)]
        kv.push(["big", 7], grads)
        kv.pull(["big", 7], out=outs)
        pulled[rank] = {"chunks": chunks, "big": outs[0].tolist(), "small": outs[1].tolist()}

threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(120)
print(json.dumps(pulled))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The distribution, installed by pip into a folder that only the job's processes see."""
    root = tmp_path_factory.mktemp("external_codec")
    dist, site = root / "dist", root / "site"
    dist.mkdir()
    (dist / "pyproject.toml").write_text(PYPROJECT)
    (dist / "kvstore_scaled.py").write_text(textwrap.dedent(MODULE))
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation"]
    install += ["--no-index", "--disable-pip-version-check", "--quiet", "--target", str(site)]
    done = subprocess.run([*install, str(dist)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "kvstore_scaled.py").exists()
    return site


def _with_site(site: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def test_a_codec_of_another_distribution_runs_a_job_through_its_entry_point(site):
    assert "scaled" not in registered_codecs()  # not installed where this test runs
    with pytest.raises(CodecError, match="unknown codec 'scaled'"):
        codec_from_spec({"type": "scaled"})

    env = _with_site(site)
    servers = start_servers(2, 2, env=env)
    try:
        addresses = ",".join(s.address for s in servers)
        done = subprocess.run(
            [sys.executable, "-c", WORKERS, addresses],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, **env},
        )
    finally:
        stop_processes([s.process for s in servers])
    assert done.returncode == 0, done.stderr[-3000:]
    pulled = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(pulled) == ["0", "1"], done.stderr[-3000:]
    for rank in ("0", "1"):
        assert pulled[rank]["chunks"] > 2  # the big key lives on both servers
        for key, n in (("big", 3001), ("small", 10)):
            # rank 0 pushed arange(n), rank 1 twice that; each server summed them times 3
            expected = (np.arange(n, dtype=np.float32) * 9).tolist()
            assert pulled[rank][key] == expected, (rank, key)


REFUSED = """
import sys
import numpy as np
import kvstore
from kvstore.errors import KVStoreError

with kvstore.create("dist_sync", servers=[sys.argv[1]], rank=0, num_workers=1, timeout=60) as kv:
    kv.set_gradient_compression({"type": "scaled"})
    try:
        kv.init("w", np.zeros(4, np.float32))
    except KVStoreError as exc:
        print("refused:", exc)
"""


def test_a_server_without_the_distribution_refuses_the_codec_by_name(site):
    servers = start_servers(1, 1)  # its path lacks the distribution; the worker's has it
    try:
        done = subprocess.run(
            [sys.executable, "-c", REFUSED, servers[0].address],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **_with_site(site)},
        )
        assert servers[0].process.poll() is None  # the server lives on
    finally:
        stop_processes([s.process for s in servers])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout and "unknown codec 'scaled'" in done.stdout, done.stdout
