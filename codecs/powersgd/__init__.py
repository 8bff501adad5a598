"""``powersgd``: PowerSGD (Vogels, Karimireddy, Jaggi, 2019), the paper's version on a parameter
server: one power step per push with warm start and error feedback, two round trips per step.

**Matrix view.** A key of shape ``(n, *rest)`` is the matrix ``n x m``, ``m = prod(rest)``,
row-major (the flat key). Its rank is ``r = min(rank, n, m)``. 1-D keys and keys where the
factors would not gain (``(n + m) * r * 2 >= n * m``) are sent dense, like ``none``. The codec
asks the client to cut a compressed key into chunks of whole rows (:meth:`chunk_alignment`:
``lcm(16, m)``), so that each chunk is a ``rows x m`` matrix that its server approximates on
its own, at rank ``r``. A chunk that does not hold whole rows (rows longer than a partition) or
would not gain itself (``(rows + m) * r * 2 >= rows * m``) is sent dense (:func:`chunk_matrix`,
which the worker and the server both evaluate, so they agree without saying it on the wire).

**A step of one compressed chunk** (``M`` = the chunk's gradient as a matrix plus the worker's
error ``e``; ``Q`` the warm-start factor, ``m x r``, the same on every worker):

1. the worker pushes ``P_i = M @ Q`` (``rows x r``); the server sums the P of all workers,
   orthonormalizes its columns (Gram-Schmidt in float64, ``eps = 1e-8`` added to each norm)
   and sends ``P_hat`` (float32) back to every pusher (:meth:`Aggregator.finish`);
2. the worker pushes ``Q_i = M^T @ P_hat`` (``m x r``); the server sums ``Q_sum`` and stores
   ``P_hat @ Q_sum^T``, the sum of the workers' approximations (or hands it to its
   optimizer), and acknowledges the pushes with ``Q_sum`` (:meth:`Aggregator.reply_frames`);
3. the worker keeps ``e = M - P_hat @ Q_i^T`` (summed over workers: exactly the part of
   ``sum(M_i)`` the server did not apply) and ``Q = Q_sum`` as the next warm start.

The first ``warmup_steps`` pushes of a key are dense (``M`` is sent, ``e = 0``). The server
tells a round's kind by its payload size: ``numel``, ``rows * r`` or ``m * r`` float32.

**Defined matmuls** (the numpy reference, the numba kernels of
:mod:`~kvstore.codecs.powersgd.numba_kernels` and the CuPy kernels of
:mod:`~kvstore.codecs.powersgd.cuda_kernels` agree bit for bit): every entry of ``M @ Q``,
``M^T @ P_hat`` and ``P_hat @ Q_i^T`` is a dot product of float32 terms whose products are
taken exactly in float64 (two float32 multiply exactly in float64), summed in float64 from
``+0.0`` over increasing index, and rounded once to float32. ``e`` is then ``M`` minus that
float32 in float32.

**Initial factor** (:func:`initial_factor`): element ``(j, c)`` of the key's ``m x r`` matrix
is ``(u0 + u1 + u2 + u3 - 2) * sqrt(3)``, four float32 uniforms of
:mod:`~kvstore.codecs.counter_rng` (elements ``4 * (j * r + c) + t`` of the stream keyed
``(seed, 0, key hash, 0, INITIAL_FACTOR)``), summed in float64 and rounded to float32: zero mean,
unit variance, close to normal (Irwin-Hall), and every operation exact or correctly rounded, so
every worker on every machine starts from the same bits without transcendental functions. It is
drawn on the host, once per key encoder; every compressed chunk of the key starts from it.

State (checkpoints): per compressed chunk ``error`` (its elements), ``factor`` (``Q``, ``m * r``
row-major) and ``pushes`` (0-d); dense chunks keep none. A checkpoint of a compressed key loads
only with the chunking it was saved with (a factor belongs to its chunk).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvstore.codecs.base import (
    Aggregator,
    Codec,
    Encoder,
    KeyEncoder,
    Payloads,
    frame_array,
    frame_nbytes,
)
from kvstore.codecs.counter_rng import stable_key_hash, stream_key, uniforms_reference
from kvstore.codecs.finite import count_nonfinite
from kvstore.codecs.identity import IdentityCodec
from kvstore.codecs.xp import is_cupy_array, pinned_empty
from kvstore.config import cpu_kernels_from_env
from kvstore.errors import CodecError

EPSILON = 1e-8
"""Added to every column norm in Gram-Schmidt, so that a zero column stays zero."""

INITIAL_FACTOR = 0x50534744
"""The purpose word of the initial factor's stream ("PSGD")."""

UNIFORMS_PER_ELEMENT = 4
"""Uniforms summed into each element of the initial factor."""

_SEED_LIMIT = 1 << 63
_INDEX_LIMIT = 1 << 32  # uniforms are indexed by 32-bit element numbers
_FLOAT32 = np.dtype(np.float32)


# geometry ------------------------------------------------------------------------------------


class ChunkMatrix(NamedTuple):
    """A compressed chunk as a matrix.

    Attributes:
        rows: whole rows of the key in the chunk.
        cols: the key's row length ``m``.
        rank: the key's rank ``r`` (a chunk of fewer rows than ``r`` never gains).
    """

    rows: int
    cols: int
    rank: int


def key_matrix(shape: Sequence[int] | None, rank: int) -> tuple[int, int, int] | None:
    """``(n, m, r)`` of a key of ``shape`` that is compressed at ``rank``, else None (1-D, empty,
    or ``(n + m) * r * 2 >= n * m``: the factors would not gain)."""
    if shape is None or len(shape) < 2:
        return None
    n, m = int(shape[0]), math.prod(int(d) for d in shape[1:])
    r = min(rank, n, m)
    if r < 1 or (n + m) * r * 2 >= n * m or m * r * UNIFORMS_PER_ELEMENT > _INDEX_LIMIT:
        return None
    return n, m, r


def chunk_matrix(
    shape: Sequence[int] | None, start: int, numel: int, rank: int
) -> ChunkMatrix | None:
    """The matrix of the chunk of elements ``[start, start + numel)`` of a key of ``shape``, or
    None when the chunk is sent dense: the key is not compressed (:func:`key_matrix`), the
    chunk does not hold whole rows, or its own factors would not gain."""
    found = key_matrix(shape, rank)
    if found is None or numel == 0:
        return None
    _, m, r = found
    if start % m or numel % m:
        return None
    rows = numel // m
    if (rows + m) * r * 2 >= numel:
        return None
    return ChunkMatrix(rows, m, r)


# the defined matmuls (numpy references) -------------------------------------------------------


def project_reference(matrix: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """``matrix @ factor`` (float32 ``rows x m`` and ``m x r``) as defined: float64 sums over
    increasing ``j`` from +0.0, rounded once to float32."""
    total = np.zeros((matrix.shape[0], factor.shape[1]), dtype=np.float64)
    right = factor.astype(np.float64)
    for j in range(matrix.shape[1]):  # one term per j, added in order to every entry
        total += matrix[:, j, None].astype(np.float64) * right[j]
    return total.astype(np.float32)


def back_project_reference(matrix: np.ndarray, p_hat: np.ndarray) -> np.ndarray:
    """``matrix^T @ p_hat`` (float32 ``rows x m`` and ``rows x r``) as defined: float64 sums
    over increasing row ``i`` from +0.0, rounded once to float32."""
    total = np.zeros((matrix.shape[1], p_hat.shape[1]), dtype=np.float64)
    left = p_hat.astype(np.float64)
    for i in range(matrix.shape[0]):
        total += matrix[i, :, None].astype(np.float64) * left[i]
    return total.astype(np.float32)


def approximation_reference(p_hat: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``p_hat @ q^T`` (float32 ``rows x r`` and ``m x r``) as defined: float64 sums over
    increasing ``k`` from +0.0, rounded once to float32."""
    total = np.zeros((p_hat.shape[0], q.shape[0]), dtype=np.float64)
    left, right = p_hat.astype(np.float64), q.astype(np.float64)
    for k in range(p_hat.shape[1]):
        total += left[:, k, None] * right[None, :, k]
    return total.astype(np.float32)


def orthonormalize(columns: np.ndarray) -> None:
    """Gram-Schmidt on the columns of the float64 matrix ``columns``, in place: each column in
    turn is divided by its norm plus :data:`EPSILON`, then taken out of every later column."""
    for k in range(columns.shape[1]):
        column = columns[:, k]
        column /= math.sqrt(float(column @ column)) + EPSILON
        rest = columns[:, k + 1 :]
        if rest.shape[1]:
            rest -= column[:, None] * (column @ rest)[None, :]


def initial_factor(seed: int, key_hash: int, cols: int, rank: int) -> np.ndarray:
    """The key's initial ``cols x rank`` factor (float32; see the module docstring)."""
    stream = stream_key(seed, 0, key_hash, 0, INITIAL_FACTOR)
    uniforms = uniforms_reference(stream, 0, cols * rank * UNIFORMS_PER_ELEMENT)
    terms = uniforms.reshape(cols * rank, UNIFORMS_PER_ELEMENT).astype(np.float64)
    total = terms[:, 0].copy()
    for t in range(1, UNIFORMS_PER_ELEMENT):  # in order (every partial sum is exact anyway)
        total += terms[:, t]
    return ((total - 2.0) * math.sqrt(3.0)).astype(np.float32).reshape(cols, rank)


# worker side ---------------------------------------------------------------------------------


def kernel_set() -> str:
    """``"numba"`` or ``"numpy"`` (``KVSTORE_CPU_KERNELS``), read when an encoder is made."""
    return cpu_kernels_from_env()


def check_values(values: Any, numel: int, on_gpu: bool, finite: bool = False) -> None:
    """Raise CodecError unless ``values`` are ``numel`` float32 on the encoder's side, and
    (unless ``finite`` says the caller checked) hold no NaN or infinity."""
    if values.size != numel or values.dtype != _FLOAT32:
        raise CodecError(
            f"codec 'powersgd': expected {numel} float32 values, got {values.size} {values.dtype}"
        )
    if is_cupy_array(values) != on_gpu:
        raise CodecError(
            "codec 'powersgd': values and encoder state must both be on the host or GPU"
        )
    bad = 0 if finite else count_nonfinite(values)
    if bad:
        raise CodecError(
            f"codec 'powersgd': the values hold {bad} NaN or infinite element(s); nothing was "
            f"encoded and the state is unchanged"
        )


def _reply_frame(reply: Payloads, count: int, what: str) -> np.ndarray:
    """The one float32 frame of ``count`` elements a server's reply must be."""
    if len(reply) != 1:
        raise CodecError(f"codec 'powersgd': {what} must be one frame, got {len(reply)}")
    values = frame_array(reply[0], np.uint8)
    if values.nbytes != 4 * count:
        raise CodecError(
            f"codec 'powersgd': {what} must hold {count} float32, got {values.nbytes} bytes"
        )
    return values.view(np.float32)


class PowerSGDEncoder(Encoder):
    """The worker-side encoder of one compressed chunk (see the module docstring).

    Attributes:
        matrix: the chunk's geometry.
        warmup_steps: pushes sent dense first.
        implementation: ``"numpy"``, ``"numba"`` or ``"cupy"``.
        error: ``e``, then ``M`` between a step's first round and its end (float32, the chunk's
            elements).
        factor: ``Q``, ``cols x rank`` row-major (float32).
        pushes: pushes encoded so far.
    """

    state_names = ("error", "factor", "pushes")

    def __init__(
        self, matrix: ChunkMatrix, warmup_steps: int, factor: np.ndarray, device: Any = None
    ) -> None:
        super().__init__(matrix.rows * matrix.cols, "float32")
        self.matrix = matrix
        self.warmup_steps = warmup_steps
        self.on_gpu = device is not None
        self.device = device
        self.implementation = "cupy" if self.on_gpu else kernel_set()
        self.pushes = 0
        self.checked = False
        self._round = 0  # 0: between steps; 1: P sent; 2: Q sent
        rows, cols, rank = matrix.rows, matrix.cols, matrix.rank
        empty = pinned_empty if self.on_gpu else np.empty
        self._p_frame = empty(rows * rank, np.float32)  # host payloads of the two rounds
        self._q_frame = empty(cols * rank, np.float32)
        self._dense_frame: np.ndarray | None = None  # made by the first warm-up push
        self._dense: Any = None  # its device twin (GPU)
        if self.on_gpu:
            import cupy  # noqa: PLC0415

            with device:
                self.error = cupy.zeros(self.numel, dtype=cupy.float32)
                self.factor = cupy.asarray(np.ascontiguousarray(factor).reshape(-1))
                self._p = cupy.empty(rows * rank, dtype=cupy.float32)
                self._q = cupy.empty(cols * rank, dtype=cupy.float32)
                self._p_hat = cupy.empty(rows * rank, dtype=cupy.float32)
        else:
            self.error = np.zeros(self.numel, dtype=np.float32)
            self.factor = np.array(factor, dtype=np.float32).reshape(-1)
            self._p, self._q = self._p_frame, self._q_frame
            self._p_hat = np.empty(rows * rank, dtype=np.float32)

    # the step ---------------------------------------------------------------------------------

    def encode(self, values: Any) -> list[Any]:
        """Round 1 of a push (or the whole of a dense warm-up push)."""
        if not self.checked:
            check_values(values, self.numel, self.on_gpu)
        self.checked = False
        self._round = 0  # (a step whose rounds failed leaves M in `error`: it is carried)
        dense = self.pushes < self.warmup_steps
        self.pushes += 1
        self.round_trips = 1 if dense else 2
        if dense:
            return [self._encode_dense(values)]
        self._round = 1
        m = self.matrix
        if self.implementation == "cupy":
            from kvstore.codecs.powersgd import cuda_kernels  # noqa: PLC0415
            from kvstore.codecs.xp import device_to_host  # noqa: PLC0415

            with self.device:
                cuda_kernels.accumulate_project(values, self.error, self.factor, self._p, m)
                device_to_host(self._p, self._p_frame)
        elif self.implementation == "numba":
            from kvstore.codecs.powersgd import numba_kernels  # noqa: PLC0415

            numba_kernels.accumulate_project(
                values, self.error, self.factor, m.rows, m.cols, m.rank, self._p
            )
        else:
            self.error += values
            matrix = self.error.reshape(m.rows, m.cols)
            self._p[:] = project_reference(matrix, self.factor.reshape(m.cols, m.rank)).ravel()
        return [self._p_frame]

    def _encode_dense(self, values: Any) -> np.ndarray:
        """``M = g + e`` into the dense payload; ``e = 0``."""
        if self._dense_frame is None:
            empty = pinned_empty if self.on_gpu else np.empty
            self._dense_frame = empty(self.numel, np.float32)
        if self.on_gpu:
            from kvstore.codecs.powersgd import cuda_kernels  # noqa: PLC0415
            from kvstore.codecs.xp import device_to_host  # noqa: PLC0415

            with self.device:
                if self._dense is None:
                    self._dense = self.error.copy()
                cuda_kernels.take_dense(values, self.error, self._dense)
                device_to_host(self._dense, self._dense_frame)  # (waits for the kernel)
        else:
            np.add(self.error, values, out=self._dense_frame)
            self.error.fill(0)
        return self._dense_frame

    def next_round(self, reply: Payloads) -> list[Any]:
        """Round 2: ``Q_i = M^T @ P_hat`` from the server's ``P_hat``."""
        if self._round != 1:
            raise CodecError("codec 'powersgd': a P_hat arrived outside a step's first round")
        m = self.matrix
        p_hat = _reply_frame(reply, m.rows * m.rank, "the server's P_hat")
        if self.implementation == "cupy":
            from kvstore.codecs.powersgd import cuda_kernels  # noqa: PLC0415
            from kvstore.codecs.xp import device_to_host, host_to_device  # noqa: PLC0415

            with self.device:  # (this runs on the transport's thread)
                host_to_device(p_hat, self._p_hat)
                cuda_kernels.back_project(self.error, self._p_hat, self._q, m)
                device_to_host(self._q, self._q_frame)
        elif self.implementation == "numba":
            from kvstore.codecs.powersgd import numba_kernels  # noqa: PLC0415

            np.copyto(self._p_hat, p_hat)
            numba_kernels.back_project(self.error, self._p_hat, m.rows, m.cols, m.rank, self._q)
        else:
            np.copyto(self._p_hat, p_hat)
            matrix = self.error.reshape(m.rows, m.cols)
            q = back_project_reference(matrix, self._p_hat.reshape(m.rows, m.rank))
            self._q[:] = q.ravel()
        self._round = 2
        return [self._q_frame]

    def end_step(self, reply: Payloads) -> None:
        """``e = M - P_hat @ Q_i^T``, and ``Q = Q_sum`` (the server's) for the next step."""
        if self._round != 2:
            raise CodecError("codec 'powersgd': a Q_sum arrived outside a step's last round")
        m = self.matrix
        q_sum = _reply_frame(reply, m.cols * m.rank, "the server's Q_sum")
        if self.implementation == "cupy":
            from kvstore.codecs.powersgd import cuda_kernels  # noqa: PLC0415
            from kvstore.codecs.xp import host_to_device  # noqa: PLC0415

            with self.device:
                cuda_kernels.residual(self.error, self._p_hat, self._q, m)
                host_to_device(q_sum, self.factor)  # (waits for the stream: residual included)
        elif self.implementation == "numba":
            from kvstore.codecs.powersgd import numba_kernels  # noqa: PLC0415

            numba_kernels.residual(self.error, self._p_hat, self._q, m.rows, m.cols, m.rank)
            np.copyto(self.factor, q_sum)
        else:
            approximation = approximation_reference(
                self._p_hat.reshape(m.rows, m.rank), self._q.reshape(m.cols, m.rank)
            )
            self.error -= approximation.ravel()
            np.copyto(self.factor, q_sum)
        self._round = 0

    # checkpoints ------------------------------------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        def host(array: Any) -> np.ndarray:
            return array.get() if is_cupy_array(array) else np.array(array, copy=True)

        return {
            "error": host(self.error),
            "factor": host(self.factor),
            "pushes": np.array(self.pushes, dtype=np.int64),
        }

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        if set(state) != set(self.state_names):
            raise CodecError(
                f"codec 'powersgd' keeps state {sorted(self.state_names)}, got {sorted(state)}"
            )
        pushes = np.asarray(state["pushes"])
        if pushes.shape != () or pushes.dtype.kind not in "iu" or int(pushes) < 0:
            raise CodecError(f"the saved pushes must be an integer >= 0, got {pushes!r}")
        for name in ("error", "factor"):
            own, saved = getattr(self, name), np.asarray(state[name])
            if saved.shape != own.shape or saved.dtype != _FLOAT32:
                raise CodecError(
                    f"codec 'powersgd': {name} is float32{list(own.shape)}, the saved state is "
                    f"{saved.dtype}{list(saved.shape)} (saved with other chunks or rank?)"
                )
        for name in ("error", "factor"):
            own = getattr(self, name)
            if is_cupy_array(own):
                own.set(np.ascontiguousarray(state[name]))
            else:
                np.copyto(own, state[name], casting="no")
        self.pushes = int(pushes)
        self._round = 0


class PowerSGDKeyEncoder(KeyEncoder):
    """The chunks' encoders of one key (compressed or dense), and the once-per-push check of
    the whole value (size, dtype, device; NaN and infinities unless the caller checked)."""

    def __init__(self, numel: int, chunks: Sequence[Encoder], on_gpu: bool) -> None:
        super().__init__(chunks)
        self.numel = numel
        self.on_gpu = on_gpu

    def begin(self, values: Any, *, finite: bool = False) -> None:
        """Check the push's values once, so each chunk's ``encode`` need not.

        Raises:
            CodecError: bad values; no chunk's state was touched.
        """
        check_values(values, self.numel, self.on_gpu, finite)
        for chunk in self.chunks:
            if isinstance(chunk, PowerSGDEncoder):
                chunk.checked = True


# server side ---------------------------------------------------------------------------------

_DENSE, _P, _Q = "dense", "P", "Q"


class PowerSGDAggregator(Aggregator):
    """The server side of one compressed chunk: dense rounds are summed like ``none``; a P
    round sums P (float64) and returns ``P_hat``; the Q round that follows sums Q (float64),
    stores ``P_hat @ Q_sum^T`` and acknowledges with ``Q_sum``. A round's kind is read from
    the size of its first push; every push of the round must have it."""

    def __init__(self, numel: int, matrix: ChunkMatrix) -> None:
        super().__init__(numel, "float32")
        self.matrix = matrix
        self._expect_q = False  # the last round was a P round: this one is its Q round
        self._kind: str | None = None  # the current round's kind
        rows, cols, rank = matrix.rows, matrix.cols, matrix.rank
        self._p_sum = np.zeros(rows * rank, dtype=np.float64)
        self._q_sum = np.zeros(cols * rank, dtype=np.float64)
        self._p_hat = np.zeros(rows * rank, dtype=np.float32)
        self._reply: list[Any] | None = None

    def _sizes(self) -> dict[int, str]:
        m = self.matrix
        if self._expect_q:
            return {4 * m.cols * m.rank: _Q}
        return {4 * self.numel: _DENSE, 4 * m.rows * m.rank: _P}

    def add(self, payloads: Payloads, first: bool) -> None:
        if len(payloads) != 1:
            raise CodecError(f"codec 'powersgd': a push is one frame, got {len(payloads)}")
        raw = frame_array(payloads[0], np.uint8)
        sizes = self._sizes()
        kind = sizes.get(raw.nbytes)
        if kind is None or not (first or kind == self._kind):
            wanted = sizes if first else {n: k for n, k in sizes.items() if k == self._kind}
            described = " or ".join(f"{k} ({n} bytes)" for n, k in wanted.items())
            raise CodecError(
                f"codec 'powersgd': this round of a {self.matrix.rows}x{self.matrix.cols} chunk "
                f"takes {described} pushes, got {raw.nbytes} bytes"
            )
        values = raw.view(np.float32)
        if kind != _DENSE:
            bad = count_nonfinite(values)
            if bad:
                raise CodecError(f"codec 'powersgd': a {kind} factor holds {bad} NaN or infinities")
        self._kind = kind
        target = {_DENSE: self.result, _P: self._p_sum, _Q: self._q_sum}[kind]
        if first:
            np.copyto(target, values)
        else:
            np.add(target, values, out=target)

    def finish(self) -> list[Any] | None:
        kind, self._kind = self._kind, None
        m = self.matrix
        if kind == _P:
            columns = self._p_sum.reshape(m.rows, m.rank).copy()
            orthonormalize(columns)
            self._p_hat[:] = columns.astype(np.float32).ravel()
            self._expect_q = True
            return [self._p_hat]
        if kind == _Q:
            q_sum = self._q_sum.astype(np.float32)
            p_hat = self._p_hat.reshape(m.rows, m.rank)
            self.result[:] = approximation_reference(p_hat, q_sum.reshape(m.cols, m.rank)).ravel()
            self._expect_q = False
            self._reply = [q_sum]
        return None

    def reply_frames(self) -> list[Any] | None:
        reply, self._reply = self._reply, None
        return reply


# the codec ---------------------------------------------------------------------------------


def _integer(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise CodecError(
            f"codec 'powersgd': {name} must be an integer, got {type(value).__name__} {value!r}"
        )
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise CodecError(f"codec 'powersgd': {name} must be {bound}, got {value}")
    return value


class PowerSGDCodec(Codec):
    """PowerSGD with two round trips per step (see the module docstring)."""

    name = "powersgd"
    dtypes = frozenset({"float32"})
    param_defaults = {"rank": 4, "warmup_steps": 0, "seed": 0}
    example_params = ({"rank": 2, "warmup_steps": 1, "seed": 3},)
    round_trips = 2

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.rank = _integer("rank", self._params["rank"], 1)
        self.warmup_steps = _integer("warmup_steps", self._params["warmup_steps"], 0)
        self.seed = _integer("seed", self._params["seed"], 0, _SEED_LIMIT)
        self._params.update(rank=self.rank, warmup_steps=self.warmup_steps, seed=self.seed)
        self._dense = IdentityCodec()

    def payload_nbytes(self, numel: int, dtype: str) -> tuple[int, ...] | None:
        return None  # dense, P or Q: the aggregator, which knows the chunk, checks

    def validate_payloads(self, payloads: Payloads, numel: int, dtype: str) -> None:
        """One frame of whole float32, at most the chunk's dense size (the aggregator checks
        the exact size)."""
        if len(payloads) != 1:
            raise CodecError(f"codec 'powersgd': a push is one frame, got {len(payloads)}")
        nbytes = frame_nbytes(payloads[0])
        if nbytes % 4 or nbytes > 4 * numel:
            raise CodecError(
                f"codec 'powersgd': a push of a {numel}-element chunk is whole float32 of at "
                f"most {4 * numel} bytes, got {nbytes}"
            )

    def chunk_alignment(self, shape: tuple[int, ...]) -> int:
        found = key_matrix(shape, self.rank)
        return 16 if found is None else math.lcm(16, found[1])

    def make_encoder(self, numel: int, dtype: str, device: Any = None) -> Encoder:
        """The encoder of a 1-D key that is one chunk: dense."""
        self.check_dtype(dtype)
        return self._dense.make_encoder(numel, dtype, device)

    def make_key_encoder(
        self,
        key: Any,
        numel: int,
        dtype: str,
        bounds: Sequence[tuple[int, int]],
        device: Any = None,
        *,
        worker: int = 0,
        shape: tuple[int, ...] | None = None,
    ) -> KeyEncoder:
        self.check_dtype(dtype)
        key_hash = stable_key_hash(key)
        factor = None  # the initial factor, drawn if a chunk is compressed
        chunks: list[Encoder] = []
        for start, stop in bounds:
            matrix = chunk_matrix(shape, start, stop - start, self.rank)
            if matrix is None:
                chunks.append(self._dense.make_encoder(stop - start, dtype, device))
                continue
            if factor is None:
                factor = initial_factor(self.seed, key_hash, matrix.cols, matrix.rank)
            chunks.append(PowerSGDEncoder(matrix, self.warmup_steps, factor, device))
        return PowerSGDKeyEncoder(numel, chunks, device is not None)

    def make_aggregator(self, numel: int, dtype: str) -> Aggregator:
        """The aggregator of a 1-D chunk: dense."""
        self.check_dtype(dtype)
        return self._dense.make_aggregator(numel, dtype)

    def make_chunk_aggregator(
        self, numel: int, dtype: str, *, shape: tuple[int, ...], start: int, key: Any = None
    ) -> Aggregator:
        self.check_dtype(dtype)
        matrix = chunk_matrix(shape, start, numel, self.rank)
        if matrix is None:
            return self._dense.make_aggregator(numel, dtype)
        return PowerSGDAggregator(numel, matrix)
