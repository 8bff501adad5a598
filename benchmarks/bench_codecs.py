"""Codec kernels against one numpy ``a += b`` pass over the same array, in the same run.

Prints one JSON line per measurement. Each kernel is timed interleaved with the baseline
(single thread, median of ``--repeats``), and reported as a ratio to it, next to the bytes it
must move (its memory floor):

* ``a += b``: reads 8 bytes and writes 4 per element (12 B/element);
* 2-bit encode with residual: reads grad and residual, writes residual and 1/4 byte of codes
  (12.25 B/element: floor ratio 1.02);
* 2-bit decode-and-accumulate: reads 1/4 byte of codes, reads and writes the fp32 sum
  (8.25 B/element: floor ratio 0.69);
* the check a push makes for NaN and infinities (``kvstore.codecs.finite``): reads 4
  B/element (floor ratio 0.33), next to the copy a dense push makes (8 B/element).
* the sparse codecs' encode of a whole key (``begin`` + the chunk's payload, after the
  client's NaN check): read gradient and residual, write the residual (12 B/element, floor
  ratio 1.0; DGC's momentum and velocity 20 B/element); ``topk`` sampled (the default) and
  exact, ``threshold``, ``randomk``, ``dgc``;
* the server's round of 8 workers' 0.1% ``topk`` pushes into one accumulator (zero it, then
  scatter-add each; validation included): its floor is the zeroing, 4 B/element (0.33);
* the quantizing codecs (``1bit``, ``efsign``, ``terngrad``, ``qsgd``, ``fp16``, ``bf16``):
  the encode of a chunk with its state update, and the server's decode-and-accumulate of one
  push, each next to its memory floor (:data:`QUANTIZER_CASES`);
* the ``sketch`` codec (count sketches, 10x, 50x and 100x smaller than the values): the
  worker's sketch against its memory floor (read the values, write the table), the server's
  sum of a push (an add of ``rows x columns`` floats, no decode) against ``a += b`` of that
  many floats, its unsketch of a round (and the share of it in the estimates), and its CPU for
  a round of 8 pushes against ``topk``'s decode-then-sum of pushes of the same bytes
  (:func:`bench_sketch`);
* ``powersgd``'s worker side of a step of a 4096 x 4096 key at rank 4, against one numpy
  float32 matmul of the same shapes (``M @ Q``).

It also times the server-side decode/aggregate of one round (the real ``Aggregator`` objects,
one per partition) on 1, 2, 4... threads, which scales because the kernels release the GIL.
With ``--gpu`` (CuPy and a device needed) it times the CuPy kernels at 100M elements against a
device-to-device copy of the same bytes (bytes read + written; the sketch against a read of its
values), and trains the MNIST example with 2 workers (each a process on the one GPU) x 2 servers
through :mod:`benchmarks.convergence`, with CUDA tensors and, as the baseline in the same run, on
the CPU: MLP and CNN, dense and 2-bit. Each
training line has the final test accuracy and worker 0's per-step milliseconds of encode (the
kernels), device-to-host copy, wire (waiting for the servers' replies) and host-to-device copy.

    python -m benchmarks.bench_codecs --preset smoke
    python -m benchmarks.bench_codecs --preset full
    python -m benchmarks.bench_codecs --preset full --gpu --gpu-only   # the GPU sections alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Every kernel here is timed on one thread; BLAS reads its thread count once, when numpy (which
# the imports below load) is first imported, so it is set before them.
for _blas_threads in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_blas_threads, "1")

import numpy as np  # noqa: E402  (after the thread counts above)

from benchmarks.common import REPO, emit, interleaved_medians, machine, module_command  # noqa: E402
from kvstore.codecs import get_codec, twobit  # noqa: E402
from kvstore.codecs.finite import count_nonfinite  # noqa: E402

PRESETS = {
    "smoke": {
        "elements": 1 << 20,
        "repeats": 5,
        "threads": [1, 2],
        "partitions": 8,
        "sketch_repeats": 5,
    },
    "full": {
        "elements": 16 << 20,
        "repeats": 21,
        "threads": [1, 2, 4],
        "partitions": 16,
        "sketch_repeats": 7,
    },
}
"""Array sizes and repeat counts. The sketch's unsketch reads ``rows`` buckets per element (a
second or more at the full size), so its section repeats fewer times."""


def bench_kernels(n: int, repeats: int) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    grad = rng.standard_normal(n).astype(np.float32)
    residual = np.zeros(n, np.float32)
    words = np.empty(twobit.packed_words(n), np.uint32)
    acc = np.zeros(n, np.float32)
    t = np.float32(0.5)
    enc_numba, dec_numba = twobit.cpu_kernels("numba")
    enc_numpy, dec_numpy = twobit.cpu_kernels("numpy")
    enc_numba(grad, residual, t, words)  # compile (or load the cache) outside the timing
    dec_numba(words, n, t, acc, True)
    count_nonfinite(grad, kernels="numba")
    copy = np.empty_like(grad)
    cases = {
        "a += b (numpy)": (lambda: np.add(a, b, out=a), 12.0),
        "2bit encode (numba)": (lambda: enc_numba(grad, residual, t, words), 12.25),
        "2bit decode+accumulate (numba)": (lambda: dec_numba(words, n, t, acc, True), 8.25),
        "2bit decode (numba)": (lambda: dec_numba(words, n, t, acc, False), 4.25),
        "nonfinite check (numba)": (lambda: count_nonfinite(grad, kernels="numba"), 4.0),
        "dense push copy (numpy)": (lambda: np.copyto(copy, grad, casting="no"), 8.0),
    }
    if n <= 1 << 22:  # the numpy reference is slow; keep the smoke run short
        cases["2bit encode (numpy reference)"] = (
            lambda: enc_numpy(grad, residual, t, words),
            12.25,
        )
        cases["2bit decode+accumulate (numpy reference)"] = (
            lambda: dec_numpy(words, n, t, acc, True),
            8.25,
        )
    medians = interleaved_medians({name: fn for name, (fn, _) in cases.items()}, repeats)
    base = medians["a += b (numpy)"]
    for name, (_, bytes_per_element) in cases.items():
        seconds = medians[name]
        emit(
            {
                "bench": "codecs",
                "op": name,
                "elements": n,
                "seconds": round(seconds, 6),
                "ratio_to_add": round(seconds / base, 3),
                "floor_ratio": round(bytes_per_element / 12.0, 3),
                "gbytes_per_s": round(bytes_per_element * n / seconds / 1e9, 2),
                "threads": 1,
            }
        )


SPARSE_CASES = {
    "topk sampled": ({"type": "topk", "ratio": 0.01}, 12.0),
    "topk exact": ({"type": "topk", "ratio": 0.01, "sample": 0}, 12.0),
    "threshold": ({"type": "threshold", "threshold": 2.5}, 12.0),
    "randomk": ({"type": "randomk", "ratio": 0.01}, 12.0),
    "dgc": ({"type": "dgc", "ratio": 0.001}, 20.0),
}
"""Sparse codecs timed on the CPU, with their memory floor in bytes per element. The
threshold 2.5 sends about 1.2% of standard-normal gradients."""


def bench_sparse(n: int, repeats: int) -> None:
    """The sparse codecs' CPU encode of one ``n``-element key and the server's scatter-add of
    a round, against ``a += b`` over the same array, interleaved."""
    from kvstore.codecs import codec_from_spec

    rng = np.random.default_rng(2)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    cases: dict[str, Any] = {"a += b (numpy)": lambda: np.add(a, b, out=a)}
    floors = {"a += b (numpy)": 12.0}
    for label, (spec, bytes_per_element) in SPARSE_CASES.items():
        encoder = codec_from_spec(spec).make_key_encoder("bench", n, "float32", [(0, n)])
        pushes = iter(range(1 << 62))

        def encode(encoder: Any = encoder, pushes: Any = pushes) -> None:
            encoder.begin(grads[next(pushes) % 2], finite=True)  # the client checked them
            encoder.chunks[0].encode(None)

        cases[f"{label} encode (numba)"] = encode
        floors[f"{label} encode (numba)"] = bytes_per_element
    codec = codec_from_spec({"type": "topk", "ratio": 0.001})
    aggregator = codec.make_aggregator(n, "float32")
    payloads = []
    for _ in range(8):
        indices = np.sort(rng.choice(n, n // 1000, replace=False)).astype(np.uint32)
        payloads.append([indices, rng.standard_normal(indices.size).astype(np.float32)])

    def server_round() -> None:
        for i, payload in enumerate(payloads):
            aggregator.add(payload, first=i == 0)
        aggregator.finish()

    cases["server scatter-add round, 8 x 0.1% (numba)"] = server_round
    floors["server scatter-add round, 8 x 0.1% (numba)"] = 4.0
    medians = interleaved_medians(cases, repeats)
    base = medians["a += b (numpy)"]
    for name, seconds in medians.items():
        if name == "a += b (numpy)":
            continue
        emit({"bench": "codecs", "op": name, "elements": n, "seconds": round(seconds, 6),
              "ratio_to_add": round(seconds / base, 3),
              "floor_ratio": round(floors[name] / 12.0, 3), "threads": 1})  # fmt: skip


SKETCH_COLUMNS = (0.02, 0.004, 0.002)
"""The sketch widths timed (``columns``, a fraction of the key's elements): with 5 rows (the
default) a push is 10x, 50x and 100x smaller than the dense values."""

SKETCH_WORKERS = 8
"""Pushes per server round in the sketch-against-topk comparison."""


def bench_sketch(n: int, repeats: int, rows: int = 5) -> None:
    """The ``sketch`` codec on the CPU at each width of :data:`SKETCH_COLUMNS`, against ``a +=
    b`` over ``n`` float32 timed in the same run (all interleaved):

    * the worker's sketch of an ``n``-element key (the chunk encoder, as the client calls it):
      its memory floor is a read of the values and a write of the table, ``4 + 4 * rows *
      columns / n`` bytes per element (the kernel also reads the values once for their peak);
    * the server's sum of one push (``add``: no decode, the size and finiteness checks and an
      add of ``rows x columns`` floats), also against ``a += b`` of that many floats (floor
      16 bytes per table float: the check reads it, the add reads two and writes one);
    * the server's unsketch of a round (``finish``: FetchSGD's momentum and error update, the
      ``n x rows`` reads of the estimates, the top-k, the bucket zeroing) and the share of it
      that the estimates alone take;
    * the server's CPU for a round of :data:`SKETCH_WORKERS` pushes (``add`` each, then
      ``finish``) against ``topk``'s decode-then-sum round of pushes of the same bytes (a
      ``topk`` element is 8 bytes: ``ratio = 4 * rows * columns / (8 * n)``).
    """
    from kvstore.codecs import codec_from_spec
    from kvstore.codecs.sketch import SketchCodec
    from kvstore.codecs.sketch import kernels as sketch_kernels

    rng = np.random.default_rng(5)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(SKETCH_WORKERS)]
    cases: dict[str, Any] = {"a += b (numpy)": lambda: np.add(a, b, out=a)}
    fields: dict[str, dict[str, Any]] = {}
    labels = []
    for columns in SKETCH_COLUMNS:
        codec = SketchCodec(rows=rows, columns=columns)
        plan = codec.plan(0, n, n)
        if plan.dense:  # too few elements for a sketch this wide to be smaller than the values
            continue
        label = f"sketch rows={rows} columns={columns}"
        labels.append(label)
        table_floats = plan.rows * plan.columns
        encoder = codec.make_key_encoder("bench", n, "float32", [(0, n)])
        # (the first encode compiles the kernels, or loads their cache, outside the timing)
        pushes = [[np.array(encoder.chunks[0].encode(grad)[0], copy=True)] for grad in grads]
        pushed = iter(range(1 << 62))

        def encode(encoder: Any = encoder, pushed: Any = pushed) -> None:
            grad = grads[next(pushed) % 2]
            encoder.begin(grad, finite=True)  # the client checked them
            encoder.chunks[0].encode(grad)

        aggregator = codec.make_aggregator(n, "float32")
        aggregator.add(pushes[0], first=True)
        aggregator.finish()
        round_aggregator = codec.make_aggregator(n, "float32")
        table_a = rng.standard_normal(table_floats).astype(np.float32)
        table_b = rng.standard_normal(table_floats).astype(np.float32)

        def add(aggregator: Any = aggregator, push: Any = pushes[1]) -> None:
            aggregator.add(push, first=False)

        keys = codec.row_keys(None)  # the hashes of make_aggregator's chunk (no key)

        def estimates(aggregator: Any = aggregator, keys: Any = keys) -> None:
            sketch_kernels.estimates(aggregator.error, keys, 0, n)

        # topk pushes of the same bytes: 8 bytes (a uint32 index, a float32 value) per element
        ratio = 4 * table_floats / (8 * n)
        topk = codec_from_spec({"type": "topk", "ratio": ratio, "sample": 0})
        topk_encoder = topk.make_key_encoder("bench", n, "float32", [(0, n)])
        topk_aggregator = topk.make_aggregator(n, "float32")
        topk_pushes = []
        for grad in grads:
            topk_encoder.begin(grad, finite=True)
            topk_pushes.append([np.array(f) for f in topk_encoder.chunks[0].encode(None)])

        def server_round(aggregator: Any, pushes: list[Any]) -> None:
            for i, push in enumerate(pushes):
                aggregator.add(push, first=i == 0)
            aggregator.finish()

        common = {"rows": plan.rows, "columns": plan.columns, "k": plan.k,
                  "compression": round(n / table_floats, 1)}  # fmt: skip
        parts: dict[str, tuple[Any, dict[str, Any]]] = {
            "encode": (encode, {"floor_ratio": round((4 + 4 * table_floats / n) / 12, 3)}),
            "server add": (add, {}),
            "table a += b": (lambda x=table_a, y=table_b: np.add(x, y, out=x), {}),
            "server finish": (aggregator.finish, {}),
            "estimates": (estimates, {}),
            "server round": (
                lambda agg=round_aggregator, p=pushes: server_round(agg, p),
                {"push_bytes": 4 * table_floats},
            ),
            "topk server round": (
                lambda agg=topk_aggregator, p=topk_pushes: server_round(agg, p),
                {"topk_ratio": round(ratio, 6),
                 "push_bytes": sum(f.nbytes for f in topk_pushes[0])},
            ),
        }  # fmt: skip
        for part, (fn, extra) in parts.items():
            cases[f"{label} {part}"] = fn
            fields[f"{label} {part}"] = {**common, **extra}
    medians = interleaved_medians(cases, repeats)
    base = medians["a += b (numpy)"]
    for label in labels:

        def seconds(part: str, label: str = label) -> float:
            return medians[f"{label} {part}"]

        def emit_part(op: str, part: str, label: str = label, **more: Any) -> None:
            emit({"bench": "codecs", "op": f"{label} {op} (numba)", "elements": n,
                  **fields[f"{label} {part}"], "seconds": round(seconds(part), 6),
                  "ms": round(seconds(part) * 1e3, 3), "add_seconds": round(base, 6),
                  "ratio_to_add": round(seconds(part) / base, 3), **more,
                  "threads": 1})  # fmt: skip

        emit_part("encode", "encode", input_gbytes_per_s=round(4 * n / seconds("encode") / 1e9, 2))
        emit_part(
            "server add",
            "server add",
            table_add_seconds=round(seconds("table a += b"), 6),
            ratio_to_table_add=round(seconds("server add") / seconds("table a += b"), 3),
            table_add_floor_ratio=round(16 / 12, 3),
        )
        emit_part(
            "server finish",
            "server finish",
            estimates_share=round(seconds("estimates") / seconds("server finish"), 3),
        )
        emit_part("estimates", "estimates")
        emit_part(
            f"server round, {SKETCH_WORKERS} pushes",
            "server round",
            ratio_to_topk_round=round(seconds("server round") / seconds("topk server round"), 3),
        )
        emit_part(f"topk server round, {SKETCH_WORKERS} pushes", "topk server round")


QUANTIZER_CASES = {
    "1bit": ({"type": "1bit"}, 12.125, 8.125),
    "efsign": ({"type": "efsign"}, 12.125, 8.125),
    "terngrad": ({"type": "terngrad"}, 4.25, 8.25),
    "qsgd (levels 15)": ({"type": "qsgd", "levels": 15}, 4.625, 8.625),
    "fp16": ({"type": "fp16"}, 6.0, 10.0),
    "fp16 (error feedback)": ({"type": "fp16", "error_feedback": True}, 14.0, 10.0),
    "bf16": ({"type": "bf16"}, 6.0, 10.0),
    "bf16 (error feedback)": ({"type": "bf16", "error_feedback": True}, 14.0, 10.0),
}
"""Quantizing codecs timed on the CPU: spec, then the memory floor in bytes per element of the
encode (read the gradient, and the residual where there is one; write the residual and the
codes) and of the server's decode-and-accumulate (read the codes, read and write the sum)."""


def bench_quantizers(n: int, repeats: int) -> None:
    """Each quantizing codec's CPU encode of one ``n``-element chunk (as the client calls it,
    after its NaN check) and the server's decode-and-accumulate of one push, against ``a += b``
    over the same array, interleaved."""
    from kvstore.codecs import codec_from_spec, registered_codecs

    rng = np.random.default_rng(3)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    cases: dict[str, Any] = {"a += b (numpy)": lambda: np.add(a, b, out=a)}
    floors = {"a += b (numpy)": 12.0}
    for label, (spec, encode_floor, decode_floor) in QUANTIZER_CASES.items():
        if spec["type"] not in registered_codecs():
            continue
        codec = codec_from_spec(spec)
        encoder = codec.make_key_encoder("bench", n, "float32", [(0, n)])
        frames = [np.array(f, copy=True) for f in encoder.chunks[0].encode(grads[0])]
        aggregator = codec.make_aggregator(n, "float32")
        aggregator.add(frames, first=True)
        pushes = iter(range(1 << 62))

        def encode(encoder: Any = encoder, pushes: Any = pushes) -> None:
            grad = grads[next(pushes) % 2]
            encoder.begin(grad, finite=True)
            encoder.chunks[0].encode(grad)

        def decode(aggregator: Any = aggregator, frames: Any = frames) -> None:
            aggregator.add(frames, first=False)

        cases[f"{label} encode (numba)"] = encode
        floors[f"{label} encode (numba)"] = encode_floor
        cases[f"{label} decode+accumulate (numba)"] = decode
        floors[f"{label} decode+accumulate (numba)"] = decode_floor
    medians = interleaved_medians(cases, repeats)
    base = medians["a += b (numpy)"]
    for name, seconds in medians.items():
        if name == "a += b (numpy)":
            continue
        emit({"bench": "codecs", "op": name, "elements": n, "seconds": round(seconds, 6),
              "ratio_to_add": round(seconds / base, 3),
              "floor_ratio": round(floors[name] / 12.0, 3), "threads": 1})  # fmt: skip


def bench_powersgd(repeats: int, rows: int = 4096, cols: int = 4096, rank: int = 4) -> None:
    """PowerSGD's worker side of one step of a ``rows x cols`` key at ``rank`` (round 1: the
    error added and ``M @ Q``; round 2: ``M^T @ P_hat``; the end of the step: the new error),
    against one numpy float32 matmul ``M @ Q`` of the same shapes, interleaved. The server's
    part (sums, Gram-Schmidt) runs outside the timing."""
    from kvstore.codecs import codec_from_spec

    rng = np.random.default_rng(4)
    numel = rows * cols
    codec = codec_from_spec({"type": "powersgd", "rank": rank})
    encoder = codec.make_key_encoder("bench", numel, "float32", [(0, numel)], shape=(rows, cols))
    chunk = encoder.chunks[0]
    server = codec.make_chunk_aggregator(numel, "float32", shape=(rows, cols), start=0)
    grad = rng.standard_normal(numel).astype(np.float32)
    matrix = grad.reshape(rows, cols)
    factor = rng.standard_normal((cols, rank)).astype(np.float32)

    def host(frames: Any) -> list[bytes]:
        return [bytes(memoryview(getattr(f, "buffer", f)).cast("B")) for f in frames]

    def one_step() -> dict[str, float]:
        times = {}
        started = time.perf_counter()
        encoder.begin(grad, finite=True)
        first = host(chunk.encode(grad))
        times["round 1"] = time.perf_counter() - started
        server.add(first, True)
        reply = host(server.finish())
        started = time.perf_counter()
        second = host(chunk.next_round(reply))
        times["round 2"] = time.perf_counter() - started
        server.add(second, True)
        server.finish()
        ack = host(server.reply_frames() or [])
        started = time.perf_counter()
        chunk.end_step(ack)
        times["end of step"] = time.perf_counter() - started
        return times

    one_step()  # compile (or load the cache)
    steps, matmuls = [], []
    for _ in range(repeats):
        steps.append(one_step())
        started = time.perf_counter()
        np.matmul(matrix, factor)
        matmuls.append(time.perf_counter() - started)
    matmul = statistics.median(matmuls)
    parts = {name: statistics.median(s[name] for s in steps) for name in steps[0]}
    total = statistics.median(sum(s.values()) for s in steps)
    for name, seconds in [*parts.items(), ("worker step", total)]:
        emit({"bench": "codecs", "op": f"powersgd {name} (numba)", "shape": [rows, cols],
              "rank": rank, "seconds": round(seconds, 6), "numpy_matmul_seconds": round(matmul, 6),
              "ratio_to_matmul": round(seconds / matmul, 2), "threads": 1})  # fmt: skip


def bench_server_threads(n: int, partitions: int, thread_counts: list[int], repeats: int) -> None:
    """One round of server-side decode/aggregate: ``partitions`` aggregators, T threads."""
    codec = get_codec("2bit", threshold=0.5)
    size = n // partitions
    rng = np.random.default_rng(1)
    aggregators = [codec.make_aggregator(size, "float32") for _ in range(partitions)]
    payloads = []
    for _ in range(partitions):
        words = twobit.encode(
            rng.standard_normal(size).astype(np.float32), np.zeros(size, np.float32), 0.5
        )
        payloads.append([words])
    for agg, payload in zip(aggregators, payloads, strict=True):
        agg.add(payload, first=True)
    baseline = None
    for threads in thread_counts:
        with ThreadPoolExecutor(max_workers=threads) as pool:

            def one_round() -> None:
                list(pool.map(lambda i: aggregators[i].add(payloads[i], False), range(partitions)))

            seconds = interleaved_medians({"round": one_round}, repeats)["round"]
        baseline = baseline or seconds
        emit(
            {
                "bench": "codecs",
                "op": "server decode+aggregate round (2bit)",
                "elements": size * partitions,
                "partitions": partitions,
                "threads": threads,
                "seconds": round(seconds, 6),
                "speedup_vs_1_thread": round(baseline / seconds, 2),
                "gbytes_per_s": round(8.25 * size * partitions / seconds / 1e9, 2),
                "cpu_cores": os.cpu_count(),
            }
        )


def bench_gpu(repeats: int) -> None:
    import cupy

    from kvstore.codecs.cast import cuda_kernels as _cast_cuda
    from kvstore.codecs.sketch import SketchCodec
    from kvstore.codecs.sketch import cuda_kernels as _sketch_cuda

    n = 100_000_000
    rng = cupy.random.default_rng(0)
    grad = rng.standard_normal(n, dtype=cupy.float32)
    residual = cupy.zeros(n, cupy.float32)
    words = cupy.empty(twobit.packed_words(n), cupy.uint32)
    out = cupy.zeros(n, cupy.float32)
    src = cupy.empty(n, cupy.float32)
    dst = cupy.empty(n, cupy.float32)
    halves = grad.astype(cupy.float16).view(cupy.uint16)  # fp16 or bf16 codes: same bytes moved

    def timed(fn) -> float:
        fn()
        cupy.cuda.Device().synchronize()
        start_event, end_event = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(repeats):
            start_event.record()
            fn()
            end_event.record()
            end_event.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start_event, end_event) / 1000)
        return float(np.median(times))

    copy_s = timed(lambda: cupy.copyto(dst, src))
    copy_bw = 8.0 * n / copy_s  # read + write
    cases = {
        "2bit encode (cupy)": (lambda: twobit.encode(grad, residual, 0.5, words), 12.25),
        "2bit decode+accumulate (cupy)": (
            lambda: twobit.decode(words, n, 0.5, out, accumulate=True),
            8.25,
        ),
        "nonfinite check (cupy)": (lambda: count_nonfinite(grad), 4.0),
        "fp16 decode+accumulate (cupy)": (
            lambda: _cast_cuda.decode(halves, out, bf16=False, accumulate=True),
            10.0,
        ),
        "bf16 decode+accumulate (cupy)": (
            lambda: _cast_cuda.decode(halves, out, bf16=True, accumulate=True),
            10.0,
        ),
    }
    for columns in SKETCH_COLUMNS[:2]:  # the sketch kernel alone; its floor: read the values
        sketch_codec = SketchCodec(columns=columns)
        plan, keys = sketch_codec.plan(0, n, n), sketch_codec.row_keys("bench")

        def sketch_on_device(keys: Any = keys, width: int = plan.columns) -> Any:
            return _sketch_cuda.sketch(grad, keys, 0, width)

        cases[f"sketch rows={plan.rows} columns={columns} (cupy)"] = (sketch_on_device, 4.0)
    emit({"bench": "codecs", "op": "device copy (cupy)", "elements": n, "seconds": copy_s,
          "gbytes_per_s": round(copy_bw / 1e9, 1),
          "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()})  # fmt: skip
    for name, (fn, bytes_per_element) in cases.items():
        seconds = timed(fn)
        bw = bytes_per_element * n / seconds
        emit(
            {
                "bench": "codecs",
                "op": name,
                "elements": n,
                "seconds": round(seconds, 6),
                "gbytes_per_s": round(bw / 1e9, 1),
                "fraction_of_copy_bandwidth": round(bw / copy_bw, 3),
            }
        )
    bench_gpu_encoders(n, repeats, copy_bw)


GPU_CODECS = {
    "2bit:residual_clip=1": ({"type": "2bit", "threshold": 0.5, "residual_clip": 1}, 12.0),
    # The scaled quantizers read the chunk once for its scales and again to encode it:
    # 1bit / efsign 8 + 12.125 bytes, terngrad 4 + 4.25, qsgd 4 + 4.625 (+ one norm per bucket).
    "1bit": ({"type": "1bit"}, 20.125),
    "efsign": ({"type": "efsign"}, 20.125),
    "terngrad": ({"type": "terngrad"}, 8.25),
    "qsgd (levels 15)": ({"type": "qsgd", "levels": 15}, 8.625),
    "fp16": ({"type": "fp16"}, 6.0),
    "fp16 (error feedback)": ({"type": "fp16", "error_feedback": True}, 14.0),
    "bf16": ({"type": "bf16"}, 6.0),
    "bf16 (error feedback)": ({"type": "bf16", "error_feedback": True}, 14.0),
    "threshold": ({"type": "threshold", "threshold": 2.5}, 12.0),
    "topk (sampled)": ({"type": "topk", "ratio": 0.01}, 12.0),
    "topk (exact)": ({"type": "topk", "ratio": 0.01, "sample": 0}, 12.0),
    "randomk": ({"type": "randomk", "ratio": 0.01}, 12.0),
    "dgc": ({"type": "dgc", "ratio": 0.001}, 20.0),
    "sketch": ({"type": "sketch"}, 4.0),
    "sketch (columns 0.004)": ({"type": "sketch", "columns": 0.004}, 4.0),
}
"""Codecs timed through their GPU encoders (key encoder, one chunk) with the bytes per element
their kernels read and write: gradient and state read, state and codes written (DGC: two state
arrays; the scaled quantizers: a first pass for the scales; the sketch: the values read, its
small table aside)."""


def bench_gpu_encoders(n: int, repeats: int, copy_bw: float) -> None:
    """Each codec's whole GPU encode of an ``n``-element key (the selection and compaction
    kernels included, the copy of the payload to the host excluded), against ``copy_bw``."""
    import cupy

    from kvstore.codecs import codec_from_spec, xp

    rng = cupy.random.default_rng(0)
    grads = [rng.standard_normal(n, dtype=cupy.float32) for _ in range(2)]  # as on the CPU
    for label, (spec, bytes_per_element) in GPU_CODECS.items():
        try:
            codec = codec_from_spec(spec)
            encoder = codec.make_key_encoder("bench", n, "float32", [(0, n)], cupy.cuda.Device())
            pushes = iter(range(1 << 62))

            def encode(encoder: Any = encoder, pushes: Any = pushes) -> None:
                grad = grads[next(pushes) % 2]
                encoder.begin(grad, finite=True)  # as the client calls it, after its check
                encoder.chunks[0].encode(grad)

            encode()
            times = []
            for _ in range(repeats):
                cupy.cuda.Device().synchronize()
                copies = xp.TRANSFERS.d2h_seconds
                start = time.perf_counter()
                encode()
                cupy.cuda.Device().synchronize()
                times.append(time.perf_counter() - start - (xp.TRANSFERS.d2h_seconds - copies))
            seconds = float(np.median(times))
            bw = bytes_per_element * n / seconds
            emit({"bench": "codecs", "op": f"{label} encode (cupy)", "elements": n,
                  "seconds": round(seconds, 6), "gbytes_per_s": round(bw / 1e9, 1),
                  "fraction_of_copy_bandwidth": round(bw / copy_bw, 3)})  # fmt: skip
        except Exception as exc:  # report and go on with the other codecs
            emit({"bench": "codecs", "op": f"{label} encode (cupy)", "error": repr(exc)[:500]})


GPU_TRAINING = {
    "smoke": {"mlp": 2},
    "full": {"mlp": 8, "cnn": 1},
}
"""Epochs of each model in ``--gpu`` training runs, per preset."""

STEP_TIMES = ("encode", "d2h", "wire", "h2d")


def bench_gpu_training(preset: str) -> None:
    """The MNIST example, 2 workers x 2 servers, on the GPU and on the CPU: accuracy and
    per-step times (worker 0's ``kv.stats()`` timers)."""
    for model, epochs in GPU_TRAINING[preset].items():
        for device in ("cpu", "cuda"):
            command = module_command(
                "convergence", "-n", "2", "-s", "2", "--model", model,
                "--epochs", str(epochs), "--device", device, "--optimizer", "server",
                "--lr", "0.2", "--momentum", "0.5", "--runs", "none", "2bit",
            )  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=REPO)
            lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
            if done.returncode != 0:
                emit({"bench": "codecs", "op": "mnist training", "model": model,
                      "device": device, "error": done.stderr[-2000:]})  # fmt: skip
            for run in ("none", "2bit"):
                epochs_of_run = [x for x in lines if x.get("run") == run and "epoch" in x]
                if not epochs_of_run:
                    continue
                last = epochs_of_run[-1]
                record = {
                    "bench": "codecs",
                    "op": "mnist training",
                    "model": model,
                    "device": device,
                    "compression": run,
                    "workers": 2,
                    "servers": 2,
                    "epochs": len(epochs_of_run),
                    "test_accuracy": last["accuracy"],
                    "seconds_per_epoch": round(
                        statistics.fmean(x["seconds"] for x in epochs_of_run), 2
                    ),
                }
                for name in STEP_TIMES:
                    values = [x[f"{name}_ms_per_step"] for x in epochs_of_run
                              if f"{name}_ms_per_step" in x]  # fmt: skip
                    if values:
                        record[f"{name}_ms_per_step"] = round(statistics.fmean(values), 3)
                emit(record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--elements", type=int, help="override the preset's array size")
    parser.add_argument("--repeats", type=int, help="override the preset's repeat count")
    parser.add_argument("--gpu", action="store_true", help="also time the CuPy kernels")
    parser.add_argument(
        "--gpu-only", action="store_true", help="with --gpu: skip the CPU kernels and threads"
    )
    args = parser.parse_args(argv)
    preset = dict(PRESETS[args.preset])
    n = args.elements or preset["elements"]
    repeats = args.repeats or preset["repeats"]
    started = time.time()
    if not (args.gpu and args.gpu_only):
        bench_kernels(n, repeats)
        bench_sparse(n, repeats)
        bench_quantizers(n, repeats)
        bench_sketch(n, args.repeats or preset["sketch_repeats"])
        if args.preset == "full":
            bench_powersgd(repeats)
        else:
            bench_powersgd(repeats, rows=512, cols=512)
        bench_server_threads(n, preset["partitions"], preset["threads"], repeats)
    if args.gpu:
        bench_gpu(repeats)
        bench_gpu_training(args.preset)
    emit({"bench": "codecs", "preset": args.preset, "machine": machine(),
          "wall_seconds": round(time.time() - started, 1)})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
