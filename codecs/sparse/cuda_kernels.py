"""CuPy (CUDA) code of the sparse codec family: same indices, values and state, bit for bit, as
the numpy references and the numba kernels (:mod:`kvstore.codecs.sparse` strings them together).

One push of a key, on the device:

* the gradient goes into the state and every element's selection flag is set in one pass
  (``sparse_flag``): a block handles a tile of :data:`TILE` elements (each thread loads its
  eight first, so they are in flight together), each warp's ballot is one 32-bit word of a
  bitmask (bit ``i % 32`` of word ``i // 32``), and the block counts its tile's flags; with a
  sampled threshold, the sample is read first (``sparse_sample``: the same float32 operations
  the pass will do, without writing) and its key selected on the device, so the pass reads the
  threshold from device memory;
* exact top-k (and the sample's threshold) finds the k-th largest magnitude by a three-level
  radix select over the magnitudes' bits (integer histograms, so the counts are exact whatever
  the order of the atomics; after each level one block picks the bin, ``sparse_pick``), then
  flags ``key > T`` and ``key == T`` and keeps the first ``quota`` of the latter;
* the tiles' counts are scanned (``cupy.cumsum``, integers) and their totals come back to the
  host: the one round trip of a push before its payload is copied; a second kernel takes the
  selected elements in ascending order from the bitmasks alone (``sparse_write``): gathers
  their values, zeroes their state and writes their chunk-local uint32 indices;
* random-k evaluates the keyed permutation per index, sorts the ``k`` results and takes them
  (``sparse_take``);
* values and local indices are copied to pinned host buffers (counted as the push's D2H).

Float arithmetic must round exactly like numpy's. NVRTC would contract DGC's ``m*u + g`` into a
fused multiply-add (one rounding instead of two), and CuPy compiles every kernel with
``-ftz=true``, which flushes subnormal inputs and results of float32 operations to zero. So the
kernels are compiled with ``--fmad=false`` and do every float32 add and multiply in explicit
PTX (``add.rn.f32``, ``mul.rn.f32``: no ``.ftz``, never fused); magnitudes are compared by
their bits, never through ``fabsf`` or float comparisons.

Imported only when a CuPy array is encoded; importing it needs CuPy.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import cupy
import numpy as np

from kvstore.codecs.cuda_source import assemble, ieee_ops, read_cu
from kvstore.codecs.sparse import RANDOM, THRESHOLD, Accumulation, Selection, accepted_count
from kvstore.codecs.sparse.dgc import NORM_BLOCK, clip_scale
from kvstore.codecs.xp import device_to_host

TILE_THREADS = 256
_PICK_THREADS = 256  # PICK_THREADS in the source
TILE_ITEMS = 8
TILE = TILE_THREADS * TILE_ITEMS
"""Elements per tile (one block of :func:`_flag_pass`); a multiple of 32."""

_WORDS_PER_TILE = TILE // 32
_NO_KEY = 0xFFFFFFFF  # no magnitude's key (at most 0x7fffffff) equals it
_LEVELS = ((20, 11), (9, 11), (0, 9))  # radix select: (shift, bits) per level

_THREADS = 256


def cuda_source() -> str:
    """The CUDA C of these kernels: the IEEE helpers, then ``sparse.cu``."""
    return assemble(ieee_ops(), read_cu("kvstore.codecs.sparse", "sparse.cu"))


@functools.cache
def _module() -> Any:
    return cupy.RawModule(code=cuda_source(), options=("--std=c++14", "--fmad=false"))


def _kernel(name: str) -> Any:
    return _module().get_function(name)


def _blocks(count: int, threads: int = _THREADS) -> int:
    return max(1, -(-count // threads))


@functools.cache
def _histogram_blocks(device: int) -> int:
    return 4 * cupy.cuda.Device(device).attributes["MultiProcessorCount"]


def _update_args(state: dict, names: tuple, grad: Any, acc: Accumulation) -> tuple:
    """The update arguments every kernel starts with: (kind, a, b, g, m, s, nesterov)."""
    a = state[names[0]]
    x = state[names[-1]]
    dgc = acc.momentum is not None
    scale = np.float32(1)
    if dgc and acc.clip_norm is not None:
        scale = clip_scale(_sum_of_squares(grad), acc.clip_norm)
    return (
        cupy.int32(1 if dgc else 0),
        a,
        x,
        grad,
        cupy.float32(acc.momentum if dgc else 0),
        cupy.float32(scale),
        cupy.int32(1 if acc.nesterov else 0),
    )


def _sum_of_squares(grad: Any) -> float:
    """The float64 sum of squares, exactly as
    :func:`kvstore.codecs.sparse.dgc.sum_of_squares_reference` (blocks summed in order on the
    device, block sums in order on the host)."""
    n = int(grad.size)
    if n == 0:
        return 0.0
    nblocks = -(-n // NORM_BLOCK)
    partials = cupy.empty(nblocks, dtype=cupy.float64)
    _kernel("sparse_block_sumsq")(
        (_blocks(nblocks),),
        (_THREADS,),
        (grad, cupy.int64(n), cupy.int64(NORM_BLOCK), cupy.int64(nblocks), partials),
    )
    return float(np.cumsum(partials.get())[-1])


_BOUNDS_GIVEN, _BOUNDS_SAMPLED, _BOUNDS_EXACT = 0, 1, 2  # as BOUNDS_* in the source


class _Flags(NamedTuple):
    """What :func:`_flag_pass` leaves: the masks, the tiles' counts and running sums (rows:
    "above", "equal"), the totals, and the selected key's quota (exact top-k)."""

    above_mask: Any
    equal_mask: Any
    counts: Any
    ends: Any
    above: int
    equal: int
    quota: int


def _select_key(x: Any, k: int, selected_key: Any) -> None:
    """Leave in ``selected_key`` (int64 [2], device) the key T of the ``k``-th largest
    ``abs(x)`` and how many entries of key T the top ``k`` hold (as
    :func:`kvstore.codecs.sparse.numba_kernels.kth_largest`): three radix levels, each a
    histogram and a one-block pick, all on the device (no host round trip)."""
    n = int(x.size)
    hists = cupy.zeros((len(_LEVELS), 2048), dtype=cupy.uint64)  # one row per level
    grid = min(_blocks(n), _histogram_blocks(x.device.id))
    for level, (shift, bits) in enumerate(_LEVELS):
        first = cupy.int32(level == 0)
        hist = hists[level]
        _kernel("sparse_histogram")(
            (grid,),
            (_THREADS,),
            (
                x,
                cupy.int64(n),
                cupy.uint32(shift + bits),
                selected_key,
                first,
                cupy.uint32(shift),
                cupy.uint32((1 << bits) - 1),
                hist,
            ),
        )
        _kernel("sparse_pick")(
            (1,),
            (_PICK_THREADS,),
            (hist, cupy.int32(1 << bits), cupy.int32(bits), selected_key, first, cupy.int64(k)),
        )


def _flag_pass(
    update: tuple, do_update: bool, x: Any, bounds: int, selected_key: Any, lo: int = 0
) -> _Flags:
    """Flag (and optionally update) every element against ``lo`` (``bounds`` given) or the
    key in ``selected_key``; one host round trip brings back the totals and the quota."""
    n = int(x.size)
    tiles = -(-n // TILE)
    above_mask = cupy.empty(tiles * _WORDS_PER_TILE, dtype=cupy.uint32)
    equal_mask = cupy.empty(tiles * _WORDS_PER_TILE, dtype=cupy.uint32)
    counts = cupy.empty((2, tiles), dtype=cupy.int64)
    _kernel("sparse_flag")(
        (tiles,),
        (TILE_THREADS,),
        (
            *update,
            cupy.int32(1 if do_update else 0),
            x,
            cupy.int64(n),
            cupy.uint32(lo),
            cupy.uint32(_NO_KEY),
            cupy.int32(bounds),
            selected_key,
            above_mask,
            equal_mask,
            counts[0],
            counts[1],
        ),
    )
    ends = cupy.cumsum(counts, axis=1)
    totals = cupy.concatenate((ends[:, -1], selected_key[1:])).get()
    return _Flags(
        above_mask, equal_mask, counts, ends, int(totals[0]), int(totals[1]), int(totals[2])
    )


def _exact_flags(update: tuple, x: Any, k: int, selected_key: Any) -> _Flags:
    """The flags of exact top-k over the already updated ``x``: key > T "above", key == T
    "equal", of which the first ``quota`` are taken (ties: lower index first)."""
    _select_key(x, k, selected_key)
    return _flag_pass(update, False, x, _BOUNDS_EXACT, selected_key)


def _gather(count: int, starts: Any, buffers: Any, launch: Any) -> np.ndarray:
    """Run ``launch(values, local, cuts)``, the kernel that takes the ``count`` selected
    elements (:func:`sparse_take_one`), and copy the values and chunk-local indices to the host
    buffers; returns the chunk cuts (``nchunks + 1``: where each chunk's share of the ascending
    selection starts, then ``count``)."""
    buffers.ensure(count)
    nchunks = int(starts.size)
    cuts = np.zeros(nchunks + 1, dtype=np.int64)
    cuts[1:] = count
    if count == 0:
        return cuts
    values = cupy.empty(count, dtype=cupy.float32)
    local = cupy.empty(count, dtype=cupy.uint32)
    firsts = cupy.full(nchunks, count, dtype=cupy.int64) if nchunks > 1 else starts
    launch(values, local, firsts)
    # through device_to_host, so the copies are counted as the push's D2H, not as its encode
    device_to_host(local, buffers.local[:count])
    device_to_host(values, buffers.values[:count])
    if nchunks > 1:  # a chunk that took nothing starts where the next one does
        device_to_host(firsts, cuts[:nchunks])
        cuts[:nchunks] = np.minimum.accumulate(cuts[:nchunks][::-1])[::-1]
        cuts[0] = 0
    return cuts


def _write_take(
    flags: _Flags, quota: int, x: Any, other: Any, clear_other: bool, starts: Any, buffers: Any
) -> np.ndarray:
    """Take the flagged "above" elements and the first ``quota`` "equal" ones (ascending), as
    :func:`_gather` says."""
    count = flags.above + min(quota, flags.equal)
    tiles = int(flags.counts.shape[1])

    def launch(values: Any, local: Any, firsts: Any) -> None:
        _kernel("sparse_write")(
            (tiles,),
            (_WORDS_PER_TILE,),
            (
                flags.above_mask,
                flags.equal_mask,
                flags.counts,
                flags.ends,
                cupy.int64(tiles),
                cupy.int64(quota),
                x,
                other,
                cupy.int32(1 if clear_other else 0),
                values,
                starts,
                cupy.int32(int(starts.size)),
                local,
                firsts,
            ),
        )

    return _gather(count, starts, buffers, launch)


def _take(
    x: Any, other: Any, clear_other: bool, indices: Any, starts: Any, buffers: Any
) -> np.ndarray:
    """Take ``x[indices]`` (ascending global indices), as :func:`_gather` says."""
    count = int(indices.size)

    def launch(values: Any, local: Any, firsts: Any) -> None:
        _kernel("sparse_take")(
            (_blocks(count),),
            (_THREADS,),
            (
                x,
                other,
                cupy.int32(1 if clear_other else 0),
                indices,
                cupy.int64(count),
                values,
                starts,
                cupy.int32(int(starts.size)),
                local,
                firsts,
            ),
        )

    return _gather(count, starts, buffers, launch)


def scatter_add(out: Any, indices: np.ndarray, values: np.ndarray) -> None:
    """``out[indices] += values`` on the device (``indices`` unique: one push of a relay), with
    IEEE float32 additions (CuPy's own would flush subnormals)."""
    count = int(indices.size)
    if count == 0:
        return
    _kernel("sparse_scatter_add")(
        (_blocks(count),),
        (_THREADS,),
        (out, cupy.asarray(indices), cupy.asarray(values), cupy.int64(count)),
    )


def assign(x: Any, indices: np.ndarray, values: np.ndarray) -> None:
    """``x[indices] = values`` on the device, bit for bit (``indices``: unique int64 global
    indices on the host, ``values`` float32 on the host): ``topk2bit`` writes the quantization
    errors of the selected elements back into the residual with it."""
    count = int(indices.size)
    if count == 0:
        return
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    _kernel("sparse_assign")(
        (_blocks(count),),
        (_THREADS,),
        (x, cupy.asarray(indices, dtype=cupy.int64), cupy.asarray(bits), cupy.int64(count)),
    )


def encode(
    state: dict,
    names: tuple[str, ...],
    grad: Any,
    selection: Selection,
    acc: Accumulation,
    buffers: Any,
    starts: Any,
) -> np.ndarray:
    """One push of a key on the device: update ``state`` (CuPy arrays) with ``grad``, select,
    and put the selection into ``buffers`` (host): chunk-local uint32 indices in ``local``,
    values in ``values``, ascending by global index; ``starts`` are the chunk starts (int64,
    device). Returns the chunk cuts (see :func:`_take`)."""
    n = int(grad.size)
    if n == 0:
        return np.zeros(int(starts.size) + 1, dtype=np.int64)
    update = _update_args(state, names, grad, acc)
    a, x = update[1], update[2]
    dgc = acc.momentum is not None
    selected_key = cupy.zeros(2, dtype=cupy.int64)
    if selection.kind == THRESHOLD:
        lo = int(np.array([selection.threshold], np.float32).view(np.uint32)[0])
        flags = _flag_pass(update, True, x, _BOUNDS_GIVEN, selected_key, lo)
        return _write_take(flags, 0, x, a, dgc, starts, buffers)
    if selection.kind == RANDOM:
        _kernel("sparse_update_all")((_blocks(n),), (_THREADS,), (*update, cupy.int64(n)))
        k = selection.k
        chosen = cupy.empty(k, dtype=cupy.int64)
        _kernel("sparse_permute")(
            (_blocks(k),),
            (_THREADS,),
            (
                cupy.uint64(n),
                cupy.int64(k),
                cupy.uint32(selection.half_bits),
                *(cupy.uint32(key) for key in selection.round_keys),
                chosen,
            ),
        )
        return _take(x, a, dgc, cupy.sort(chosen), starts, buffers)
    k = selection.k
    plan = selection.sample
    if plan is None:
        _kernel("sparse_update_all")((_blocks(n),), (_THREADS,), (*update, cupy.int64(n)))
        flags = _exact_flags(update, x, k, selected_key)
        return _write_take(flags, flags.quota, x, a, dgc, starts, buffers)
    samples = cupy.empty(plan.count, dtype=cupy.float32)
    _kernel("sparse_sample")(
        (_blocks(plan.count),),
        (_THREADS,),
        (
            *update,
            cupy.int64(plan.start),
            cupy.int64(plan.stride),
            cupy.int64(plan.count),
            samples,
        ),
    )
    _select_key(samples, plan.top, selected_key)
    flags = _flag_pass(update, True, x, _BOUNDS_SAMPLED, selected_key)
    if accepted_count(flags.above, k):
        return _write_take(flags, 0, x, a, dgc, starts, buffers)
    # too many or too few: the exact top-k (the same as among the candidates)
    flags = _exact_flags(update, x, k, selected_key)
    return _write_take(flags, flags.quota, x, a, dgc, starts, buffers)


__all__ = ["assign", "encode"]
