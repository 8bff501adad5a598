"""The codec registry: codec names to :class:`~kvstore.codecs.base.Codec` classes.

Three ways in, one table:

* **Built-in codecs** are the lines of :data:`BUILT_IN_CODECS`, one per codec, each
  ``"module:Class"``. They are imported when :mod:`kvstore.codecs` is, so a server or worker pays
  for it at start-up and never in its event loop.
* **Codecs of other installed distributions** declare an entry point in the group
  :data:`ENTRY_POINT_GROUP` (``kvstore.codecs``) whose name is the codec's name and whose value
  is ``"module:CodecClass"`` (or ``"module:register"``, a function of no arguments that calls
  :func:`register_codec`). An entry point is loaded the first time its name is asked for (by
  :func:`get_codec`, hence by every ``kvstore-server`` process that is sent that codec, since the
  server resolves codecs by name here too); a failure to load it is a
  :class:`~kvstore.errors.CodecError` naming the distribution and the entry point, which the
  server answers like any other bad codec.
* :func:`register_codec` adds a class at run time (a decorator), for codecs defined in a
  program or a test; it is visible in that process only.

A name is registered once: a built-in name wins over an entry point of the same name (the entry
point is never loaded), and a second registration of a name raises.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
from importlib import metadata
from typing import Any

from kvstore.codecs.base import Codec
from kvstore.errors import CodecError, did_you_mean

ENTRY_POINT_GROUP = "kvstore.codecs"
"""The entry-point group through which installed distributions add codecs."""

BUILT_IN_CODECS = (
    "kvstore.codecs.identity:IdentityCodec",
    "kvstore.codecs.twobit:TwoBitCodec",
    "kvstore.codecs.sparse.threshold:ThresholdCodec",
    "kvstore.codecs.sparse.topk:TopKCodec",
    "kvstore.codecs.sparse.topk2bit:TopK2BitCodec",
    "kvstore.codecs.sparse.randomk:RandomKCodec",
    "kvstore.codecs.sparse.dgc:DGCCodec",
    "kvstore.codecs.sign.onebit:OneBitCodec",
    "kvstore.codecs.sign.efsign:EFSignCodec",
    "kvstore.codecs.stochastic.terngrad:TernGradCodec",
    "kvstore.codecs.stochastic.qsgd:QsgdCodec",
    "kvstore.codecs.cast:Fp16Codec",
    "kvstore.codecs.cast:Bf16Codec",
    "kvstore.codecs.powersgd:PowerSGDCodec",
    "kvstore.codecs.sketch:SketchCodec",
)
"""The codecs of this package, ``"module:Class"``; adding a codec to the product adds its line."""

_REGISTRY: dict[str, type[Codec]] = {}
_REGISTERING = threading.Lock()  # a name's check and set
# One entry-point load at a time (a server may ask from several threads at once). A separate
# lock: a module that registers its codec while being imported takes only _REGISTERING, so an
# import that another thread holds never waits on a load that waits on that import.
_LOADING = threading.Lock()


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator that registers a codec under ``cls.name``; a duplicate name raises."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise CodecError(f"{cls.__name__} has no codec name")
    with _REGISTERING:
        if name in _REGISTRY:
            raise CodecError(
                f"codec name {name!r} is already registered by {_REGISTRY[name].__qualname__}"
            )
        _REGISTRY[name] = cls
    return cls


def _import_object(reference: str) -> Any:
    """The object named by ``"module:attribute"`` (a dotted attribute path allowed)."""
    module_name, _, attribute = reference.partition(":")
    found: Any = importlib.import_module(module_name)
    for part in attribute.split(".") if attribute else ():
        found = getattr(found, part)
    return found


def _register_built_in_codecs() -> None:
    for reference in BUILT_IN_CODECS:
        register_codec(_import_object(reference))


def _installed_entry_points() -> dict[str, list[metadata.EntryPoint]]:
    """The ``kvstore.codecs`` entry points of the installed distributions, by name.

    Reading them scans every installed distribution's metadata (about 12 ms), and a server
    asks on its event loop whenever a request names a codec it does not know, so the result is
    kept while ``sys.path`` and the modification times of its folders stay the same (a
    distribution installed since changes its folder's time, and is then found).
    """
    return _entry_points_on(tuple((folder, _mtime(folder)) for folder in sys.path))


def _mtime(folder: str) -> int:
    try:
        return os.stat(folder or ".").st_mtime_ns
    except OSError:
        return -1


@functools.lru_cache(maxsize=1)
def _entry_points_on(path: tuple[tuple[str, int], ...]) -> dict[str, list[metadata.EntryPoint]]:
    found: dict[str, list[metadata.EntryPoint]] = {}
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry_point.name, []).append(entry_point)
    return found


def _describe(entry_point: metadata.EntryPoint) -> str:
    dist = entry_point.dist
    owner = f"distribution {dist.name!r}" if dist is not None else "an unnamed distribution"
    return f"entry point {entry_point.name} = {entry_point.value!r} of {owner}"


def _load_entry_point(name: str) -> type[Codec] | None:
    """Register the codec that an installed distribution declares as ``name``; None where
    none does.

    Raises:
        CodecError: the entry point fails to load, is declared twice, or does not give a
            codec of that name.
    """
    entry_points = _installed_entry_points().get(name)
    if not entry_points:
        return None
    if len(entry_points) > 1:
        declared = "; ".join(_describe(e) for e in entry_points)
        raise CodecError(f"codec {name!r} is declared by more than one entry point: {declared}")
    (entry_point,) = entry_points
    where = _describe(entry_point)
    try:
        loaded = entry_point.load()
        if isinstance(loaded, type) and issubclass(loaded, Codec):
            if loaded.name != name:
                raise CodecError(f"it names the codec class {loaded.__qualname__} {loaded.name!r}")
            register_codec(loaded)
        elif callable(loaded):
            returned = loaded()
            if name not in _REGISTRY and isinstance(returned, type) and issubclass(returned, Codec):
                register_codec(returned)
        else:
            raise CodecError(f"it gives {type(loaded).__name__}, not a Codec class or a function")
    except Exception as exc:  # third-party code: whatever it raises, the codec failed
        raise CodecError(f"codec {name!r} failed to load from {where}: {exc}") from exc
    cls = _REGISTRY.get(name)
    if cls is None:
        raise CodecError(f"codec {name!r}: {where} ran but registered no codec of that name")
    return cls


def built_in_codecs() -> list[str]:
    """Names of the codecs of this package (:data:`BUILT_IN_CODECS`), sorted."""
    return sorted(_import_object(reference).name for reference in BUILT_IN_CODECS)


def installed_codecs() -> list[str]:
    """Names of the codecs that installed distributions declare as entry points, sorted
    (loaded or not)."""
    return sorted(_installed_entry_points())


def registered_codecs() -> list[str]:
    """Names of all codecs: registered, and declared by installed distributions; sorted."""
    return sorted(set(_REGISTRY) | set(_installed_entry_points()))


def codec_class(name: str) -> type[Codec]:
    """The codec class registered as ``name``; an installed distribution's entry point of that
    name is loaded the first time it is asked for.

    Raises:
        CodecError: unknown name (the message lists the registered ones, and suggests the
            closest), or an installed codec that fails to load.
    """
    if not isinstance(name, str):
        raise CodecError(f"expected str for codec `type`, got {type(name).__name__}")
    cls = _REGISTRY.get(name)
    if cls is None:
        with _LOADING:
            cls = _REGISTRY.get(name) or _load_entry_point(name)  # loaded meanwhile?
    if cls is None:
        known = registered_codecs()
        raise CodecError(
            f"unknown codec {name!r}{did_you_mean((name,), known)}; "
            f"registered codecs: {', '.join(known)}"
        )
    return cls


def get_codec(name: str, **params: Any) -> Codec:
    """Instantiate the codec registered as ``name`` with validated ``params``.

    Raises:
        CodecError: unknown name, an installed codec that fails to load (see
            :func:`codec_class`), or bad parameters.
    """
    return codec_class(name)(**params)


def codec_from_spec(spec: dict[str, Any]) -> Codec:
    """Instantiate a codec from ``{"type": name, **params}`` (the compression-params dict)."""
    if not isinstance(spec, dict):
        raise CodecError(
            f"compression params must be a dict like {{'type': '2bit', 'threshold': 0.5}}, "
            f"got {type(spec).__name__}"
        )
    if "type" not in spec:
        raise CodecError(
            f"compression params need a 'type' (one of {', '.join(registered_codecs())}), "
            f"got {spec!r}"
        )
    params = {k: v for k, v in spec.items() if k != "type"}
    return get_codec(spec["type"], **params)


_register_built_in_codecs()
