"""Gradient codecs: the :class:`Codec` interface, the registry, and the built-in codecs.

Built in (:data:`kvstore.codecs.registry.BUILT_IN_CODECS`), one package per family of codecs
that share code: ``"none"`` (:mod:`kvstore.codecs.identity`), ``"2bit"`` (MXNet-compatible
threshold quantization with residuals, :mod:`kvstore.codecs.twobit`), the sparse codecs
``"threshold"``, ``"topk"``, ``"randomk"`` and ``"dgc"`` (:mod:`kvstore.codecs.sparse`), the
sign quantizers ``"1bit"`` and ``"efsign"`` (:mod:`kvstore.codecs.sign`), the stochastic
quantizers ``"terngrad"`` and ``"qsgd"`` (:mod:`kvstore.codecs.stochastic`), the 16-bit casts
``"fp16"`` and ``"bf16"`` (:mod:`kvstore.codecs.cast`) and ``"powersgd"``
(:mod:`kvstore.codecs.powersgd`). The quantizers share :mod:`kvstore.codecs.quantize`. Each
family holds its codecs' numpy references (the spec), their numba kernels
(``numba_kernels.py``) and their CuPy kernels (``cuda_kernels.py``, whose CUDA C is the
package's ``.cu`` files, :mod:`kvstore.codecs.cuda_source`).

Other installed distributions add codecs through the ``kvstore.codecs`` entry-point group
(:mod:`kvstore.codecs.registry`). Get one with :func:`get_codec` or :func:`codec_from_spec`::

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
