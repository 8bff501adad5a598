"""The CUDA C of the CuPy kernels comes from ``.cu`` files in the codec packages: every kernel
module builds its source from files that exist and are not empty, and every ``.cu`` file is
used. Checked without CuPy or a GPU: each kernel module is imported with a stand-in ``cupy``
module (they touch CuPy only when a kernel is compiled or launched)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstore.codecs.cuda_source import assemble, defines, read_cu
from kvstore.errors import CodecError

CODECS = Path(__file__).resolve().parents[2] / "codecs"


def _imports_cupy(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.Import) and any(alias.name == "cupy" for alias in node.names)
        for node in tree.body
    )


KERNEL_MODULES = sorted(
    "kvstore.codecs." + ".".join(path.relative_to(CODECS).with_suffix("").parts)
    for path in CODECS.rglob("*.py")
    if _imports_cupy(path)
)

BUILD = textwrap.dedent("""
    import importlib, json, sys, types
    sys.modules["cupy"] = types.ModuleType("cupy")  # a stand-in: nothing is compiled
    sources = {}
    for name in sys.argv[1:]:
        sources[name] = importlib.import_module(name).cuda_source()
    print(json.dumps(sources))
""")


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", BUILD, *KERNEL_MODULES], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_every_family_has_its_kernel_modules():
    families = {"twobit", "sparse", "sign", "stochastic", "cast", "powersgd"}
    assert {m.split(".")[2] for m in KERNEL_MODULES} >= families


def test_every_kernel_module_builds_its_source_from_cu_files(sources):
    assert set(sources) == set(KERNEL_MODULES)
    for name, source in sources.items():
        assert "__global__" in source, name


def test_every_cu_file_is_not_empty_and_used(sources):
    files = sorted(CODECS.rglob("*.cu"))
    assert len(files) >= len(KERNEL_MODULES)
    for path in files:
        text = path.read_text()
        assert text.strip(), path
        assert any(text in source for source in sources.values()), f"{path} is used by no kernel"


def test_the_parts_of_a_source_are_joined_in_order():
    assert assemble("a\n", "b\n") == "\na\n\nb\n"
    assert defines(SUM_BLOCK=4096, WARPS=8) == "#define SUM_BLOCK 4096\n#define WARPS 8\n"
    assert read_cu("kvstore.codecs", "ieee_ops.cu").startswith("/* IEEE float32")


def test_a_missing_cu_file_is_a_codec_error():
    with pytest.raises(CodecError, match="the CUDA source absent.cu of kvstore.codecs cannot be"):
        read_cu("kvstore.codecs", "absent.cu")
