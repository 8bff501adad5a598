"""numba starts once per process, before any compiled function exists
(``kvstore.codecs.numba_started``): two threads that meet numba for the first time at once must
not deadlock it."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STARTER = "kvstore.codecs.numba_started"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("folder", ["codecs", "server", "worker", "kvstore"])
def test_every_module_that_uses_numba_starts_it_first(folder):
    for path in sorted((REPO / folder).rglob("*.py")):
        if path.name == "numba_started.py":
            continue
        imports = _imports(path)
        if any(name == "numba" or name.startswith("numba.") for name in imports):
            assert STARTER in imports, f"{path.relative_to(REPO)} uses numba without {STARTER}"


RACE = textwrap.dedent("""
    import threading
    import numpy as np
    from kvstore import zerocopy
    start = threading.Barrier(2)
    def free_function():  # the zero-copy sender's cfunc, as a sending thread loads it
        start.wait()
        assert zerocopy.native_sends_available()
    def kernel():  # a codec kernel module's first import and call, on another thread
        start.wait()
        from kvstore.codecs import _finite_numba
        bits = np.ones(1 << 16, np.float32).view(np.uint32)
        assert _finite_numba.count_nonfinite(bits, np.uint32(0x7F800000)) == 0
    threads = [threading.Thread(target=f, daemon=True) for f in (free_function, kernel)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    print("hung" if any(t.is_alive() for t in threads) else "ok", flush=True)
""")


def test_two_threads_meeting_numba_at_once_both_finish():
    # Before numba_started, this deadlocked in 9 of 10 runs: the decorator takes numba's
    # target-context lock then its compiler lock, a cfunc compile the other way round.
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120
        )
        assert done.stdout.strip() == "ok", done.stdout + done.stderr[-2000:]
