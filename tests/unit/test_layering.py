"""The layering rules of docs/design.md, checked on the source and on real imports."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {
    "kvstore": "kvstore",
    "server": "kvstore.server",
    "worker": "kvstore.worker",
    "codecs": "kvstore.codecs",
    "deploy": "kvstore.deploy",
}


def _internal_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "kvstore" or n.startswith("kvstore."))
    return found


def _imports_of(folder: str) -> dict[str, set[str]]:
    return {
        str(p.relative_to(REPO)): _internal_imports(p)
        for p in sorted((REPO / folder).rglob("*.py"))
    }


def test_base_modules_depend_only_on_errors():
    assert _internal_imports(REPO / "kvstore/errors.py") == set()
    for module in ("envvars", "wire_schema"):
        assert _internal_imports(REPO / f"kvstore/{module}.py") <= {"kvstore.errors"}
    # the protocol's layout, over its schema
    assert _internal_imports(REPO / "kvstore/wire.py") <= {"kvstore.errors", "kvstore.wire_schema"}
    # config builds the per-role settings from the variable table
    assert _internal_imports(REPO / "kvstore/config.py") <= {"kvstore.errors", "kvstore.envvars"}


def test_metrics_depends_on_the_base_modules_only():
    # It defines metric families and an endpoint; the server and the worker count into it.
    allowed = {"kvstore.errors", "kvstore.config", "kvstore.wire"}
    assert _internal_imports(REPO / "kvstore/metrics.py") <= allowed


def test_checkpoint_format_depends_on_errors_only():
    # The file format is shared by the server and the worker, which never import each other.
    assert _internal_imports(REPO / "kvstore/checkpoint.py") <= {"kvstore.errors"}


def test_codecs_depend_on_the_base_only():
    allowed = ("kvstore.errors", "kvstore.config", "kvstore.wire", "kvstore.codecs")
    for path, imports in _imports_of("codecs").items():
        bad = [i for i in imports if not i.startswith(allowed)]
        assert not bad, f"{path} imports {bad}"


@pytest.mark.parametrize("folder, forbidden", [("server", "worker"), ("worker", "server")])
def test_server_and_worker_never_import_each_other(folder, forbidden):
    for path, imports in _imports_of(folder).items():
        bad = [i for i in imports if i.startswith(f"kvstore.{forbidden}")]
        assert not bad, f"{path} imports {bad}"


def test_no_top_level_import_of_our_folders_by_their_bare_names():
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    assert node.module.split(".")[0] not in ("server", "worker", "deploy"), path


def test_server_imports_without_cupy_or_torch():
    code = (
        "import sys; sys.modules['cupy'] = None; sys.modules['torch'] = None\n"
        "import kvstore, kvstore.server, kvstore.server.__main__\n"
        "import codecs; codecs.lookup('utf-8')\n"
        "assert 'kvstore.worker' not in sys.modules, 'server pulled in the worker'\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_prometheus_client_is_imported_only_when_metrics_are_on():
    # Everything imports (and runs) with prometheus_client missing, and nothing imports it.
    code = (
        "import sys\n"
        "import kvstore, kvstore.metrics, kvstore.server, kvstore.server.__main__\n"
        "import kvstore.worker.client, kvstore.worker.transport\n"
        "assert 'prometheus_client' not in sys.modules, 'imported at module import'\n"
        "sys.modules['prometheus_client'] = None\n"
        "import numpy as np\n"
        "with kvstore.create('local') as kv:\n"
        "    kv.init('w', np.zeros(4, np.float32))\n"
        "    kv.push('w', np.ones(4, np.float32))\n"
        "print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_METRICS")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
