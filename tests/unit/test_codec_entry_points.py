"""Codecs of other installed distributions: the ``kvstore.codecs`` entry-point group.

Each test lays out a distribution's installed metadata (a ``.dist-info`` folder with its
``entry_points.txt``) and a module in a temporary folder on ``sys.path``, which is what an
installation leaves behind, and asks the registry for the codec by name.
"""

from __future__ import annotations

import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvstore.codecs import codec_from_spec, get_codec, registered_codecs, registry
from kvstore.errors import CodecError

CODEC_MODULE = """
import numpy as np

from kvstore.codecs.base import Codec
from kvstore.codecs.identity import IdentityCodec


class {cls}(IdentityCodec):
    name = "{name}"
    param_defaults = {{}}


def register():
    from kvstore.codecs import register_codec

    register_codec({cls})


def register_nothing():
    pass


NOT_A_CODEC = 3
"""


def install(folder: Path, dist: str, module: str, entry_points: dict[str, str], body: str):
    """The installed form of distribution ``dist``: ``module.py`` and its dist-info."""
    (folder / f"{module}.py").write_text(body)
    info = folder / f"{dist.replace('-', '_')}-1.0.dist-info"  # as installers name it
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[kvstore.codecs]\n{lines}")


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for installed distributions; what they register is forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = dict(registry._REGISTRY)
    yield tmp_path
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)
    for name in [m for m in sys.modules if m.startswith("ep_")]:
        del sys.modules[name]


def _body(cls: str, name: str) -> str:
    return textwrap.dedent(CODEC_MODULE.format(cls=cls, name=name))


def test_a_codec_class_entry_point_is_found_by_name_and_listed(site):
    body = _body("Plain", "ep-plain")
    install(site, "ep-plain", "ep_plain", {"ep-plain": "ep_plain:Plain"}, body)
    assert "ep-plain" in registered_codecs()
    assert "ep-plain" in registry.installed_codecs()
    assert "ep-plain" not in registry.built_in_codecs()
    assert "ep_plain" not in sys.modules  # loaded on first use, not when listed
    codec = codec_from_spec({"type": "ep-plain"})
    assert type(codec).__name__ == "Plain"
    (payload,) = codec.make_encoder(3, "float32").encode(np.ones(3, np.float32))
    assert np.frombuffer(payload, np.float32).tolist() == [1, 1, 1]
    assert get_codec("ep-plain") == codec  # registered once, then found directly


def test_a_register_function_entry_point(site):
    install(site, "ep-func", "ep_func", {"ep-func": "ep_func:register"}, _body("Func", "ep-func"))
    assert type(get_codec("ep-func")).__name__ == "Func"


@pytest.mark.parametrize(
    "value, match",
    [
        ("ep_bad:Missing", "has no attribute 'Missing'"),
        ("ep_absent_module:Codec", "No module named 'ep_absent_module'"),
        ("ep_bad:Bad", "names the codec class Bad 'something-else'"),
        ("ep_bad:NOT_A_CODEC", "gives int, not a Codec class or a function"),
        ("ep_bad:register_nothing", "ran but registered no codec of that name"),
    ],
)
def test_an_entry_point_that_fails_is_a_codec_error_naming_it(site, value, match):
    install(site, "ep-broken", "ep_bad", {"ep-bad": value}, _body("Bad", "something-else"))
    with pytest.raises(CodecError, match=match) as failure:
        get_codec("ep-bad")
    assert f"entry point ep-bad = '{value}' of distribution 'ep-broken'" in str(failure.value)
    assert "ep-bad" not in registry._REGISTRY and "something-else" not in registry._REGISTRY


def test_a_module_that_raises_on_import_is_a_codec_error(site):
    install(site, "ep-raises", "ep_raises", {"ep-raises": "ep_raises:Codec"}, "1 / 0\n")
    with pytest.raises(CodecError, match="ep-raises.*failed to load.*division by zero"):
        get_codec("ep-raises")


def test_one_name_declared_by_two_distributions_is_refused(site):
    body = _body("Twin", "ep-twin")
    install(site, "ep-first", "ep_first", {"ep-twin": "ep_first:Twin"}, body)
    install(site, "ep-second", "ep_second", {"ep-twin": "ep_second:Twin"}, body)
    with pytest.raises(CodecError, match="more than one entry point.*ep-first.*ep-second"):
        get_codec("ep-twin")


def test_a_built_in_name_never_loads_an_entry_point(site):
    install(site, "ep-shadow", "ep_shadow", {"2bit": "ep_shadow:Shadow"}, "1 / 0\n")
    assert type(get_codec("2bit")).__name__ == "TwoBitCodec"
    assert registered_codecs().count("2bit") == 1


def test_an_unknown_name_still_lists_the_known_ones(site):
    install(site, "ep-listed", "ep_listed", {"ep-listed": "ep_listed:L"}, _body("L", "ep-listed"))
    with pytest.raises(CodecError, match="unknown codec 'zip'; registered codecs: .*ep-listed"):
        get_codec("zip")


def test_an_installed_codec_is_in_the_parity_check(site):
    from codec_parity import parity_specs

    body = _body("Checked", "ep-checked")
    install(site, "ep-checked", "ep_checked", {"ep-checked": "ep_checked:Checked"}, body)
    assert {"type": "ep-checked"} in parity_specs()  # its defaults: it declares no examples


def test_threads_that_ask_for_an_installed_codec_at_once_all_get_it(site):
    install(site, "ep-many", "ep_many", {"ep-many": "ep_many:register"}, _body("Many", "ep-many"))
    start = threading.Barrier(4)

    def ask(_):
        start.wait()
        return type(get_codec("ep-many")).__name__

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == ["Many"] * 4
