"""Codec specs as command-line text: ``none``, ``2bit``, ``topk:ratio=0.01,sample=0`` or a JSON
object such as ``{"type": "dgc", "ratio": 0.001}``, turned into the ``{"type": name, **params}``
dict that ``kv.set_gradient_compression`` takes, and back into short labels.

Parsing checks the syntax only; whether the codec exists and takes those parameters is for
``kvstore.codecs.codec_from_spec`` to say.
"""

from __future__ import annotations

import json
from typing import Any


def parse_value(text: str) -> Any:
    """A parameter value: ``true``/``false`` as bool, ``none``/``null`` as None (any case),
    then int, then float, else the text itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text


def parse_codec_spec(text: str) -> dict[str, Any]:
    """``{"type": name, **params}`` from ``name``, ``name:key=value,key=value`` or a JSON
    object (which must have a ``"type"``).

    Raises:
        ValueError: malformed text (the message says what and where).
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"compression spec {text!r} is not valid JSON: {error}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
            raise ValueError(f'a JSON compression spec needs a "type" string, got {text!r}')
        return spec
    name, colon, params = text.partition(":")
    name = name.strip()
    if not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"compression spec {text!r}: expected NAME or NAME:key=value,...")
    spec: dict[str, Any] = {"type": name}
    if not colon:
        return spec
    for item in params.split(","):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key:
            raise ValueError(f"compression spec {text!r}: expected key=value, got {item!r}")
        if key in spec:
            raise ValueError(f"compression spec {text!r}: {key!r} given twice")
        spec[key] = parse_value(value)
    return spec


def spec_params(spec: dict[str, Any]) -> dict[str, Any]:
    """The parameters of ``spec``, without its ``type``."""
    return {key: value for key, value in spec.items() if key != "type"}


def format_codec_spec(spec: dict[str, Any]) -> str:
    """``spec`` written back as ``name`` or ``name:key=value,...``, parameters in the order
    given (``parse_codec_spec`` reads it back to an equal dict for scalar values)."""
    params = spec_params(spec)
    if not params:
        return spec["type"]
    return f"{spec['type']}:" + ",".join(f"{k}={_text(v)}" for k, v in params.items())


def _text(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)
