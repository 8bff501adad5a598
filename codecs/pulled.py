"""Compressed pulls: the arithmetic both ends of the return path share.

With pull compression (``kv.set_pull_compression``) a server keeps, per key chunk, the value
the workers hold, ``w_pub`` (the init value at first). A pull is answered with
``c = encode(w - w_pub)`` and both sides apply ``w_pub += decode(c)``: what a pull did not
carry stays in ``w - w_pub`` and goes with a later one (error feedback on the downlink), and
every worker that applied the same ``c`` holds bit-identical weights. In ``dist_sync`` the
server encodes once per round, after the update, and sends the same frames to every worker; in
``dist_async`` it keeps one ``w_pub`` per worker and encodes at each of its pulls.

Versions keep both ends in step: ``w_pub`` starts at version 0 and each delta moves it one
version on. A pull says which version the worker holds (-1: none yet) and the reply is one of

* :data:`UNCHANGED`: the worker's version is current, no payload;
* :data:`DELTA`: the frames of ``c`` that move the previous version to the current one;
* :data:`DENSE`: ``w_pub`` itself (float32), for a worker that holds nothing yet or fell more
  than one version behind.

The delta's encoder carries no state of its own from one pull to the next (``w - w_pub`` is the
carried error): its residuals are zeroed before each encode. The decode adds into ``w_pub`` with
the codec's own decode-and-accumulate (the server's aggregator), so the server and every
worker do the same float32 additions. Pull compression applies to float32 keys; others pull
dense values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.codecs.base import Aggregator, Codec, CodecError, KeyEncoder
from kvstore.codecs.registry import codec_from_spec

PULL_CODECS = ("fp16", "bf16", "2bit", "topk", "threshold", "topk2bit")
"""Codecs a pull can be compressed with (``none``: dense pulls)."""

DENSE, DELTA, UNCHANGED = 0, 1, 2
"""Kinds of a compressed pull's reply (its ``pc`` field)."""


def pull_codec_from_spec(spec: dict[str, Any] | None) -> Codec | None:
    """The codec of a pull compression spec; None for ``{"type": "none"}`` (or None).

    Raises:
        CodecError: the spec is invalid, or its codec cannot compress pulls.
    """
    if spec is None:
        return None
    if not isinstance(spec, dict) or "type" not in spec:
        raise CodecError(f"pull compression must be a dict with a 'type', got {spec!r}")
    if spec["type"] == "none":
        return None
    if spec["type"] not in PULL_CODECS:
        raise CodecError(
            f"pull compression {spec['type']!r} is not supported; use one of "
            f"{['none', *PULL_CODECS]}"
        )
    return codec_from_spec(spec)


def pull_applies(codec: Codec | None, dtype: str) -> bool:
    """Whether pulls of a key of ``dtype`` are compressed with ``codec``."""
    return codec is not None and dtype == "float32"


def _clear_residuals(encoder: KeyEncoder) -> None:
    """Zero the error-feedback state of ``encoder`` (the delta carries it instead)."""
    arrays = getattr(encoder, "state", None)  # the sparse codecs keep theirs per key
    if isinstance(arrays, dict):
        for array in arrays.values():
            array.fill(0)
    for chunk in encoder.chunks:
        residual = getattr(chunk, "residual", None)
        if isinstance(residual, np.ndarray):
            residual.fill(0)


class DeltaDecoder:
    """Applies delta frames to a ``w_pub`` array: ``w_pub += decode(frames)``."""

    def __init__(self, codec: Codec, numel: int) -> None:
        self.codec = codec
        self.numel = numel
        self._aggregator: Aggregator = codec.make_chunk_aggregator(
            numel, "float32", shape=(numel,), start=0
        )

    def apply(self, w_pub: np.ndarray, frames: Sequence[Any]) -> None:
        """Add the decoded ``frames`` to ``w_pub`` (float32 [numel]) in place.

        Raises:
            CodecError: the frames do not have the sizes this codec produces.
        """
        self.codec.validate_payloads(list(frames), self.numel, "float32")
        aggregator = self._aggregator
        aggregator.result = w_pub  # decode-and-accumulate straight into it
        aggregator.add(list(frames), first=False)
        aggregator.finish()


class PublishedWeights:
    """One ``w_pub`` and its version, with the encoder of deltas against it (one end: the
    server's, for all workers in ``dist_sync`` or for one worker in ``dist_async``)."""

    def __init__(self, codec: Codec, key: Any, initial: np.ndarray) -> None:
        numel = int(initial.size)
        self.codec = codec
        self.w_pub = np.array(initial, dtype=np.float32, copy=True).reshape(-1)
        self.version = 0
        self.delta: list[bytes] | None = None  # the frames from version - 1 to version
        self._encoder = codec.make_key_encoder(key, numel, "float32", [(0, numel)])
        for chunk in self._encoder.chunks:  # (its residual is cleared before every encode)
            if hasattr(chunk, "watch_runaway"):
                chunk.watch_runaway = False
        self._decoder = DeltaDecoder(codec, numel)
        self._difference = np.empty(numel, dtype=np.float32)

    def advance(self, value: np.ndarray) -> None:
        """Encode ``value - w_pub``, apply it to ``w_pub`` and move one version on.

        A difference the codec refuses (NaN or infinite weights) leaves no delta: ``w_pub``
        becomes ``value`` and pulls get it dense.
        """
        np.subtract(value.reshape(-1), self.w_pub, out=self._difference)
        self.version += 1
        if hasattr(self._encoder, "step"):  # a codec's draws follow the version, not its calls
            self._encoder.step = self.version
        try:
            _clear_residuals(self._encoder)
            self._encoder.begin(self._difference)
            frames = self._encoder.chunks[0].encode(self._difference)
        except CodecError:
            np.copyto(self.w_pub, value.reshape(-1), casting="unsafe")
            self.delta = None
            return
        # copies: the encoder reuses its buffers at the next advance
        self.delta = [np.ascontiguousarray(f).tobytes() for f in frames]
        self._decoder.apply(self.w_pub, self.delta)

    def reply(self, held: int) -> tuple[int, list[Any]]:
        """What a worker that holds version ``held`` gets: ``(kind, frames)``."""
        if held == self.version:
            return UNCHANGED, []
        if held == self.version - 1 and self.delta is not None:
            return DELTA, list(self.delta)
        return DENSE, [self.w_pub.copy()]  # a copy: w_pub changes at the next advance

    def restore(self, w_pub: np.ndarray, version: int) -> None:
        """Make the state a checkpoint's (no delta: the workers, which forget what they held
        when they load it, get ``w_pub`` dense)."""
        np.copyto(self.w_pub, w_pub.reshape(-1), casting="no")
        self.version = int(version)
        self.delta = None


class HeldWeights:
    """A worker's end of one chunk: the ``w_pub`` it holds and its version (-1: none)."""

    def __init__(self, codec: Codec, numel: int) -> None:
        self.w_pub = np.zeros(numel, dtype=np.float32)
        self.version = -1
        self._decoder = DeltaDecoder(codec, numel)

    def apply(self, kind: int, version: int, base: int, frames: Sequence[Any]) -> int:
        """Apply a reply (see :meth:`PublishedWeights.reply`) that brings ``version``;
        ``base`` is the version a delta applies to. Returns the payload bytes.

        Raises:
            CodecError: the reply does not fit what this worker holds.
        """
        nbytes = sum(memoryview(getattr(f, "buffer", f)).nbytes for f in frames)
        if kind == UNCHANGED:
            if version != self.version or frames:
                raise CodecError(f"an unchanged pull of version {version}; this worker holds "
                                 f"version {self.version}")  # fmt: skip
        elif kind == DELTA:
            if base != self.version:
                raise CodecError(
                    f"a pull delta from version {base}; this worker holds version {self.version}"
                )
            self._decoder.apply(self.w_pub, frames)
        elif kind == DENSE:
            if len(frames) != 1 or nbytes != self.w_pub.nbytes:
                raise CodecError(
                    f"a dense compressed-pull reply of {nbytes} bytes; expected {self.w_pub.nbytes}"
                )
            np.copyto(self.w_pub, np.frombuffer(getattr(frames[0], "buffer", frames[0]),
                                                dtype=np.float32))  # fmt: skip
        else:
            raise CodecError(f"unknown compressed-pull reply kind {kind!r}")
        self.version = version
        return nbytes
