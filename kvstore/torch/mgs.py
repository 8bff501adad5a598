"""Merged-gradient sparsification (MGS): which consecutive gradients to push as one bucket.

Pure functions over a cost model; no torch, no sockets. The idea and the algorithm are those of
OMGS-SGD (Shi et al., INFOCOM 2020; ``docs/design.md``, "PyTorch integration"): sending each
layer's sparsified gradient as soon as back-propagation produced it overlaps communication with
computation, but every message pays a start-up latency; merging neighbouring layers into one
buffer saves that latency (and the sparsifier's fixed cost) at the price of waiting for the
later layer's gradient before the merged buffer can be sparsified and sent.

**Indexing.** Everything here is in *backward order*: ``layers[0]`` is the tensor whose gradient
back-propagation produces first (the output layer's), ``layers[-1]`` the last (the input
layer's). A torch wrapper passes its parameters reversed from ``model.parameters()`` (or in the
order its backward hooks fired).

**Cost model** (all times in seconds):

* :class:`Layer` -- ``numel`` elements and ``backward_seconds``, the time back-propagation spends
  on that tensor (profiled or estimated).
* :class:`SparsifyCost` -- encoding ``n`` elements takes ``a_s + b_s * n``.
* :class:`CommCost` -- a message of ``b`` bytes takes ``alpha + beta * b``; a bucket of ``n``
  elements is a message of ``bytes_per_element * n`` bytes (for top-k at density ``rho``, an
  index and a value per element sent: ``8 * rho``, times the workers whose pairs come back where
  the pull returns their union).
* :func:`fit_affine`, :meth:`CommCost.fit`, :meth:`SparsifyCost.fit` -- those constants from
  measured ``(size, seconds)`` pairs, by least squares with non-negative coefficients.

**Timeline** (:func:`simulate`, :func:`timeline`): back-propagation and sparsification share one
stream, so after the last layer of a bucket has its gradient the bucket is sparsified and only
then does the next layer's backward start; a sparsified bucket is sent when it is ready and the
link is free (one message at a time, in bucket order). The result is the time from the start of
back-propagation to the end of the last message (forward pass and optimizer step excluded).

**Plans**, each a list of groups of consecutive layer indices covering ``range(len(layers))`` in
order:

* :func:`no_buckets` -- one bucket per layer;
* :func:`one_bucket` -- everything merged;
* :func:`fixed_buckets` -- close a bucket once it holds at least ``bucket_bytes``;
* :func:`greedy_merge` -- the paper's greedy decision (see its docstring);
* :func:`plan_buckets` -- the greedy plan, unless :func:`simulate` finds no merging or a single
  bucket strictly faster (the greedy rule is local and can lose to either);
* :func:`plan_parameters` -- :func:`plan_buckets` for a model's tensors with a stated cost model
  (:class:`ParameterCosts`): what ``bucket_plan="mgs"`` uses; :func:`planner` plans with
  measured costs instead.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "CommCost",
    "Layer",
    "ParameterCosts",
    "SparsifyCost",
    "Timeline",
    "fit_affine",
    "fixed_buckets",
    "greedy_merge",
    "layers_from",
    "no_buckets",
    "one_bucket",
    "plan_buckets",
    "plan_parameters",
    "planner",
    "simulate",
    "timeline",
]

Groups = list[list[int]]
"""Buckets: lists of consecutive layer indices (backward order) covering every layer once."""

TIE_TOLERANCE = 1e-9
"""Relative margin by which another plan must beat the greedy one in :func:`plan_buckets`:
plans that differ only by the rounding of their sums count as equal."""


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_seconds(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True)
class Layer:
    """One gradient tensor, as the planner sees it.

    Attributes:
        numel: its number of elements (>= 0).
        backward_seconds: the time back-propagation spends producing its gradient (>= 0).
    """

    numel: int
    backward_seconds: float

    def __post_init__(self) -> None:
        if not _is_int(self.numel) or self.numel < 0:
            raise ValueError(f"Layer.numel must be an int >= 0, got {self.numel!r}")
        _check_seconds("Layer.backward_seconds", self.backward_seconds)
        # numpy scalars are accepted; the planner's arithmetic uses Python numbers
        object.__setattr__(self, "numel", int(self.numel))
        object.__setattr__(self, "backward_seconds", float(self.backward_seconds))


def layers_from(numels: Sequence[int], backward_seconds: Sequence[float]) -> list[Layer]:
    """:class:`Layer` objects from parallel lists (both in backward order)."""
    if len(numels) != len(backward_seconds):
        raise ValueError(f"{len(numels)} element counts but {len(backward_seconds)} backward times")
    return [Layer(n, t) for n, t in zip(numels, backward_seconds, strict=True)]


def fit_affine(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """The ``(intercept, slope) >= 0`` minimizing ``sum (intercept + slope * x - y)^2``.

    Measured latencies are noisy, and an unconstrained fit can return a negative start-up time;
    where it does, the best fit on the boundary (through the origin, or flat) is returned
    instead, which is the constrained least-squares solution.

    Raises:
        ValueError: fewer than two distinct sizes, or a size or time that is negative or not
            finite.
    """
    pairs = [(float(x), float(y)) for x, y in points]
    for x, y in pairs:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            raise ValueError(f"sizes and seconds must be finite and >= 0, got ({x!r}, {y!r})")
    if len({x for x, _ in pairs}) < 2:
        raise ValueError(f"a fit needs at least two distinct sizes, got {pairs!r}")
    count = len(pairs)
    mean_x = sum(x for x, _ in pairs) / count
    mean_y = sum(y for _, y in pairs) / count
    sxx = sum((x - mean_x) ** 2 for x, _ in pairs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in pairs)
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    if intercept >= 0 and slope >= 0:
        return intercept, slope

    def squared_error(a: float, b: float) -> float:
        return sum((a + b * x - y) ** 2 for x, y in pairs)

    # The optimum lies on an edge of the feasible quadrant: intercept 0 or slope 0.
    through_origin = max(0.0, sum(x * y for x, y in pairs) / sum(x * x for x, _ in pairs))
    candidates = [(0.0, through_origin), (mean_y, 0.0)]
    return min(candidates, key=lambda ab: squared_error(*ab))


@dataclass(frozen=True)
class CommCost:
    """Time to send one bucket: ``alpha + beta * bytes``, one message at a time.

    Attributes:
        alpha: seconds per message (start-up latency: round trip, request handling).
        beta: seconds per byte (the inverse of the bottleneck link's rate).
        bytes_per_element: bytes a bucket of ``n`` elements puts on that link, per element
            (4 for dense float32; ``8 * rho`` for top-k at density ``rho``).
    """

    alpha: float
    beta: float
    bytes_per_element: float = 4.0

    def __post_init__(self) -> None:
        _check_seconds("CommCost.alpha", self.alpha)
        _check_seconds("CommCost.beta", self.beta)
        b = self.bytes_per_element
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not (0 < b < math.inf):
            raise ValueError(f"CommCost.bytes_per_element must be finite and > 0, got {b!r}")

    def message_seconds(self, nbytes: float) -> float:
        """Seconds to send one message of ``nbytes`` bytes."""
        return self.alpha + self.beta * nbytes

    def seconds(self, numel: int) -> float:
        """Seconds to send one bucket of ``numel`` elements."""
        return self.message_seconds(self.bytes_per_element * numel)

    def merge_saving(self, numel_a: int, numel_b: int) -> float:
        """``seconds(a) + seconds(b) - seconds(a + b)``: one message's start-up, exactly."""
        return self.alpha

    @classmethod
    def fit(
        cls, samples: Iterable[tuple[float, float]], bytes_per_element: float = 4.0
    ) -> CommCost:
        """Fit ``alpha, beta`` to measured ``(message bytes, seconds)`` pairs
        (:func:`fit_affine`)."""
        alpha, beta = fit_affine(samples)
        return cls(alpha, beta, bytes_per_element)

    @classmethod
    def for_link(
        cls, bits_per_second: float, alpha: float, bytes_per_element: float = 4.0
    ) -> CommCost:
        """The model of a link of ``bits_per_second`` with ``alpha`` seconds per message."""
        if not (0 < bits_per_second < math.inf):
            raise ValueError(f"bits_per_second must be finite and > 0, got {bits_per_second!r}")
        return cls(alpha, 8.0 / bits_per_second, bytes_per_element)


@dataclass(frozen=True)
class SparsifyCost:
    """Time to sparsify (encode) one bucket of ``n`` elements: ``a_s + b_s * n``.

    Attributes:
        a_s: seconds per call (launches, the selection's fixed work).
        b_s: seconds per element.
    """

    a_s: float
    b_s: float

    def __post_init__(self) -> None:
        _check_seconds("SparsifyCost.a_s", self.a_s)
        _check_seconds("SparsifyCost.b_s", self.b_s)

    def seconds(self, numel: int) -> float:
        """Seconds to sparsify a bucket of ``numel`` elements."""
        return self.a_s + self.b_s * numel

    def merge_saving(self, numel_a: int, numel_b: int) -> float:
        """``seconds(a) + seconds(b) - seconds(a + b)``: one call's fixed cost, exactly."""
        return self.a_s

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]]) -> SparsifyCost:
        """Fit ``a_s, b_s`` to measured ``(elements, seconds)`` pairs (:func:`fit_affine`)."""
        return cls(*fit_affine(samples))


@dataclass(frozen=True)
class Timeline:
    """When each bucket's work happens (seconds from the start of back-propagation).

    Attributes:
        groups: the buckets, as passed.
        payload_ready: per bucket, when its sparsification ended (it could be sent).
        comm_start: per bucket, when its message started (ready and the link free).
        comm_end: per bucket, when its message ended.
        finish: the end of the last message (0 without layers).
    """

    groups: Groups
    payload_ready: list[float]
    comm_start: list[float]
    comm_end: list[float]
    finish: float

    @property
    def exposed_comm(self) -> float:
        """Communication not hidden behind computation: ``finish`` minus the moment the last
        bucket was ready."""
        return self.finish - self.payload_ready[-1] if self.groups else 0.0


def _check_layers(layers: Sequence[Layer]) -> None:
    for i, layer in enumerate(layers):
        if not isinstance(layer, Layer):
            raise TypeError(f"layers[{i}] must be a Layer, got {type(layer).__name__}")


def _check_groups(groups: Sequence[Sequence[int]], count: int) -> None:
    expected = 0
    for g, group in enumerate(groups):
        if len(group) == 0:
            raise ValueError(f"group {g} is empty")
        for index in group:
            if index != expected:
                raise ValueError(
                    f"groups must list layer indices 0..{count - 1} in order, each once; "
                    f"group {g} has {index!r} where {expected} was due"
                )
            expected += 1
    if expected != count:
        raise ValueError(f"groups cover layers 0..{expected - 1} of 0..{count - 1}")


def timeline(
    layers: Sequence[Layer], groups: Sequence[Sequence[int]], comm: CommCost, sparsify: SparsifyCost
) -> Timeline:
    """The pipeline of one iteration's back-propagation with these buckets.

    In bucket order: the bucket's layers run their backward one after another, then the bucket
    is sparsified on the same stream (the next layer's backward waits for it); its message
    starts at ``max(ready, end of the previous message)``.

    Raises:
        ValueError: ``groups`` are not consecutive indices covering every layer once, in order.
    """
    _check_layers(layers)
    _check_groups(groups, len(layers))
    clock = 0.0  # the compute stream: backward, then sparsify
    link_free = 0.0
    ready, starts, ends = [], [], []
    for group in groups:
        clock += sum(layers[i].backward_seconds for i in group)
        clock += sparsify.seconds(sum(layers[i].numel for i in group))
        start = max(clock, link_free)
        link_free = start + comm.seconds(sum(layers[i].numel for i in group))
        ready.append(clock)
        starts.append(start)
        ends.append(link_free)
    return Timeline([list(g) for g in groups], ready, starts, ends, link_free)


def simulate(
    layers: Sequence[Layer], groups: Sequence[Sequence[int]], comm: CommCost, sparsify: SparsifyCost
) -> float:
    """Seconds from the start of back-propagation until the last bucket was sent
    (:func:`timeline`'s ``finish``)."""
    return timeline(layers, groups, comm, sparsify).finish


def no_buckets(layers: Sequence[Layer]) -> Groups:
    """One bucket per layer."""
    return [[i] for i in range(len(layers))]


def one_bucket(layers: Sequence[Layer]) -> Groups:
    """All layers in one bucket (none without layers)."""
    return [list(range(len(layers)))] if layers else []


def fixed_buckets(layers: Sequence[Layer], bucket_bytes: int, itemsize: int = 4) -> Groups:
    """Buckets filled in backward order and closed once they hold ``bucket_bytes`` or more
    (``numel * itemsize`` bytes per layer), like DDP's ``bucket_cap_mb``; the last bucket
    takes what is left.

    Raises:
        ValueError: ``bucket_bytes`` or ``itemsize`` is not a positive integer.
    """
    for name, value in (("bucket_bytes", bucket_bytes), ("itemsize", itemsize)):
        if not _is_int(value) or value <= 0:
            raise ValueError(f"{name} must be an int > 0, got {value!r}")
    _check_layers(layers)
    groups: Groups = []
    current: list[int] = []
    held = 0
    for i, layer in enumerate(layers):
        current.append(i)
        held += layer.numel * itemsize
        if held >= bucket_bytes:
            groups.append(current)
            current, held = [], 0
    if current:
        groups.append(current)
    return groups


def greedy_merge(layers: Sequence[Layer], comm: CommCost, sparsify: SparsifyCost) -> Groups:
    """The paper's greedy merge decision, from the output layer towards the input.

    The open bucket ``G`` starts as layer 0. At each boundary between ``G`` (whose last layer
    is ``i``) and layer ``i + 1``, with ``n_G`` and ``n`` their element counts and ``slack`` the
    time ``G``'s sparsified payload would wait for the link anyway (its message start minus its
    ready time, on the timeline of the buckets decided so far)::

        t_wait = backward(i + 1) + t_s(n_G + n) - t_s(n_G) - t_s(n) - slack
        t_save = t_c(n_G) + t_c(n) - t_c(n_G + n)
        merge layer i + 1 into G  if  t_wait < t_save,  else close G and open {i + 1}

    Two deliberate differences from the authors' released code: every boundary is decided
    (their loop starts one layer late, so the output layer and the next are always fused),
    and a merge that saves nothing at all (``t_save`` and the sparsifier's saving both 0: no
    start-up latency, no fixed sparsifier cost) is never taken, since it can only make a
    payload later.
    """
    _check_layers(layers)
    if not layers:
        return []
    groups: Groups = []
    group = [0]
    group_numel = layers[0].numel
    clock = layers[0].backward_seconds  # the compute stream, at the open group's last backward
    link_free = 0.0  # when the closed groups' messages are all sent
    for nxt in range(1, len(layers)):
        layer = layers[nxt]
        ready = clock + sparsify.seconds(group_numel)
        slack = max(0.0, link_free - ready)
        sparsify_saving = sparsify.merge_saving(group_numel, layer.numel)
        comm_saving = comm.merge_saving(group_numel, layer.numel)
        t_wait = layer.backward_seconds - sparsify_saving - slack
        if t_wait < comm_saving and comm_saving + sparsify_saving > 0:
            group.append(nxt)
            group_numel += layer.numel
            clock += layer.backward_seconds
            continue
        groups.append(group)
        link_free = max(ready, link_free) + comm.seconds(group_numel)
        group, group_numel = [nxt], layer.numel
        clock = ready + layer.backward_seconds
    groups.append(group)
    return groups


def plan_buckets(layers: Sequence[Layer], comm: CommCost, sparsify: SparsifyCost) -> Groups:
    """Buckets for merged-gradient sparsification (``bucket_plan="mgs"``).

    Args:
        layers: the gradients in backward order (``layers[0]`` is produced first), each with its
            element count and backward time.
        comm: the message cost model of the bucket's push and pull.
        sparsify: the encode cost model.

    Returns:
        Groups of consecutive indices into ``layers`` covering all of them in order; each group
        is pushed as one key. Empty for no layers.

    The plan is :func:`greedy_merge`'s, unless :func:`simulate` predicts that one bucket per
    layer or a single bucket finishes sooner (by more than :data:`TIE_TOLERANCE`): then that
    one. So the predicted time is never above either.
    """
    best = greedy_merge(layers, comm, sparsify)
    best_seconds = simulate(layers, best, comm, sparsify)
    for other in (no_buckets(layers), one_bucket(layers)):
        seconds = simulate(layers, other, comm, sparsify)
        if seconds < best_seconds * (1 - TIE_TOLERANCE):
            best, best_seconds = other, seconds
    return best


# planning a model's parameters ------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterCosts:
    """The cost model that plans a model's parameters (``bucket_plan="mgs"``).

    The defaults are stated constants, not measurements of the running job, so that every rank
    plans the same buckets (the keys must agree across workers): a 1 Gbit/s link with 0.52 ms
    per message (0.42 ms of per-chunk CPU on worker and server, the cost of a chunk in
    ``docs/performance.md``, plus a 0.1 ms round trip) carrying dense float32 pulls; the numba
    ``topk`` encode fitted on the 2-core development machine (13.5 us + 0.45 ns per element,
    ``python -m benchmarks.mgs_plan``); and back-propagation at 2.35 ns per element (ResNet-50's
    60 ms over its 25.6M parameters). Give measured ones with :func:`planner`.

    Attributes:
        comm: the message cost.
        sparsify: the encode cost.
        backward_seconds_per_element: a parameter's backward time per element.
    """

    comm: CommCost = CommCost.for_link(1e9, 0.52e-3)
    sparsify: SparsifyCost = SparsifyCost(13.5e-6, 0.45e-9)
    backward_seconds_per_element: float = 2.35e-9

    def __post_init__(self) -> None:
        _check_seconds("backward_seconds_per_element", self.backward_seconds_per_element)


def plan_parameters(params: Sequence[object], costs: ParameterCosts | None = None) -> Groups:
    """:func:`plan_buckets` for tensors in backward order (anything with ``numel()``), each a
    layer whose backward time is proportional to its elements; the planner protocol of
    ``kvstore.torch.DistributedOptimizer``'s ``bucket_plan``."""
    costs = ParameterCosts() if costs is None else costs
    numels = [int(p.numel()) for p in params]  # type: ignore[attr-defined]
    per_element = costs.backward_seconds_per_element
    layers = layers_from(numels, [n * per_element for n in numels])
    return plan_buckets(layers, costs.comm, costs.sparsify)


def planner(costs: ParameterCosts) -> Callable[[Sequence[object]], Groups]:
    """A ``bucket_plan`` that plans with ``costs`` (e.g. fitted with :meth:`CommCost.fit` and
    :meth:`SparsifyCost.fit` from measurements; use the same on every rank)."""

    def plan(params: Sequence[object]) -> Groups:
        return plan_parameters(params, costs)

    return plan
