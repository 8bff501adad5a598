"""The package's public names: what ``dir(kvstore)`` and ``from kvstore import *`` give a user."""

from __future__ import annotations

import kvstore


def test_every_public_name_resolves_and_nothing_else_is_listed():
    assert sorted(dir(kvstore)) == sorted(kvstore.__all__)
    for name in kvstore.__all__:
        assert getattr(kvstore, name) is not None, name
    assert not {"Any", "TYPE_CHECKING", "annotations"} & set(kvstore.__all__)


def test_star_import_gives_the_api():
    namespace: dict[str, object] = {}
    exec("from kvstore import *", namespace)
    assert {"create", "KVStore", "KVStoreError", "MODES"} <= set(namespace)
    assert "TYPE_CHECKING" not in namespace
