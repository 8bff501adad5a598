"""Gradient codecs: the :class:`Codec` interface, the registry, and the built-in codecs.

Built in (:data:`kvstore.codecs.registry.BUILT_IN_CODECS`): ``"none"`` (identity), ``"2bit"``
(MXNet-compatible threshold quantization with residuals) and the sparse family ``"threshold"``,
``"topk"``, ``"randomk"`` and ``"dgc"`` (:mod:`kvstore.codecs.sparse`), the 16-bit casts
``"fp16"`` and ``"bf16"`` (:mod:`kvstore.codecs.cast16`), the stochastic quantizers
``"terngrad"`` and ``"qsgd"`` (:mod:`kvstore.codecs.terngrad`, :mod:`kvstore.codecs.qsgd`), the
sign quantizers ``"1bit"`` and ``"efsign"`` (:mod:`kvstore.codecs.onebit`,
:mod:`kvstore.codecs.efsign`) and ``"powersgd"``. Other installed distributions add codecs
through the ``kvstore.codecs`` entry-point group (:mod:`kvstore.codecs.registry`). Get one with
:func:`get_codec` or :func:`codec_from_spec`::

    codec = codec_from_spec({"type": "2bit", "threshold": 0.5})
"""

from kvstore.codecs.base import Aggregator, Codec, Encoder, accumulator_dtype
from kvstore.codecs.registry import (
    codec_from_spec,
    get_codec,
    register_codec,
    registered_codecs,
)

__all__ = [
    "Aggregator",
    "Codec",
    "Encoder",
    "accumulator_dtype",
    "codec_from_spec",
    "get_codec",
    "register_codec",
    "registered_codecs",
]
