"""The 16-bit casts ``fp16`` and ``bf16``: every element travels as a 16-bit float, summed by the
server in float32 (half the bytes of a dense push).

Parameter: ``error_feedback`` (bool, default False). Per element, all arithmetic in float32::

    p = g                       # without error feedback
    p = r + g                   # with it: a float32 add; a sum past float32's range (only
                                # when r and g are both near 3.4e38) is clamped to +-3.4028235e38
    h = round(p)                # to nearest, ties to even
    r = p - float32(h)          # with error feedback: a float32 subtract

``round`` is, for ``fp16``, IEEE binary16 with its subnormals, exactly what numpy's
``astype(np.float16)`` gives; for ``bf16``, the upper 16 bits of ``bits + 0x7FFF + ((bits >> 16)
& 1)`` where ``bits`` is p's float32 pattern (its subnormals kept). The sign is kept: a ``p`` of
``-0.0``, or a negative one that rounds to zero, gives ``0x8000`` (whose float32 is ``-0.0``, so
such an element's residual is ``p - (-0.0)``). Decoding is exact: ``out[j] = float32(h[j])``, or
``out[j] += float32(h[j])`` (a float32 add) when a push is added to the server's sum.

**Overflow.** A finite ``p`` whose rounding is infinite: ``|p| >= 65520`` for fp16 (the tie
between 65504 and 65536 goes to the even 65536); for bf16 ``|p| >= 3.3961775e38`` (float32 bits
``0x7F7F8000``), which rounds past ``0x7F7F``:

* without error feedback the push is refused with a :class:`~kvstore.errors.CodecError` naming
  the codec, the largest magnitude and the remedies; no frame is returned. A key of several
  chunks is checked whole before any chunk is encoded (:class:`Cast16KeyEncoder`), since the
  chunks are sent as they are encoded;
* with error feedback nothing overflows: ``h`` saturates at the largest finite 16-bit value of
  p's sign (``+-65504`` for fp16, ``+-3.3895314e38`` for bf16) and the residual carries the rest
  into the next push.

**Payload** of a chunk of ``n`` elements: one frame of ``2n`` bytes, ``h[j]`` as a little-endian
uint16 bit pattern (numpy has no bf16 type: bf16 is handled as uint16). There is no scales
frame (:meth:`Cast16Codec.scale_count` is 0, so no blocked lane sums either) and the family's
1-8 bit code packing does not apply: :meth:`Cast16Codec.code_bits` is 16 only to say what an
element costs. An empty chunk
has an empty frame. **State**: ``("residual",)`` (float32, zero at start) with error feedback,
none without.

Implementations with one contract (identical bytes and residual bits on any finite input):
the numpy references below, the numba kernels of :mod:`kvstore.codecs.cast.numba_kernels` (bit
operations on the float32 patterns: numba has no float16 on the CPU) and the CuPy kernels of
:mod:`kvstore.codecs.cast.cuda_kernels`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from kvstore.codecs.base import KeyEncoder
from kvstore.codecs.quantize import (
    ChunkPlace,
    QuantizerCodec,
    QuantizerEncoder,
    QuantizerKeyEncoder,
)
from kvstore.codecs.xp import is_cupy_array
from kvstore.errors import CodecError

ABS_MASK = np.uint32(0x7FFF_FFFF)
FLOAT32_MAX = np.float32(np.finfo(np.float32).max)

# numpy references ----------------------------------------------------------------------------


def fp16_round_reference(p: np.ndarray) -> np.ndarray:
    """The fp16 bits (uint16) of float32 ``p``: numpy's cast, infinite where it overflows."""
    with np.errstate(over="ignore"):
        return p.astype(np.float16).view(np.uint16)


def bf16_round_reference(p: np.ndarray) -> np.ndarray:
    """The bf16 bits (uint16) of finite float32 ``p``: the upper 16 bits after adding
    ``0x7FFF + ((bits >> 16) & 1)`` to the bits (round to nearest even; ``0x7F80``, infinity,
    where it overflows). No carry leaves the 32 bits: finite bits are at most ``0xFF7FFFFF``."""
    bits = np.ascontiguousarray(p, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def fp16_widen_reference(h: np.ndarray) -> np.ndarray:
    """The float32 values of fp16 bits ``h`` (uint16), exactly."""
    return np.asarray(h, dtype=np.uint16).view(np.float16).astype(np.float32)


def bf16_widen_reference(h: np.ndarray) -> np.ndarray:
    """The float32 values of bf16 bits ``h`` (uint16), exactly: the bits shifted up 16."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def largest_magnitude_reference(values: np.ndarray) -> int:
    """The largest ``|v|`` of float32 ``values`` as its float32 bit pattern (0 when empty)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return int(np.max(bits & ABS_MASK, initial=0))


class CastFormat(NamedTuple):
    """A 16-bit float format.

    Attributes:
        name: the codec's name.
        largest_finite: the magnitude bits of its largest finite value (``0x7BFF``, ``0x7F7F``).
        overflow_bits: the smallest float32 magnitude (as bits) whose rounding is infinite.
        round: the numpy reference float32 -> 16 bits (uint16), infinite on overflow.
        widen: the numpy reference 16 bits -> float32.
        remedy: what to do about an overflow without error feedback.
    """

    name: str
    largest_finite: int
    overflow_bits: int
    round: Callable[[np.ndarray], np.ndarray]
    widen: Callable[[np.ndarray], np.ndarray]
    remedy: str

    @property
    def largest_value(self) -> float:
        """The largest finite value (65504 for fp16)."""
        return float(self.widen(np.array([self.largest_finite], dtype=np.uint16))[0])


FP16 = CastFormat(
    "fp16",
    0x7BFF,
    0x477F_F000,  # 65520: halfway between 65504 and 65536, a tie rounded to the even 65536
    fp16_round_reference,
    fp16_widen_reference,
    "push with 'bf16' (float32's range), scale the loss down, or set error_feedback=True",
)
BF16 = CastFormat(
    "bf16",
    0x7F7F,
    0x7F7F_8000,
    bf16_round_reference,
    bf16_widen_reference,
    "scale the loss down, or set error_feedback=True",
)


def encode_reference(
    fmt: CastFormat, values: np.ndarray, residual: np.ndarray | None, out: np.ndarray
) -> int:
    """Encode float32 ``values`` into the 16-bit patterns ``out`` (uint16, or a little-endian
    ``<u2`` view of the frame), with error feedback when ``residual`` (float32, updated in
    place) is given.

    Returns:
        Without error feedback, the largest ``|value|`` as float32 bits (the caller refuses the
        push when it is ``>= fmt.overflow_bits``; ``out`` then holds infinities); with it, 0.
    """
    if residual is None:
        out[...] = fmt.round(values)
        return largest_magnitude_reference(values)
    with np.errstate(over="ignore"):
        p = residual + values
    np.clip(p, -FLOAT32_MAX, FLOAT32_MAX, out=p)  # an overflowed sum only (p is never NaN)
    h = fmt.round(p)
    overflowed = (h & np.uint16(0x7FFF)) > fmt.largest_finite
    h = np.where(overflowed, (h & np.uint16(0x8000)) | np.uint16(fmt.largest_finite), h)
    out[...] = h
    residual[...] = p - fmt.widen(h)
    return 0


def decode_reference(fmt: CastFormat, codes: np.ndarray, out: np.ndarray, accumulate: bool) -> None:
    """``out = float32(codes)`` or, with ``accumulate``, ``out += float32(codes)`` (float32)."""
    if accumulate:
        out += fmt.widen(codes)
    else:
        out[...] = fmt.widen(codes)


def overflow_error(fmt: CastFormat, largest_bits: int) -> CodecError:
    """The error of a push whose largest magnitude (float32 bits) rounds past ``fmt``'s range."""
    largest = float(np.array([largest_bits], dtype=np.uint32).view(np.float32)[0])
    return CodecError(
        f"codec {fmt.name!r}: the values' largest magnitude {largest:.7g} rounds past "
        f"{fmt.name}'s largest finite value {fmt.largest_value:.7g}; nothing was sent. "
        f"Remedy: {fmt.remedy}"
    )


# codec parts ---------------------------------------------------------------------------------

_LITTLE_ENDIAN = sys.byteorder == "little"


def _codes_view(frame: Any) -> Any:
    """The uint16 view of a payload frame (uint8, numpy or CuPy) that the kernels write."""
    if is_cupy_array(frame):
        import cupy  # noqa: PLC0415

        return frame.view(cupy.uint16)
    return frame.view("<u2")


class Cast16Encoder(QuantizerEncoder):
    """The encoder of one chunk: its residual with error feedback (on the chunk's device)."""

    codec: Cast16Codec

    def __init__(self, codec: Cast16Codec, place: ChunkPlace, device: Any = None) -> None:
        super().__init__(codec, place, device)
        self.fmt = codec.format
        self.residual = self.zeros() if codec.error_feedback else None
        if self.implementation == "numba" and not _LITTLE_ENDIAN:
            self.implementation = "numpy"  # the kernels write native uint16, the frame is <u2
        self._overflow = None
        if self.on_gpu and not codec.error_feedback:
            from kvstore.codecs.cast import cuda_kernels  # noqa: PLC0415

            self._overflow = cuda_kernels.OverflowReports()  # the kernel's overflow reports

    def encode_reference(self, values: np.ndarray, frames: list[np.ndarray]) -> None:
        largest = encode_reference(self.fmt, values, self.residual, _codes_view(frames[0]))
        self._check_overflow(largest)

    def encode_compiled(self, values: np.ndarray, frames: list[np.ndarray]) -> None:
        from kvstore.codecs.cast import numba_kernels  # noqa: PLC0415  (compiles on first use)

        codes = _codes_view(frames[0])
        bf16 = self.fmt is BF16
        if self.residual is None:
            kernel = numba_kernels.encode_bf16 if bf16 else numba_kernels.encode_fp16
            self._check_overflow(int(kernel(values, codes)))
        else:
            feedback_kernel = (
                numba_kernels.encode_bf16_feedback if bf16 else numba_kernels.encode_fp16_feedback
            )
            feedback_kernel(values, self.residual, codes)

    def encode_cuda(self, values: Any, frames: list[Any]) -> None:
        from kvstore.codecs.cast import cuda_kernels  # noqa: PLC0415

        largest = cuda_kernels.encode(
            values, self.residual, _codes_view(frames[0]), self.fmt is BF16, self._overflow
        )
        self._check_overflow(largest)

    def _check_overflow(self, largest_bits: int) -> None:
        """Refuse the push (before its frames are returned) when a value rounded past the
        format's range; only without error feedback, where there is no state to protect."""
        if largest_bits >= self.fmt.overflow_bits:
            raise overflow_error(self.fmt, largest_bits)


class Cast16KeyEncoder(QuantizerKeyEncoder):
    """Without error feedback, a key of several chunks is checked whole for values that would
    overflow before any chunk is encoded: the chunks are sent as they are encoded, so a refusal
    found in a later chunk would leave half a push sent. The check is one read of the key
    (about half the time of an ``a += b`` on the development machine); a key of one chunk
    skips it, since its kernel finds the largest magnitude while it encodes, before the frame
    is returned."""

    codec: Cast16Codec

    def begin(self, values: Any, *, finite: bool = False) -> None:
        super().begin(values, finite=finite)
        if self.codec.error_feedback or len(self.chunks) < 2:
            return
        largest = largest_magnitude(values, self.chunks[0].implementation)
        if largest >= self.codec.format.overflow_bits:
            for chunk in self.chunks:
                chunk.checked = False
            raise overflow_error(self.codec.format, largest)


def largest_magnitude(values: Any, implementation: str) -> int:
    """The largest ``|v|`` of float32 ``values`` as bits, by ``implementation``."""
    if implementation == "cupy":
        from kvstore.codecs.cast import cuda_kernels  # noqa: PLC0415

        return cuda_kernels.largest_magnitude(values)
    if implementation == "numba":
        from kvstore.codecs.cast import numba_kernels  # noqa: PLC0415

        return int(numba_kernels.largest_magnitude(values))
    return largest_magnitude_reference(values)


class Cast16Codec(QuantizerCodec):
    """A 16-bit cast (see the module docstring); subclasses set :attr:`name` and
    :attr:`format`.

    Args:
        error_feedback: keep the rounding error (and what saturation cut off) in a per-chunk
            float32 residual added to the next push (default False).
    """

    format: ClassVar[CastFormat]
    param_defaults = {"error_feedback": False}

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        value = self._params["error_feedback"]
        if not isinstance(value, bool | np.bool_):
            raise CodecError(
                f"codec {self.name!r}: error_feedback must be True or False, got "
                f"{type(value).__name__} {value!r}"
            )
        self.error_feedback = bool(value)
        self._params["error_feedback"] = self.error_feedback

    @property
    def state_arrays(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("residual",) if self.error_feedback else ()

    def code_bits(self) -> int:
        """16: a whole 16-bit float per element (the family's 1-8 bit packing does not apply)."""
        return 16

    def scale_count(self, numel: int) -> int:
        return 0

    def payload_nbytes(self, numel: int, dtype: str) -> tuple[int, ...]:
        return (2 * numel,)

    def make_chunk_encoder(self, place: ChunkPlace, device: Any = None) -> Cast16Encoder:
        return Cast16Encoder(self, place, device)

    def make_key_encoder(
        self,
        key: Any,
        numel: int,
        dtype: str,
        bounds: Sequence[tuple[int, int]],
        device: Any = None,
        *,
        worker: int = 0,
        shape: tuple[int, ...] | None = None,  # (ignored: every key is flat to this codec)
    ) -> KeyEncoder:
        chunks = super().make_key_encoder(key, numel, dtype, bounds, device, worker=worker).chunks
        return Cast16KeyEncoder(self, numel, chunks)  # type: ignore[arg-type]

    def decode_into(
        self,
        frames: Sequence[np.ndarray],
        numel: int,
        out: np.ndarray,
        accumulate: bool,
        implementation: str,
    ) -> None:
        codes = _codes_view(frames[0])[:numel]
        if implementation == "numba" and _LITTLE_ENDIAN:
            from kvstore.codecs.cast import numba_kernels  # noqa: PLC0415

            kernel = numba_kernels.decode_bf16 if self.format is BF16 else numba_kernels.decode_fp16
            kernel(codes, out, accumulate)
        else:
            decode_reference(self.format, codes, out, accumulate)


class Fp16Codec(Cast16Codec):
    """IEEE binary16: 11 significant bits, largest finite value 65504 (see the module
    docstring)."""

    name = "fp16"
    format = FP16
    example_params = ({}, {"error_feedback": True})


class Bf16Codec(Cast16Codec):
    """bfloat16: float32's exponent range, 8 significant bits (see the module docstring)."""

    name = "bf16"
    format = BF16
    example_params = ({"error_feedback": True}, {})
