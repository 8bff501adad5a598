"""The package is installed from this checkout, with its scripts and extras."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import kvtest


def test_installed_from_this_checkout():
    import kvstore
    import kvstore.codecs
    import kvstore.server

    for module, folder in [
        (kvstore, "kvstore"),
        (kvstore.codecs, "codecs"),
        (kvstore.server, "server"),
    ]:
        where = Path(module.__file__).resolve().parent
        assert where == kvtest.REPO / folder, (
            f"{module.__name__} comes from {where}, not this checkout: {kvtest.INSTALL_HINT}"
        )


def test_distribution_scripts_and_extras():
    dist = metadata.distribution("pskv")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {
        "kvstore-server": "kvstore.server.__main__:main",
        "kvstore-launch": "kvstore.deploy.__main__:main",
        "kvstore-keygen": "kvstore.auth:main",
    }
    extras = set(dist.metadata.get_all("Provides-Extra"))
    assert {"gpu", "torch", "dev"} <= extras


def test_guard_fails_loudly_without_the_install(tmp_path):
    # -S skips site-packages, where the editable install lives: kvstore cannot be imported.
    code = "import kvtest; kvtest.require_installed()"
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(kvtest.REPO / "tests")},
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "run `pip install -e .`" in result.stderr
