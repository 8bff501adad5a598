"""The ``sketch`` codec: count sketches of the gradient, summed by the servers without decoding.

FetchSGD (Rothchild et al., ICML 2020), with Sketched-SGD's exact second round (Ivkin et al.,
NeurIPS 2019) as an option. A count sketch is linear: the sum of the workers' sketches is the
sketch of their summed gradients, so a server adds ``rows x columns`` tables as they arrive
and decodes nothing per push. The arithmetic of the sketch itself (hashes keyed by ``(seed,
key, row)``, an integer fixed-point sum that no order of additions changes, median estimates)
is :mod:`kvstore.codecs.sketch.hashing`.

**Sizes, per chunk.** A key's chunks live on different servers, so each chunk has a sketch of
its own and its server recovers that chunk's share of ``k`` (``columns`` and ``k`` are cut in
proportion to the chunk's elements): recovering an element needs its bucket in every row, and
a sketch of a whole key would need every server to see every row. ``columns`` and ``k`` are
counts per key (ints) or fractions of the key's elements (floats in ``(0, 1]``)::

    share(v, n_c) = ceil(v * n_c / n)   for an int v        (n: the key's elements)
                    ceil(v * n_c)       for a fraction v     (n_c: the chunk's)
    columns_c = max(64, share(columns, n_c));   k_c = min(n_c, max(1, share(k, n_c)))

A chunk whose sketch would not be smaller than its values (``rows * columns_c >= n_c``: small
keys such as biases) sends its values instead, and its server keeps the same state dense: what
a sketch with enough columns recovers exactly. (Updating such a chunk whole instead of its
``k_c`` largest made FetchSGD diverge on the MNIST CNN at 50x: the chunks it recovers k-sparse
lag behind a whole-updated bias.)

**FetchSGD** (``exact: false``, the default). Workers keep no state: a push is the sketch of the
gradient. Per round the server sums the N sketches into ``S`` and, with ``rho`` the codec's
``momentum`` and ``eta`` the server SGD's ``learning_rate * rescale_grad`` (1 without an
optimizer), all in float32 on ``rows x columns_c`` tables::

    S_u = rho * S_u + S                           (momentum, in sketch space)
    S_e = S_e + eta * S_u                         (error accumulation, in sketch space)
    est = estimates(S_e);  U = the k_c largest abs(est) (ties: lower index first)
    delta[U] = est[U], 0 elsewhere                (the round's k-sparse update)
    zero the buckets of U, in every row, of S_u and S_e

``delta`` is the round's value without a server optimizer (pulled as ``(index, value)`` pairs
instead of the dense value: a relayed pull of one push); with the server ``sgd``
(``momentum=0``), whose learning rate is already in ``S_e``, the weights move by
``w = (1 - lr * wd) * w - delta``. Zeroing the buckets rather than subtracting the sketch of
``delta`` is what the FetchSGD authors' code does (subtracting diverged for them); it also drops
what other elements had accumulated in those buckets.

**Exact** (``exact: true``): Sketched-SGD's protocol, two round trips per step. An exact value
of an accumulated vector exists only where it is kept, so here each worker keeps its momentum
``u`` and error ``v`` (dense, float32) and the server keeps nothing between steps::

    worker:  u = rho * u + g;  v = v + u;  push sketch(v)
    server:  C = the min(n_c, 2 k_c) largest abs(estimates(sum of the sketches)), ascending;
             reply C
    worker:  push v[C]
    server:  U = the k_c largest abs(sum of v[C]) among C;  delta[U] = that sum, 0 elsewhere;
             acknowledge with U
    worker:  u[U] = 0;  v[U] = 0

A chunk sent dense takes both trips too (its first push is ``v`` itself, and the candidates are
exact): the second trip's acknowledgement is what tells the workers where to zero. Its
``delta`` is applied like any round's gradient (a server optimizer without momentum: the
workers already apply it).

**Payload**: one float32 frame, the ``rows x columns_c`` table (row after row), or the chunk's
values when it is sent dense; the exact round's second push is ``v[C]`` (float32). The server
checks the size and that every value is finite before anything is touched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.codecs.base import Codec, Encoder, KeyEncoder, seed_param, server_momentum
from kvstore.codecs.counter_rng import stable_key_hash
from kvstore.codecs.sketch.hashing import MAX_ROWS, row_keys
from kvstore.codecs.sparse import ceil_ratio, sum_relay
from kvstore.errors import CodecError

Size = int | float
"""A count per key (int) or a fraction of the key's elements (float in (0, 1])."""

MIN_COLUMNS = 64
"""The fewest buckets per row a chunk is sketched in: an estimate's error is about the norm of
what shares its bucket, so a narrower sketch recovers nothing of use (a 10-element bias in one
bucket per row would be updated by the sum of all its gradients)."""

MAX_KEY_ELEMENTS = 1 << 32
"""Elements are hashed by their index in the key, a 32-bit word."""


def _size_param(name: str, value: Any) -> Size:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise CodecError(
            f"codec 'sketch': {name} must be a count (int >= 1) or a fraction of the key's "
            f"elements (float in (0, 1]), got {value!r}"
        )
    if isinstance(value, int | np.integer):
        if value < 1:
            raise CodecError(f"codec 'sketch': {name} must be at least 1, got {value!r}")
        return int(value)
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise CodecError(
            f"codec 'sketch': {name} as a fraction must be in (0, 1], got {value!r} (an int is "
            f"a count)"
        )
    return value


def share(size: Size, chunk_numel: int, key_numel: int) -> int:
    """A chunk's share of a per-key size (module docstring), at least 1."""
    if isinstance(size, int):
        count = -(-size * chunk_numel // max(1, key_numel))
    else:
        count = ceil_ratio(size, chunk_numel)
    return max(1, count)


@dataclass(frozen=True)
class ChunkPlan:
    """The sizes of one chunk's sketch.

    Attributes:
        start: the chunk's first element in the key (what the hashes index by).
        numel: the chunk's elements.
        rows, columns: the table's shape.
        k: the elements a round recovers.
        candidates: the elements the exact round asks for (``min(numel, 2 k)``).
        dense: the chunk travels as its values (a sketch would not be smaller).
    """

    start: int
    numel: int
    rows: int
    columns: int
    k: int
    candidates: int
    dense: bool

    @property
    def pushed(self) -> int:
        """float32 values in a first-round push."""
        return self.numel if self.dense else self.rows * self.columns


class SketchCodec(Codec):
    """Count-sketch compression with server-side momentum and error feedback (module docstring).

    Args:
        rows: hash rows (odd, 1-15; 5 by default).
        columns: buckets per row: a count per key, or a fraction of its elements.
        k: elements recovered per round: a count per key, or a fraction of its elements.
        momentum: ``rho`` (in ``[0, 1)``).
        seed: keys the hashes, with the key and the row.
        exact: Sketched-SGD's second round trip (workers keep momentum and error).
    """

    name = "sketch"
    dtypes = frozenset({"float32"})
    param_defaults = {
        "rows": 5,
        "columns": 0.02,
        "k": 0.002,
        "momentum": 0.9,
        "seed": 0,
        "exact": False,
    }
    example_params = (
        {},
        {"rows": 3, "columns": 40, "k": 9, "momentum": 0.0, "seed": 7},
        {"rows": 1, "columns": 0.5, "k": 0.3, "exact": True},
        {"exact": True, "momentum": 0.5},
    )
    relayable = True
    relays_round_result = True

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        p = self._params
        rows = p["rows"]
        if isinstance(rows, bool) or not isinstance(rows, int | np.integer):
            raise CodecError(f"codec 'sketch': rows must be an odd int, got {rows!r}")
        if not (1 <= rows <= MAX_ROWS and rows % 2 == 1):
            raise CodecError(
                f"codec 'sketch': rows must be odd and in [1, {MAX_ROWS}] (the median of the "
                f"rows' estimates is then one of them), got {rows!r}"
            )
        self.rows = int(rows)
        self.columns = _size_param("columns", p["columns"])
        self.k = _size_param("k", p["k"])
        momentum = p["momentum"]
        if isinstance(momentum, bool) or not isinstance(momentum, int | float):
            raise CodecError(f"codec 'sketch': momentum must be a number, got {momentum!r}")
        if not 0.0 <= float(momentum) < 1.0:
            raise CodecError(f"codec 'sketch': momentum must be in [0, 1), got {momentum!r}")
        self.momentum = np.float32(momentum)
        self.seed = seed_param(self.name, p["seed"])
        if not isinstance(p["exact"], bool):
            raise CodecError(f"codec 'sketch': exact must be true or false, got {p['exact']!r}")
        self.exact = p["exact"]
        self.round_trips = 2 if self.exact else 1
        # FetchSGD puts the server SGD's learning rate into its error sketch; the exact round's
        # workers keep their own error, which the server cannot scale.
        self.applies_step_size = not self.exact

    # sizes ------------------------------------------------------------------------------------

    def plan(self, start: int, numel: int, key_numel: int) -> ChunkPlan:
        """The sketch of the chunk ``[start, start + numel)`` of a ``key_numel``-element key."""
        if key_numel > MAX_KEY_ELEMENTS:
            raise CodecError(
                f"codec 'sketch' hashes elements by a 32-bit index: a key of {key_numel} "
                f"elements is too large"
            )
        columns = max(MIN_COLUMNS, share(self.columns, numel, key_numel))
        dense = self.rows * columns >= numel
        k = min(numel, share(self.k, numel, key_numel))
        return ChunkPlan(
            start=start,
            numel=numel,
            rows=self.rows,
            columns=columns,
            k=k,
            candidates=min(numel, 2 * k),
            dense=dense,
        )

    def row_keys(self, key: Any) -> np.ndarray:
        """The rows' hash keys of ``key`` (``(rows, 2)`` uint32)."""
        return row_keys(self.seed, stable_key_hash(key), self.rows)

    def payload_nbytes(self, numel: int, dtype: str) -> tuple[int, ...] | None:
        return None  # the table's size depends on the key's size: the aggregator checks it

    def pushed_fraction(self, numel: int, dtype: str) -> float:
        plan = self.plan(0, numel, numel)
        return plan.pushed / max(1, numel)

    # parts -------------------------------------------------------------------------------------

    def make_encoder(self, numel: int, dtype: str, device: Any = None) -> Encoder:
        """An encoder of a key that is one chunk (no key identity: its hash is 0)."""
        return self.make_key_encoder(None, numel, dtype, [(0, numel)], device).chunks[0]

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
        from kvstore.codecs.sketch.encoder import SketchEncoder  # noqa: PLC0415 (cycle)

        self.check_dtype(dtype)
        keys = self.row_keys(key)
        return KeyEncoder(
            [
                SketchEncoder(self, self.plan(start, stop - start, numel), keys, device)
                for start, stop in bounds
            ]
        )

    def make_aggregator(self, numel: int, dtype: str) -> Any:
        return self.make_chunk_aggregator(numel, dtype, shape=(numel,), start=0)

    def make_chunk_aggregator(
        self, numel: int, dtype: str, *, shape: tuple[int, ...], start: int, key: Any = None
    ) -> Any:
        from kvstore.codecs.sketch.aggregator import SketchAggregator  # noqa: PLC0415 (cycle)

        self.check_dtype(dtype)
        key_numel = math.prod(shape)
        return SketchAggregator(self, self.plan(start, numel, key_numel), self.row_keys(key))

    # server optimizer and pulls ---------------------------------------------------------------

    def check_optimizer(self, name: str, params: Mapping[str, Any]) -> None:
        if self.exact:
            momentum = server_momentum(name, params)
            if momentum is not None:
                raise CodecError(
                    f"codec 'sketch' with exact=true keeps momentum on the workers, and the "
                    f"server optimizer {name!r} with {momentum}={params[momentum]} would apply "
                    f"it again: set {momentum}=0 for the server optimizer"
                )
            return
        if name != "sgd":
            raise CodecError(
                f"codec 'sketch' keeps momentum and error feedback in sketch space on the "
                f"servers and needs the server optimizer 'sgd' (or none), got {name!r}"
            )
        if float(params.get("momentum", 0.0) or 0.0) > 0 or params.get("nesterov"):
            raise CodecError(
                "codec 'sketch' applies momentum in sketch space (its own 'momentum'): set the "
                "server sgd's momentum=0 and nesterov=false"
            )
        if params.get("clip_gradient") is not None:
            raise CodecError(
                "codec 'sketch': the server cannot clip a gradient it only holds as a sketch; "
                "set clip_gradient=None (clip on the workers before pushing)"
            )

    def sum_relay(self, pushes: Sequence[Any], numel: int, dtype: str, out: Any) -> None:
        """A relayed pull of a sketch key is one push: the round's ``(indices, values)``."""
        self.check_dtype(dtype)
        if len(pushes) != 1:
            raise CodecError(f"a relayed sketch round is one push, got {len(pushes)}")
        sum_relay(pushes, numel, dtype, out, self.name)


__all__ = ["ChunkPlan", "SketchCodec", "share"]
