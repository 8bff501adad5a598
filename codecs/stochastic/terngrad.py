"""TernGrad (Wen et al., NeurIPS 2017): unbiased stochastic ternary quantization, no residual.

Per chunk of ``n`` float32 gradient elements ``g`` (the scale is per chunk: a key smaller than
one partition is one chunk), with ``clip`` (default 2.5; 0 = off)::

    if clip > 0:
        S1 = blocked lane sum of float64(g)                       (float64)
        S2 = blocked lane sum of float64(g) * float64(g)          (float64; each product exact)
        mean = S1 / n ; var = max(S2 / n - mean * mean, 0.0) ; sigma = sqrt(var)   (float64)
        limit = float32(clip * sigma)                 (rounded to nearest; beyond float32: inf)
        s = min(max(abs(g)), limit)                   (float32)
    else:
        s = max(abs(g))
    a[j] = min(abs(g[j]), s)                          (the clipped magnitude, float32)
    code[j] = 0                          if not (u[j] * s < a[j])      (float32 multiply)
              1 (+s) if g[j] > 0, else 2 (-s)         otherwise

``n == 0`` or ``s == 0`` (all-zero chunk, or ``sigma == 0`` with clipping: an all-equal
chunk): ``s = +0.0`` and every code 0. ``u[j]`` is the float32 uniform (24 random bits, in
``[0, 1)``) of element ``place.start + j``, its index in the whole key, of the counter
generator's stream ``stream_key(seed, worker, key, step, PURPOSE)``
(:mod:`kvstore.codecs.counter_rng`), so every worker rounds with its own noise and splitting a
key differently changes no element's uniform. Blocked lane sums are
:func:`kvstore.codecs.quantize.blocked_sum_reference`.

``E[decoded[j]] = s * P(u < a[j] / s) = a[j]`` (up to the 2**-24 grid of ``u``): unbiased for the
clipped gradient. The clip follows GRACE's variant (clip at ``clip * sigma``, scale = largest
clipped magnitude), not the paper's code (scale = ``clip * sigma`` itself).

**Payload** (the family's layout, :mod:`kvstore.codecs.quantize`): the scales frame ``[s]`` (one
float32, also for ``n == 0``) and the 2-bit codes, element ``j`` at bits ``2j, 2j+1`` of the
little-endian bit stream (byte ``j // 4``, bits ``2 * (j % 4)``); padding bits zero: 2 bits per
element plus 32 per chunk. Decoding: code 1 -> ``+s``, code 2 -> ``-s``, anything else (0; 3 is
never produced) -> ``+0.0``. No state but the push count ``step``.

Three implementations, identical bytes on any finite input: the numpy reference below,
:mod:`~kvstore.codecs.stochastic.numba_kernels` (the default on the host) and
:mod:`~kvstore.codecs.stochastic.cuda_kernels` (GPU values).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.codecs.base import seed_param
from kvstore.codecs.counter_rng import key_halves, uniforms_reference
from kvstore.codecs.quantize import (
    ChunkPlace,
    QuantizerCodec,
    QuantizerEncoder,
    blocked_sum_reference,
    pack_codes_reference,
    unpack_codes_reference,
)
from kvstore.errors import CodecError

PURPOSE = 11
"""The purpose word of terngrad's generator streams."""

CODE_BITS = 2

_NONZERO_PAIRS = np.array(
    [sum((byte >> shift) & 3 != 0 for shift in (0, 2, 4, 6)) for byte in range(256)], np.uint8
)
"""Nonzero 2-bit codes in each byte value (the padding codes are 0)."""


# numpy reference -----------------------------------------------------------------------------


def scale_reference(grad: np.ndarray, clip: float) -> np.float32:
    """The chunk's scale ``s`` (module docstring)."""
    n = grad.size
    if n == 0:
        return np.float32(0.0)
    s = np.max(np.abs(grad))
    if clip > 0:
        wide = grad.astype(np.float64)
        mean = blocked_sum_reference(wide) / n
        var = max(blocked_sum_reference(wide * wide) / n - mean * mean, 0.0)
        with np.errstate(over="ignore"):  # clip * sigma beyond float32: inf, no cap
            limit = np.float32(clip * math.sqrt(var))
        s = min(s, limit)
    return np.float32(s) if s > 0 else np.float32(0.0)


def codes_reference(grad: np.ndarray, s: np.float32, u: np.ndarray) -> np.ndarray:
    """The code of every element (uint8: 0, 1 or 2) for scale ``s`` and uniforms ``u``."""
    if s == 0:
        return np.zeros(grad.size, np.uint8)
    clipped = np.minimum(np.abs(grad), s)
    sent = u * s < clipped
    return np.where(sent, np.where(grad > 0, 1, 2), 0).astype(np.uint8)


def encode_reference(
    grad: np.ndarray, clip: float, key: int, start: int, scales: np.ndarray, packed: np.ndarray
) -> None:
    """Encode a chunk: ``scales`` (float32[1]) gets ``s``, ``packed`` (uint8) the codes.

    Args:
        grad: float32[n], finite.
        clip: the ``clip`` parameter (float64, >= 0).
        key: the generator's stream key for this push.
        start: the key-global index of ``grad[0]``.
    """
    s = scale_reference(grad, clip)
    scales[0] = s
    codes = codes_reference(grad, s, uniforms_reference(key, start, grad.size))
    packed[...] = pack_codes_reference(codes, CODE_BITS)


def decode_reference(
    scales: np.ndarray, packed: np.ndarray, n: int, out: np.ndarray, accumulate: bool
) -> None:
    """Decode ``n`` codes with scale ``scales[0]`` into float32 ``out`` (added with
    ``accumulate``)."""
    s = np.float32(scales[0])
    codes = unpack_codes_reference(packed, CODE_BITS, n)
    zero = np.float32(0.0)
    values = np.where(codes == 1, s, np.where(codes == 2, -s, zero)).astype(np.float32)
    if accumulate:
        out += values
    else:
        out[...] = values


def count_sent(packed: np.ndarray) -> int:
    """How many elements a packed 2-bit stream sends as ``+s`` or ``-s`` (nonzero codes)."""
    return int(_NONZERO_PAIRS[np.asarray(packed, dtype=np.uint8)].sum(dtype=np.int64))


# codec parts ---------------------------------------------------------------------------------


def clip_param(value: Any) -> float:
    """The ``clip`` parameter as the float64 it is used as: finite and >= 0 (0 = off)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise CodecError(
            f"codec 'terngrad': clip must be a number (in standard deviations; 0 = off), got "
            f"{type(value).__name__} {value!r}"
        )
    clip = float(value)
    if not (math.isfinite(clip) and clip >= 0):
        raise CodecError(
            f"codec 'terngrad': clip must be a finite number >= 0 (0 = off), got {value!r}"
        )
    return clip


def compiled_kernels_usable() -> bool:
    """The numba kernels write little-endian words: on other machines the reference runs."""
    return sys.byteorder == "little"


class TernGradEncoder(QuantizerEncoder):
    """The worker-side encoder of one chunk: draws the push's uniforms, keeps only ``step``."""

    codec: TernGradCodec

    def __init__(self, codec: TernGradCodec, place: ChunkPlace, device: Any = None) -> None:
        super().__init__(codec, place, device)
        if self.implementation == "numba" and not compiled_kernels_usable():
            self.implementation = "numpy"

    def _halves(self) -> tuple[int, int]:
        return key_halves(self.stream_key(PURPOSE))

    def encode_reference(self, values: np.ndarray, frames: list[np.ndarray]) -> None:
        encode_reference(
            values.reshape(-1),
            self.codec.clip,
            self.stream_key(PURPOSE),
            self.place.start,
            frames[0].view(np.float32),
            frames[1],
        )

    def encode_compiled(self, values: np.ndarray, frames: list[np.ndarray]) -> None:
        from kvstore.codecs.stochastic import numba_kernels  # noqa: PLC0415  (compiles on first use)

        grad = np.ascontiguousarray(values.reshape(-1))
        # (numba returns the float32 scale as a Python float: back to float32)
        s = np.float32(numba_kernels.terngrad_scale(grad, self.codec.clip))
        frames[0].view(np.float32)[0] = s
        lo, hi = self._halves()
        numba_kernels.terngrad_codes(
            grad, s, np.uint64(lo), np.uint64(hi), self.place.start, frames[1]
        )

    def encode_cuda(self, values: Any, frames: list[Any]) -> None:
        from kvstore.codecs.stochastic import cuda_kernels  # noqa: PLC0415

        lo, hi = self._halves()
        cuda_kernels.terngrad_encode(
            values.reshape(-1), self.codec.clip, lo, hi, self.place.start, frames[0], frames[1]
        )


class TernGradCodec(QuantizerCodec):
    """TernGrad: each element becomes ``+s``, ``-s`` or 0 with ``E = `` the (clipped) gradient;
    2 bits per element plus one float32 scale per chunk (about 16x smaller pushes).

    Args:
        clip: clip the gradient at ``clip`` standard deviations of the chunk before scaling
            (default 2.5, the paper's value; 0 turns clipping off). Finite, >= 0.
        seed: the generator's seed (integer in ``[0, 2**63)``, default 0); the worker's rank is
            part of every stream, so workers never share rounding noise.
    """

    name = "terngrad"
    param_defaults = {"clip": 2.5, "seed": 0}
    example_params = ({"seed": 7}, {"clip": 0})
    stochastic = True

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.clip = clip_param(self._params["clip"])
        self.seed = seed_param(self.name, self._params["seed"])
        self._params.update(clip=self.clip, seed=self.seed)

    def code_bits(self) -> int:
        return CODE_BITS

    def scale_count(self, numel: int) -> int:
        return 1

    def sent_nonzero(self, frames: Sequence[np.ndarray], numel: int) -> int:
        return count_sent(frames[1])

    def make_chunk_encoder(self, place: ChunkPlace, device: Any = None) -> TernGradEncoder:
        return TernGradEncoder(self, place, device)

    def decode_into(
        self,
        frames: Sequence[np.ndarray],
        numel: int,
        out: np.ndarray,
        accumulate: bool,
        implementation: str,
    ) -> None:
        scales = np.frombuffer(frames[0], dtype=np.float32)
        if implementation == "numba" and compiled_kernels_usable():
            from kvstore.codecs.stochastic import numba_kernels  # noqa: PLC0415

            numba_kernels.terngrad_decode(
                np.float32(scales[0]), np.asarray(frames[1]), numel, out, accumulate
            )
        elif implementation in ("numba", "numpy"):
            decode_reference(scales, np.asarray(frames[1]), numel, out, accumulate)
        else:
            raise CodecError(
                f"unknown CPU kernel set {implementation!r}; expected 'numba' or 'numpy'"
            )
