"""kvstore.compile_notice: which of a job's kernel modules numba's cache holds no code of yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from kvstore import compile_notice
from kvstore.compile_notice import (
    FINITE_CHECK,
    OPTIMIZERS,
    KernelModule,
    codec_kernel_module,
    job_kernel_modules,
)

TWOBIT = {"type": "2bit", "threshold": 0.02}


@pytest.fixture
def numba_kernels(monkeypatch):
    monkeypatch.delenv("KVSTORE_CPU_KERNELS", raising=False)


@pytest.mark.parametrize(
    ("spec", "module"),
    [
        (TWOBIT, "kvstore.codecs.twobit.numba_kernels"),  # the codec class in the package
        ({"type": "1bit"}, "kvstore.codecs.sign.numba_kernels"),  # in a module of the package
        ({"type": "topk"}, "kvstore.codecs.sparse.numba_kernels"),
        ({"type": "bf16"}, "kvstore.codecs.cast.numba_kernels"),
        ({"type": "none"}, None),  # no kernels: no module above it has any
    ],
)
def test_a_codec_s_kernels_are_the_numba_kernels_module_of_its_package(spec, module):
    assert codec_kernel_module(spec) == module


def test_a_job_s_kernels_are_the_push_check_its_codecs_and_its_optimizer(numba_kernels):
    specs = [TWOBIT, {"type": "none"}, {"type": "efsign"}, {"type": "1bit"}]
    assert job_kernel_modules(specs, "sgd") == [
        KernelModule("the pushes' NaN check", FINITE_CHECK),
        KernelModule("the 2bit codec", "kvstore.codecs.twobit.numba_kernels"),
        KernelModule("the efsign codec", "kvstore.codecs.sign.numba_kernels"),  # 1bit's too
        KernelModule("the sgd optimizer", OPTIMIZERS),
    ]
    assert [k.module for k in job_kernel_modules([{"type": "none"}])] == [FINITE_CHECK]


def test_numpy_kernels_compile_nothing(monkeypatch):
    monkeypatch.setenv("KVSTORE_CPU_KERNELS", "numpy")
    assert job_kernel_modules([TWOBIT], "sgd") == []
    assert compile_notice.compile_notice([TWOBIT], "sgd") is None


def test_a_module_whose_cache_cannot_be_read_counts_as_compiled(monkeypatch):
    # numba's index format is not published: where it is not what the reader expects, the
    # notice says nothing rather than something wrong.
    odd = types.ModuleType("odd_kernels")
    odd.kernel = types.SimpleNamespace(  # a dispatcher's shape, without an index file reader
        py_func=types.SimpleNamespace(__module__="odd_kernels"),
        _cache=types.SimpleNamespace(cache_path="/nowhere"),
    )
    monkeypatch.setitem(sys.modules, "odd_kernels", odd)
    missing = KernelModule("a codec that is gone", "no_such_module_anywhere")
    assert compile_notice.uncompiled([KernelModule("odd", "odd_kernels"), missing]) == ([], [])


# In a process of its own: numba reads NUMBA_CACHE_DIR once, when it is imported.
COLD_THEN_WARM = textwrap.dedent("""
    import json
    import numpy as np
    from kvstore.compile_notice import compile_notice, job_kernel_modules, uncompiled
    specs = [{"type": "2bit", "threshold": 0.02}]
    before = compile_notice(specs, "sgd")
    from kvstore.codecs.finite import count_nonfinite
    count_nonfinite(np.ones(8, np.float32), kernels="numba")  # compiles and caches one kernel
    cold, folders = uncompiled(job_kernel_modules(specs, "sgd"))
    print(json.dumps({"before": before, "cold": [k.module for k in cold], "folders": folders}))
""")


def test_a_fresh_cache_gets_the_notice_and_a_compiled_kernel_leaves_it(tmp_path, numba_kernels):
    cache = tmp_path / "numba-cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    result = subprocess.run(
        [sys.executable, "-c", COLD_THEN_WARM], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["before"] == (
        "compiling the numba kernels of the pushes' NaN check, the 2bit codec and the sgd "
        f"optimizer for this machine, once: the first steps take a few seconds longer, and "
        f"later runs load them from {cache}"
    )
    # The push check's kernel is in the cache now; the others were never called.
    assert found["cold"] == ["kvstore.codecs.twobit.numba_kernels", OPTIMIZERS]
    assert found["folders"] and all(f.startswith(str(cache)) for f in found["folders"])
