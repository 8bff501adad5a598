"""2-bit threshold quantization with residuals, bit-exact with MXNet's ``2bit`` compression.

Semantics, per element, with threshold ``t > 0`` and a float32 residual ``r`` (one per key per
worker, starting at 0; all arithmetic in float32)::

    r += g
    if   r >=  t: code = 0b11; r -= t      # "+t" sent
    elif r <= -t: code = 0b10; r += t      # "-t" sent
    else:         code = 0b00              # nothing sent, r kept

Both comparisons are inclusive, and at most one quantum ``t`` leaves per element per push (a
residual of 1.3 with t = 0.5 sends +0.5 and keeps 0.8). Decoding maps ``11`` to ``+t``, ``10`` to
``-t`` and anything else (``00``; ``01`` is never produced) to 0.

Bit layout: byte ``j`` holds elements ``4j .. 4j+3``, the first in the most significant bit pair::

    byte[j] = c[4j] << 6 | c[4j+1] << 4 | c[4j+2] << 2 | c[4j+3]

The payload is ``ceil(n/16)`` 4-byte words (16 elements each), zero padded, so padding codes are
``00``. Read as a little-endian uint32, element ``k`` of a word sits at bits
``8*(k//4) + 6 - 2*(k%4)``. The element count is not in the payload; it travels in the message
header.

Worked example (t = 0.5, zero residual)::

    g        = [0.6, -0.7, 0.1, 0.5, -0.5, 0 x10, 1.0, 0.9]          (17 elements)
    bytes    = e3 80 00 03 c0 00 00 00
    residual = [0.1, -0.2, 0.1, 0, 0, 0 x10, 0.5, 0.4]

Implementations with one contract (identical bytes and residual bits on any input, tested
against a per-element oracle): :func:`encode_reference` / :func:`decode_reference` (vectorised
numpy), the compiled CPU kernels in ``numba_kernels`` (the default; ``KVSTORE_CPU_KERNELS=numpy``
selects the reference) and the CuPy kernels in ``cuda_kernels`` for GPU arrays. The
``residual_clip`` variant below has the same three: :func:`encode_clipped_reference`,
``numba_kernels.encode_clipped`` and ``cuda_variant_kernels.encode_clipped``.

**Bounded residual (opt-in; not MXNet).** With ``residual_clip = c`` (a number >= 1, in
thresholds) each element's residual is clipped to ``[-c*t, c*t]`` (float32 ``limit = c*t``)
right after it is quantized; the codes, the payload and the decoding are unchanged::

    r += g
    if   r >=  t: code = 0b11; r -= t
    elif r <= -t: code = 0b10; r += t
    else:         code = 0b00
    r = min(max(r, -limit), limit)        # NaN stays NaN, +-inf becomes +-limit

Why: 2-bit sends at most one quantum per element per push, so a gradient far above ``t`` waits
in the residual and leaves one ``t`` per push for as many pushes as it holds thresholds. Under a
server optimizer with momentum ``m`` every quantum moves the weight ``lr*t/(1-m)`` in total, and
the backlog keeps streaming out in its old direction after the gradient has turned, so the
weights overshoot, the gradients grow and the backlog grows with them. On the MNIST example
(2 workers x 2 servers, SGD lr 0.2, momentum 0.9, t = 0.02) the largest residual reached 100
thresholds within 30 steps and 3,500 by the third epoch, 10-19% of the quanta sent pointed
against the current gradient (0.2-2% at momentum 0.5), the steps were 2-3x the dense ones and
the model fell to chance accuracy at every t from 0.005 to 0.1, where uncompressed training
reached 92.8%. ``residual_clip = 1`` bounds the backlog to one push, at the price of dropping
the part of a spike beyond ``2t`` (a per-element gradient clip); with it the same run reached
93.4% (seeds 1 and 2: 92.8% and 92.0%, dense 92.0% and 93.2%). Sub-threshold gradients still
add up to a quantum, which is why ``c < 1`` is refused: they could then never be sent.

Residual watch: in the unbounded (MXNet) mode an encoder checks every
:data:`RUNAWAY_CHECK_EVERY` pushes whether an element of its residual holds
:data:`RUNAWAY_THRESHOLDS` thresholds or more, and if so logs one WARNING per key (its
``label``) with the largest residual and the remedies.
"""

from __future__ import annotations

import logging
import math
import sys
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.codecs.base import (
    Aggregator,
    Codec,
    Encoder,
    Payloads,
    PushQuality,
    frame_array,
    positive_float32,
    squared_norm,
)
from kvstore.codecs.xp import device_to_host, is_cupy_array, pinned_empty, to_device
from kvstore.config import cpu_kernels_from_env
from kvstore.errors import CodecError

ELEMS_PER_WORD = 16

RUNAWAY_THRESHOLDS = 1000
"""A residual element holding this many thresholds is a runaway: it needs at least as many pushes
to be sent. On the MNIST example healthy runs (momentum 0 or 0.5, t from 0.005 to 0.02) never
held 1,000 in any element over 8 epochs (the largest: about 700, at t = 0.005); every run that
collapsed at momentum 0.9 had dozens of elements beyond it."""

RUNAWAY_CHECK_EVERY = 32
"""Pushes between two residual checks. A check is one read of the residual without a temporary
(a compiled count of ``|r| >= 1000 t``), about half an encode's time on 16M elements, so the
watch costs about 1.5% of the encodes; a runaway takes hundreds of pushes to build up."""

logger = logging.getLogger(__name__)


def packed_words(numel: int) -> int:
    """Number of 4-byte words that hold ``numel`` 2-bit codes."""
    return -(-numel // ELEMS_PER_WORD)


# numpy reference ---------------------------------------------------------------------------


def encode_reference(
    grad: np.ndarray, residual: np.ndarray, threshold: float, out: np.ndarray
) -> None:
    """Vectorised numpy 2-bit encode (the reference the kernels are checked against).

    Args:
        grad: float32[n].
        residual: float32[n]; updated in place.
        threshold: t > 0 (used as float32).
        out: uint32[ceil(n/16)] (any 4-byte-per-word buffer); fully overwritten.
    """
    t = np.float32(threshold)
    n = grad.shape[0]
    x = residual + grad
    pos = x >= t
    neg = x <= -t
    np.subtract(x, t, out=x, where=pos)
    np.add(x, t, out=x, where=neg)
    residual[...] = x
    codes = np.zeros(packed_words(n) * ELEMS_PER_WORD, dtype=np.uint8)
    codes[:n] = pos.view(np.uint8) * np.uint8(3) | neg.view(np.uint8) * np.uint8(2)
    quads = codes.reshape(-1, 4)
    packed = out.view(np.uint8)
    packed[...] = (quads[:, 0] << 6) | (quads[:, 1] << 4) | (quads[:, 2] << 2) | quads[:, 3]


def encode_clipped_reference(
    grad: np.ndarray, residual: np.ndarray, threshold: float, limit: float, out: np.ndarray
) -> None:
    """:func:`encode_reference`, then the residual clipped to ``[-limit, limit]`` (the
    ``residual_clip`` variant; ``limit`` from :func:`residual_limit`). ``numpy.clip`` keeps a NaN
    and turns +-inf into +-limit, as the kernels do."""
    encode_reference(grad, residual, threshold, out)
    bound = np.float32(limit)
    np.clip(residual, -bound, bound, out=residual)


def count_at_least_reference(values: np.ndarray, bound: float) -> int:
    """How many elements have ``|v| >= bound`` (NaNs never count)."""
    return int(np.count_nonzero(np.abs(values) >= np.float32(bound)))


def decode_reference(
    words: np.ndarray, n: int, threshold: float, out: np.ndarray, accumulate: bool = False
) -> None:
    """Vectorised numpy 2-bit decode into ``out`` (float32[n]); adds when ``accumulate``."""
    t = np.float32(threshold)
    packed = np.asarray(words).view(np.uint8)
    codes = np.empty(packed.shape[0] * 4, dtype=np.uint8)
    for k in range(4):
        codes[k::4] = (packed >> (6 - 2 * k)) & 3
    codes = codes[:n]
    values = np.where(codes == 3, t, np.where(codes == 2, -t, np.float32(0))).astype(np.float32)
    if accumulate:
        out += values
    else:
        out[...] = values


# kernel selection ----------------------------------------------------------------------------

EncodeFn = Callable[[np.ndarray, np.ndarray, Any, np.ndarray], None]
DecodeFn = Callable[[np.ndarray, int, Any, np.ndarray, bool], None]


def cpu_kernels(name: str | None = None) -> tuple[EncodeFn, DecodeFn]:
    """The CPU (encode, decode) pair: ``"numba"`` (compiled) or ``"numpy"`` (reference).

    ``None`` reads ``KVSTORE_CPU_KERNELS``. The compiled kernels write little-endian words, so on
    a big-endian machine the reference is used instead.
    """
    name = cpu_kernels_from_env() if name is None else name
    if name == "numba" and sys.byteorder == "little":
        from kvstore.codecs.twobit import numba_kernels  # noqa: PLC0415  (compiles on first use)

        return numba_kernels.encode, numba_kernels.decode
    if name in ("numba", "numpy"):
        return encode_reference, decode_reference
    raise CodecError(f"unknown CPU kernel set {name!r}; expected 'numba' or 'numpy'")


ClippedEncodeFn = Callable[[np.ndarray, np.ndarray, Any, Any, np.ndarray], None]
CountFn = Callable[[np.ndarray, Any], int]


def cpu_variant_kernels(name: str | None = None) -> tuple[ClippedEncodeFn, CountFn]:
    """The CPU (clipped encode, count at least) pair, chosen as :func:`cpu_kernels` chooses."""
    encode_fn, _ = cpu_kernels(name)
    if encode_fn is encode_reference:
        return encode_clipped_reference, count_at_least_reference
    from kvstore.codecs.twobit import numba_kernels  # noqa: PLC0415

    return numba_kernels.encode_clipped, numba_kernels.count_at_least


def residual_clip_param(value: Any) -> float | None:
    """The codec's ``residual_clip`` as the float32 it is used as: None, or finite and >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise CodecError(
            f"codec '2bit': residual_clip must be a number (in thresholds) or None, got "
            f"{type(value).__name__} {value!r}"
        )
    with np.errstate(over="ignore"):  # too large for float32: inf, refused below
        as32 = float(np.float32(value))
    if not (math.isfinite(float(value)) and math.isfinite(as32) and as32 >= 1):
        raise CodecError(
            f"codec '2bit': residual_clip must be a finite number >= 1 (in thresholds: below 1, "
            f"gradients smaller than the threshold could never add up to a quantum), got "
            f"{value!r}"
        )
    return as32


def residual_limit(threshold: float, residual_clip: float) -> np.float32:
    """The float32 bound ``residual_clip * threshold`` that every kernel clips to."""
    return np.float32(np.float32(residual_clip) * np.float32(threshold))


def _check_float32(array: Any, what: str) -> None:
    if array.dtype != np.float32:
        raise CodecError(f"2bit compression needs float32 values, but {what} is {array.dtype}")


def encode(
    grad: Any,
    residual: Any,
    threshold: float,
    out: Any = None,
    *,
    kernels: str | None = None,
    residual_clip: float | None = None,
) -> Any:
    """Encode ``grad`` with residual (numpy or CuPy arrays, flattened); return the packed words.

    Args:
        grad: float32 values; any shape, contiguous.
        residual: float32, same size; updated in place.
        threshold: t > 0.
        out: uint32[ceil(n/16)] to write into; allocated when None.
        kernels: CPU kernel set (see :func:`cpu_kernels`).
        residual_clip: None (MXNet's unbounded residual) or c >= 1: the residual is clipped to
            ``[-c*t, c*t]`` after each element's quantization (module docstring).
    """
    t = positive_float32("2bit", "threshold", threshold)
    clip = residual_clip_param(residual_clip)
    _check_float32(grad, "grad")
    _check_float32(residual, "residual")
    if grad.size != residual.size:
        raise CodecError(f"grad has {grad.size} elements but residual has {residual.size}")
    g = grad.reshape(-1)
    r = residual.reshape(-1)
    if is_cupy_array(grad):
        import cupy  # noqa: PLC0415

        from kvstore.codecs.twobit import cuda_kernels  # noqa: PLC0415

        if out is None:
            out = cupy.empty(packed_words(g.size), dtype=cupy.uint32)
        if clip is None:
            cuda_kernels.encode(g, r, t, out)
        else:
            from kvstore.codecs.twobit import cuda_variant_kernels  # noqa: PLC0415

            cuda_variant_kernels.encode_clipped(g, r, t, residual_limit(t, clip), out)
        return out
    if out is None:
        out = np.empty(packed_words(g.size), dtype=np.uint32)
    if clip is None:
        encode_fn, _ = cpu_kernels(kernels)
        encode_fn(g, r, np.float32(t), out)
    else:
        clipped_fn, _ = cpu_variant_kernels(kernels)
        clipped_fn(g, r, np.float32(t), residual_limit(t, clip), out)
    return out


def decode(
    words: Any,
    numel: int,
    threshold: float,
    out: Any = None,
    *,
    accumulate: bool = False,
    kernels: str | None = None,
) -> Any:
    """Decode ``numel`` values from packed ``words`` into float32 ``out`` (allocated when None)."""
    t = positive_float32("2bit", "threshold", threshold)
    if words.size < packed_words(numel):
        raise CodecError(f"{words.size} words cannot hold {numel} 2-bit codes")
    if is_cupy_array(words):
        import cupy  # noqa: PLC0415

        from kvstore.codecs.twobit import cuda_kernels  # noqa: PLC0415

        if out is None:
            out = cupy.zeros(numel, dtype=cupy.float32)
        cuda_kernels.decode(words, numel, t, out.reshape(-1), accumulate)
        return out
    if out is None:
        out = np.zeros(numel, dtype=np.float32)
    _, decode_fn = cpu_kernels(kernels)
    decode_fn(np.asarray(words).view(np.uint32), numel, np.float32(t), out.reshape(-1), accumulate)
    return out


_NONZERO_CODES = np.array(
    [sum((byte >> shift) & 2 != 0 for shift in (0, 2, 4, 6)) for byte in range(256)], np.uint8
)
"""Nonzero 2-bit codes in each byte value: a code is nonzero exactly when its high bit is set
(``11`` and ``10``; ``01`` is never produced, and the padding is ``00``)."""


def count_sent(words: np.ndarray) -> int:
    """How many elements packed ``words`` (host memory) send as +t or -t."""
    return int(_NONZERO_CODES[np.asarray(words).view(np.uint8)].sum(dtype=np.int64))


# codec parts ---------------------------------------------------------------------------------


class _TwoBitEncoder(Encoder):
    """What the CPU and GPU encoders share: the optional residual bound and the residual watch.

    Attributes:
        label: what the runaway warning calls the key (the client sets its description).
    """

    state_names = ("residual",)  # on a GPU: copied to the host by state(), back by load_state()

    def __init__(
        self, numel: int, threshold: float, residual_clip: float | None, warned: set[str]
    ) -> None:
        super().__init__(numel, "float32")
        self.label = "a key"
        self.residual_clip = residual_clip
        self._t = float(np.float32(threshold))
        self._limit = None if residual_clip is None else residual_limit(threshold, residual_clip)
        # The watch bound as the kernels compare it, in float32; a clip below it never runs away.
        self._runaway_bound = np.float32(np.float32(RUNAWAY_THRESHOLDS) * np.float32(threshold))
        # Whether pushes look for a runaway residual (off for an encoder of pull deltas, whose
        # residual is cleared before every encode).
        self.watch_runaway = self._limit is None or self._limit >= self._runaway_bound
        self._warned = warned  # the labels warned about, shared by one codec's encoders
        self._pushes = 0

    def _after_push(self) -> None:
        """Count the push; every RUNAWAY_CHECK_EVERY pushes look for a runaway residual."""
        self._pushes += 1
        if (
            not self.watch_runaway
            or self._pushes % RUNAWAY_CHECK_EVERY
            or self.label in self._warned
            or self._count_at_least(self._runaway_bound) == 0
        ):
            return
        self._warned.add(self.label)
        t = self._t
        largest = self._max_abs() / t
        logger.warning(
            "2-bit residual of %s runs away: its largest element holds %.0f thresholds "
            "(t = %g), and 2-bit sends at most one threshold per element per push, so the "
            "weights keep moving on stale gradients for that many pushes (with server momentum "
            "this feeds back into larger gradients and training can collapse). Remedy: bound "
            "the residual with {'type': '2bit', 'threshold': %g, 'residual_clip': 1}, or lower "
            "the server optimizer's momentum (<= 0.5), or raise the threshold towards the "
            "gradients' scale",
            self.label,
            largest,
            t,
            t,
        )

    @abstractmethod
    def _count_at_least(self, bound: np.float32) -> int:
        """Residual elements with ``|r| >= bound`` (one pass, no temporary)."""

    @abstractmethod
    def _max_abs(self) -> float:
        """The largest ``|r|`` (NaNs ignored); called once, when warning."""


class _HostTwoBitEncoder(_TwoBitEncoder):
    """CPU encoder: residual and output words in host memory, compiled kernel."""

    def __init__(
        self, numel: int, threshold: float, residual_clip: float | None, warned: set[str]
    ) -> None:
        super().__init__(numel, threshold, residual_clip, warned)
        self.threshold = np.float32(threshold)
        self.residual = np.zeros(numel, dtype=np.float32)
        self._words = np.zeros(packed_words(numel), dtype=np.uint32)
        self._encode, _ = cpu_kernels()
        self._encode_clipped, self._count = cpu_variant_kernels()

    def encode(self, values: Any) -> list[Any]:
        if self._limit is None:
            self._encode(values, self.residual, self.threshold, self._words)
        else:
            self._encode_clipped(values, self.residual, self.threshold, self._limit, self._words)
        self._after_push()
        return [self._words]

    def quality(self, values: Any) -> PushQuality:
        return PushQuality(
            squared_norm(values), squared_norm(self.residual), count_sent(self._words)
        )

    def _count_at_least(self, bound: np.float32) -> int:
        return int(self._count(self.residual, bound))

    def _max_abs(self) -> float:
        return float(np.nanmax(np.abs(self.residual), initial=0.0))


class _CudaTwoBitEncoder(_TwoBitEncoder):
    """GPU encoder: residual and words on the device, words copied to pinned host memory."""

    def __init__(
        self, numel: int, threshold: float, residual_clip: float | None, warned: set[str]
    ) -> None:
        import cupy  # noqa: PLC0415

        super().__init__(numel, threshold, residual_clip, warned)
        self.threshold = float(threshold)
        self.residual = cupy.zeros(numel, dtype=cupy.float32)
        self._words = cupy.zeros(packed_words(numel), dtype=cupy.uint32)
        self._host = pinned_empty(packed_words(numel), np.uint32)

    def encode(self, values: Any) -> list[Any]:
        from kvstore.codecs.twobit import cuda_kernels  # noqa: PLC0415

        if self._limit is None:
            cuda_kernels.encode(values, self.residual, self.threshold, self._words)
        else:
            from kvstore.codecs.twobit import cuda_variant_kernels  # noqa: PLC0415

            cuda_variant_kernels.encode_clipped(
                values, self.residual, self.threshold, self._limit, self._words
            )
        device_to_host(self._words, self._host)  # waits for the kernel: the grad is free
        self._after_push()
        return [self._host]

    def quality(self, values: Any) -> PushQuality:
        # The norms on the device (two reductions, one scalar back each); the codes from the
        # host copy of the words that the push sends anyway.
        return PushQuality(
            squared_norm(values), squared_norm(self.residual), count_sent(self._host)
        )

    def _count_at_least(self, bound: np.float32) -> int:
        from kvstore.codecs.twobit import cuda_variant_kernels  # noqa: PLC0415

        return cuda_variant_kernels.count_at_least(self.residual, bound)

    def _max_abs(self) -> float:
        import cupy  # noqa: PLC0415

        return float(cupy.nanmax(cupy.abs(self.residual))) if self.numel else 0.0


class _TwoBitAggregator(Aggregator):
    def __init__(self, numel: int, threshold: float) -> None:
        super().__init__(numel, "float32")
        self.threshold = np.float32(threshold)
        _, self._decode = cpu_kernels()

    def add(self, payloads: Payloads, first: bool) -> None:
        # TwoBitCodec.sum_relay repeats exactly this on the worker: keep the two in step.
        words = frame_array(payloads[0], np.uint32)
        self._decode(words, self.numel, self.threshold, self.result, not first)


class TwoBitCodec(Codec):
    """MXNet-compatible 2-bit threshold quantization with error feedback (16x smaller pushes).

    Args:
        threshold: the quantum ``t > 0`` (default 0.5), used as float32. It is absolute, so it
            must match the gradients' scale.
        residual_clip: None (default: MXNet's unbounded residual, bit-exact) or a number
            ``c >= 1``: each element's residual is clipped to ``[-c*t, c*t]`` after it is
            quantized (see the module docstring). The payload and the servers are unchanged.
            ``1`` is what trained the MNIST example at server momentum 0.9 (93.4%, dense 92.8%)
            where the unbounded residual ran away and collapsed to chance; the default mode
            logs a warning when a residual runs away. Left out of :meth:`params` when None, so
            the default's spec stays MXNet's ``{"type": "2bit", "threshold": t}``.
    """

    name = "2bit"
    dtypes = frozenset({"float32"})
    param_defaults = {"threshold": 0.5, "residual_clip": None}
    example_params = ({"threshold": 0.5}, {"threshold": 0.25, "residual_clip": 1})
    # Decoding is exact (+t, -t or +0.0) and the server adds the decoded pushes one after
    # another in float32, so the worker can redo the sum from the pushes bit for bit.
    relayable = True

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.threshold = positive_float32(self.name, "threshold", self._params["threshold"])
        self._params["threshold"] = self.threshold
        self.residual_clip = residual_clip_param(self._params.pop("residual_clip"))
        if self.residual_clip is not None:
            self._params["residual_clip"] = self.residual_clip
        # Keys whose runaway residual was reported: one warning per key, however many chunks
        # (encoders) it has. Logging state, not a hyperparameter: not in the spec.
        self._runaway_warned: set[str] = set()

    def payload_nbytes(self, numel: int, dtype: str) -> tuple[int, ...]:
        return (4 * packed_words(numel),)

    def make_encoder(self, numel: int, dtype: str, device: Any = None) -> Encoder:
        self.check_dtype(dtype)
        args = (numel, self.threshold, self.residual_clip, self._runaway_warned)
        if device is not None:
            return _CudaTwoBitEncoder(*args)
        return _HostTwoBitEncoder(*args)

    def make_aggregator(self, numel: int, dtype: str) -> Aggregator:
        self.check_dtype(dtype)
        return _TwoBitAggregator(numel, self.threshold)

    def sum_relay(self, pushes: Sequence[Payloads], numel: int, dtype: str, out: Any) -> None:
        self.check_dtype(dtype)
        if not pushes:
            raise CodecError("a relayed pull needs at least one push")
        for payloads in pushes:
            self.validate_payloads(payloads, numel, dtype)
        on_gpu = is_cupy_array(out)
        for i, payloads in enumerate(pushes):
            words = frame_array(payloads[0], np.uint32)
            if on_gpu:
                words = to_device(words, np.uint32)  # through pinned staging
            # The aggregator's arithmetic: the first push written, the others added in order.
            decode(words, numel, self.threshold, out, accumulate=i > 0)
