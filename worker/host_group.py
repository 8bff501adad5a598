"""Hierarchical aggregation: the k workers of one host sum their pushes in shared memory, each
exchanges a 1/k share of the host's sum with the servers, and each pull is fetched once per host.

Where a host runs several workers (one per GPU, ``KVSTORE_LOCAL_SIZE`` = k > 1), pushing every
worker's gradient through the host's one link would carry k times what it must. Instead
(MXNet's ``dist_device_sync``, BytePS):

1. **Push.** Each worker writes its value into its slot of the key's shared-memory segment (all
   keys of a call at once, so that a call meets the others twice whatever its key count); once
   all k have, each sums a 1/k slice of the key's elements over the k slots, in local-rank
   order, into the segment's sum (a reduce-scatter; no bulk bytes through any socket). A key
   whose values are on the GPUs has its slots and sum in GPU memory instead, which the host's
   workers share through CUDA IPC (:mod:`kvstore.worker.host_gpu`; where every worker of the
   host can map it, agreed at init), and is summed there. Once all
   k have, the owner of each chunk encodes it from the sum, with its own residual for that
   chunk, and pushes it. Every chunk is owned by one worker of the host
   (:meth:`HostGroup.plan`): chunks go to the least loaded worker, in init order, so each
   pushes about 1/k of the host's bytes; a key whose codec selects over the whole key
   (top-k and its family, :attr:`kvstore.codecs.Codec.encodes_whole_key`) goes whole to one.
2. **Pull.** Once all k are in the pull, each owner pulls its chunks into the segment's result;
   once all have landed, every worker copies the whole key into its ``out``.

The servers count one push per host and chunk (N/k pushes make a ``dist_sync`` round,
:class:`kvstore.wire.HelloFields`), so a round is still the sum over all N workers, and every
worker pulls the same values. ``KVSTORE_HIERARCHY=0`` turns it off.

The workers of a host meet through ZeroMQ ``ipc://`` sockets in a private folder: one small
message from each to each per step of the protocol, never a value. While a worker waits to
meet the others it checks that they are alive: a local worker that died makes the call raise
:class:`~kvstore.errors.WorkerLostError` naming it, and a local worker whose call failed (an
owner's pull that got an error) passes the error on, so no worker of the host hangs. The
segments are unlinked as soon as every worker of the host has mapped them, so none outlives
the job, however it ends.

Every worker of a host must make the same calls with the same keys in the same order (as
collective calls), which a training loop does.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from kvstore.config import ClusterConfig
from kvstore.errors import KVStoreError, KVStoreTimeoutError, ServerLostError, WorkerLostError
from kvstore.topology import WORD_ELEMS, Chunk, Key
from kvstore.worker import values as vals
from kvstore.worker.host_gpu import DeviceTable, DeviceTableError, synchronize_all
from kvstore.worker.request import Deadline

logger = logging.getLogger(__name__)

_CHECK_PEERS_EVERY = 0.5
"""Seconds between two checks that the host's other workers are alive, while waiting for them."""
_WARN_AFTER = 60.0
"""Seconds of waiting for the host's other workers after which a worker says what it waits for
(without ``KVSTORE_TIMEOUT`` it would otherwise wait silently)."""


def group_tag(servers: Sequence[str], host_index: int) -> str:
    """A name for one host's group of one job: the same on the host's workers (they read the
    same server addresses), different for another job or host."""
    digest = hashlib.sha256(f"{','.join(servers)}|{host_index}".encode()).hexdigest()
    return digest[:16]


def reduce_slice(numel: int, parts: int, part: int) -> tuple[int, int]:
    """Elements ``[start, stop)`` that worker ``part`` of ``parts`` sums: contiguous slices on
    16-element boundaries (the last one takes the rest), so that slices never share a cache
    line of a 2-bit word's elements."""
    words = -(-numel // WORD_ELEMS)
    per = -(-words // parts)
    start = min(numel, part * per * WORD_ELEMS)
    stop = min(numel, (part + 1) * per * WORD_ELEMS)
    return start, stop


_SUM_BLOCK = 1 << 18
"""Elements summed at a time by :func:`sum_slots` (1 MiB of float32): a block of the sum stays
in the core's cache while every slot is added into it, so the sum is written to memory once,
not once per slot."""


def sum_slots(slots: np.ndarray, start: int, stop: int, out: np.ndarray) -> None:
    """``out[start:stop]`` = the sum of every row of ``slots`` over those elements, added in row
    order (the same float adds, in the same order, as the GPU path's)."""
    for low in range(start, stop, _SUM_BLOCK):
        high = min(stop, low + _SUM_BLOCK)
        region = out[low:high]
        if len(slots) == 1:
            np.copyto(region, slots[0, low:high])
            continue
        np.add(slots[0, low:high], slots[1, low:high], out=region)
        for slot in slots[2:]:
            np.add(region, slot[low:high], out=region)


@dataclass
class HostKey:
    """One key's shared memory and counters on this worker.

    Attributes:
        index: the key's place in the group's init order (the same on every worker of the host).
        segment: the key's host shared memory.
        result: the last pull's values, written by each chunk's owner (host memory).
        slots: each local worker's last push, ``(k, numel)``, in host memory (None where the
            key's pushes are summed on the GPU).
        sum: the host's sum of the last push, in host memory (None likewise).
        gpu: the key's slots and sum in GPU memory, shared through CUDA IPC
            (:mod:`kvstore.worker.host_gpu`), where the host's workers push GPU values and could
            map it; else None.
        pushes, pulls: calls made so far.
    """

    index: int
    segment: shared_memory.SharedMemory
    result: np.ndarray
    slots: np.ndarray | None = None
    sum: np.ndarray | None = None
    gpu: DeviceTable | None = None
    pushes: int = 0
    pulls: int = 0

    def release(self) -> None:
        """Unmap the segment (the arrays must go first: they hold its buffer) and the GPU
        table."""
        self.slots = self.sum = None
        del self.result
        self.segment.close()
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # not Linux, or gone just now: the next check tells
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


class HostGroup:
    """This worker's place among its host's k workers (see the module's docstring).

    Args:
        cluster: the worker's place in the job (``local_size`` > 1).
        connect_timeout: seconds to wait for the host's other workers to appear.
    """

    def __init__(self, cluster: ClusterConfig, connect_timeout: float) -> None:
        self.size = cluster.local_size
        self.local_rank = cluster.local_rank
        self.first_rank = cluster.rank - cluster.local_rank
        self.tag = group_tag(cluster.servers, cluster.host_index)
        self._folder = Path(tempfile.gettempdir()) / f"pskv-{self.tag}"
        self._folder.mkdir(mode=0o700, exist_ok=True)
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        self._peers = frozenset(range(self.size)) - {self.local_rank}
        self._outboxes: dict[int, zmq.Socket] = {}
        self._arrived: dict[tuple[Any, ...], dict[int, Any]] = {}
        self._pids: dict[int, int] = {}
        self._keys: dict[Key, HostKey] = {}
        self._load = [0] * self.size  # bytes of the chunks each local worker pushes
        # one step of the protocol at a time: the inbox and the arrivals are this worker's
        # (a store used from two threads runs their calls one after the other here)
        self._lock = threading.RLock()
        self._closed = False
        self._said_host_memory = False
        try:
            self._inbox.bind(self._address(self.local_rank))
            for peer in sorted(self._peers):
                outbox = self._context.socket(zmq.PUSH)
                outbox.setsockopt(zmq.LINGER, 1000)
                outbox.connect(self._address(peer))
                self._outboxes[peer] = outbox
            self._meet_everyone(connect_timeout)
        except BaseException:
            self.close()
            raise

    # the group -------------------------------------------------------------------------------

    def _address(self, local_rank: int) -> str:
        return f"ipc://{self._folder}/worker-{local_rank}"

    def _rank_of(self, local_rank: int) -> int:
        return self.first_rank + local_rank

    def _meet_everyone(self, timeout: float) -> None:
        """Learn the host's other workers' pids (one hello each), within ``timeout`` s."""
        self._send(("hello",), str(os.getpid()))
        deadline = Deadline(timeout)
        hellos = self._wait(("hello",), deadline, check_peers=False)
        self._pids = {peer: int(pid or 0) for peer, pid in hellos.items()}

    def _send(self, tag: tuple[Any, ...], note: Any = None) -> None:
        message = msgpack.packb([list(tag), self.local_rank, note])
        for outbox in self._outboxes.values():
            outbox.send(message)

    def _wait(
        self,
        tag: tuple[Any, ...],
        deadline: Deadline,
        check_peers: bool = True,
        senders: set[int] | None = None,
    ) -> dict[int, Any]:
        """Wait until every other worker of the host (or each of ``senders``) sent ``tag``;
        what each noted with it."""
        expected = self._peers if senders is None else senders
        arrived = self._arrived.setdefault(tag, {})
        started = time.monotonic()
        warned = False
        while not expected <= arrived.keys():
            missing = [self._rank_of(peer) for peer in sorted(expected - arrived.keys())]
            if not warned and time.monotonic() - started > _WARN_AFTER:
                warned = True
                logger.warning(
                    "worker rank(s) %s of this host have not reached %s after %g s: every "
                    "worker of a host must make the same calls in the same order (a pull on "
                    "rank 0 alone waits for the others); KVSTORE_HIERARCHY=0 lets each worker "
                    "exchange on its own",
                    missing,
                    _describe(tag),
                    _WARN_AFTER,
                )
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise KVStoreTimeoutError(
                    f"the workers of rank(s) {missing} on this host did not reach "
                    f"{_describe(tag)} within {deadline.timeout} s (KVSTORE_TIMEOUT; every "
                    f"worker of a host must make the same calls)"
                )
            wait = _CHECK_PEERS_EVERY if remaining is None else min(remaining, _CHECK_PEERS_EVERY)
            if self._poller.poll(round(wait * 1000)):
                while True:
                    try:
                        raw = self._inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    got, sender, note = msgpack.unpackb(raw)
                    self._arrived.setdefault(tuple(got), {})[sender] = note
            elif check_peers:
                self._check_peers(tag, arrived)
        return self._arrived.pop(tag)

    def _check_peers(self, tag: tuple[Any, ...], arrived: dict[int, Any]) -> None:
        for peer, pid in self._pids.items():
            if peer not in arrived and pid and not _alive(pid):
                raise WorkerLostError(
                    f"worker rank {self._rank_of(peer)} (local rank {peer} on this host, pid "
                    f"{pid}) died while this worker waited for it at {_describe(tag)}",
                    rank=self._rank_of(peer),
                )

    def meet(
        self, tag: tuple[Any, ...], deadline: Deadline, failed: BaseException | None = None
    ) -> None:
        """Wait until every worker of the host reached ``tag`` (a barrier of the host); a worker
        that reached it having ``failed`` says why, and every worker then raises (this one its
        own error).

        Raises:
            WorkerLostError: another worker of the host died before it got there.
            KVStoreTimeoutError: one did not get there by ``deadline``.
            KVStoreError: one failed on the way (naming it and what it said).
        """
        with self._lock:
            self._meet(tag, deadline, failed)

    def _meet(self, tag: tuple[Any, ...], deadline: Deadline, failed: BaseException | None) -> None:
        note = None
        if failed is not None:
            who = getattr(failed, "rank", getattr(failed, "server", None))  # (a lost peer's)
            note = [type(failed).__name__, str(failed), who]
        self._send(tag, note)
        notes = self._wait(tag, deadline)
        if failed is not None:
            raise failed
        for peer, said in sorted(notes.items()):
            if said is not None:
                raise _peer_error(said, f"worker rank {self._rank_of(peer)} of this host failed "
                                        f"at {_describe(tag)}")  # fmt: skip

    # keys ------------------------------------------------------------------------------------

    def plan(self, key: Key, chunks: Sequence[Chunk], itemsize: int, whole: bool) -> set[int]:
        """Which of a key's chunks this worker pushes and pulls: each to the local worker with
        the fewest bytes so far (ties: the lowest local rank), or with ``whole`` all of them to
        one. Every worker of the host plans the same, as they init the same keys in order."""
        owned: set[int] = set()
        groups = [list(chunks)] if whole else [[chunk] for chunk in chunks]
        for group in groups:
            owner = min(range(self.size), key=lambda r: (self._load[r], r))
            self._load[owner] += sum(chunk.numel for chunk in group) * itemsize
            if owner == self.local_rank:
                owned.update(chunk.index for chunk in group)
        return owned

    def add_key(
        self, key: Key, numel: int, dtype: str, deadline: Deadline, device: int | None = None
    ) -> None:
        """Map the key's memory: local worker 0 makes it, the others open it, and once all have
        it is unlinked (it lives while a worker maps it).

        ``device`` is the CUDA device of this worker's values of the key (None: host values).
        Where every worker of the host has one and each could map local worker 0's GPU table
        (:mod:`kvstore.worker.host_gpu`), the key's pushes are summed there; otherwise in host
        memory. The host's pulls land in host memory either way."""
        with self._lock:
            self._add_key(key, numel, dtype, deadline, device)

    def _add_key(
        self, key: Key, numel: int, dtype: str, deadline: Deadline, device: int | None
    ) -> None:
        index = len(self._keys)
        gpu = self._gpu_table(key, index, numel, dtype, device, deadline)
        try:
            rows = 1 if gpu is not None else self.size + 2  # (a GPU key's pulls land here)
            segment = self._map_segment(key, index, rows * numel, dtype, deadline)
        except BaseException:
            if gpu is not None:
                gpu.close()
            raise
        table = np.ndarray((rows, numel), dtype=dtype, buffer=segment.buf)
        if gpu is not None:
            self._keys[key] = HostKey(index, segment, table[0], gpu=gpu)
        else:
            self._keys[key] = HostKey(index, segment, table[self.size + 1],
                                      table[: self.size], table[self.size])  # fmt: skip

    def _gpu_table(
        self, key: Key, index: int, numel: int, dtype: str, device: int | None, deadline: Deadline
    ) -> DeviceTable | None:
        """The key's GPU table, where local worker 0 could make one and every other worker
        of the host could open it; else None (every worker of the host agrees)."""
        gpu: DeviceTable | None = None
        reason = ""
        if self.local_rank == 0:
            if device is not None and numel:
                try:
                    gpu = DeviceTable.allocate(self.size + 1, numel, dtype, device)
                except DeviceTableError as exc:
                    reason = f"local worker 0 could not allocate it on device {device}: {exc}"
            self._send(("table", index), None if gpu is None else gpu.handle)
            if gpu is None:
                self._say_why_host_memory(key, reason)
                return None
        else:
            handle = self._wait(("table", index), deadline, senders={0}).get(0)
            if handle is None:  # (worker 0's values are in host memory, or it failed)
                return None
            if device is not None:
                try:
                    gpu = DeviceTable.open(handle, self.size + 1, numel, dtype, device)
                except DeviceTableError as exc:
                    where = f"local worker {self.local_rank}"
                    reason = f"{where} could not map it on device {device}: {exc}"
            else:
                reason = f"local worker {self.local_rank}'s values are in host memory"
        # everyone says whether it has the table: it is used only if all have
        try:
            self._send(("table opened", index), gpu is not None)
            opened = self._wait(("table opened", index), deadline)
        except BaseException:
            if gpu is not None:
                gpu.close()
            raise
        if gpu is not None and all(opened.values()):
            return gpu
        if gpu is not None:
            gpu.close()
        if not reason:
            refused = [self._rank_of(peer) for peer, has in sorted(opened.items()) if not has]
            reason = f"worker rank(s) {refused} of this host could not use it (their log says why)"
        self._say_why_host_memory(key, reason)
        return None

    def _say_why_host_memory(self, key: Key, reason: str) -> None:
        """Log (once per worker) why a key of GPU values is summed in host memory."""
        if reason and not self._said_host_memory:
            self._said_host_memory = True
            logger.warning(
                "the GPU values of key %r (and of any later key like it) are summed in host "
                "memory, not on the GPUs through CUDA IPC: %s",
                key,
                reason,
            )

    def _map_segment(
        self, key: Key, index: int, numel: int, dtype: str, deadline: Deadline
    ) -> shared_memory.SharedMemory:
        """The key's host shared memory of ``numel`` elements, mapped by every worker of the
        host (made by local worker 0, unlinked once all mapped it)."""
        nbytes = max(1, numel * np.dtype(dtype).itemsize)
        name = f"pskv-{self.tag}-{os.getpid() if self.local_rank == 0 else 0}-{index}"
        failed: BaseException | None = None
        segment = None
        if self.local_rank == 0:
            try:
                segment = shared_memory.SharedMemory(name, create=True, size=nbytes)
            except OSError as exc:
                failed = KVStoreError(
                    f"cannot make {nbytes} bytes of shared memory for key {key!r} (in "
                    f"/dev/shm; a container may need a larger --shm-size): {exc}"
                )
            self._send(("made", index), name if failed is None else None)
            if failed is not None:
                raise failed
        else:
            made = self._wait(("made", index), deadline, senders={0})
            name = made.get(0) or ""
            if not name:
                raise KVStoreError(f"local worker 0 could not make key {key!r}'s shared memory")
            segment = shared_memory.SharedMemory(name)
            if self._pids.get(0) != os.getpid():
                # the maker unlinks it: this process's tracker must not try again at exit
                resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
        assert segment is not None
        try:
            self.meet(("mapped", index), deadline)
        except BaseException:
            segment.close()
            raise
        finally:
            if self.local_rank == 0:
                segment.unlink()
        return segment

    def summed_on_gpu(self, key: Key) -> bool:
        """Whether the host sums ``key``'s pushes on the GPU (through CUDA IPC)."""
        return self._keys[key].gpu is not None

    # push and pull ---------------------------------------------------------------------------
    #
    # A call meets the host's other workers twice, whatever number of keys it has (a model's
    # hundreds of tensors in one push): on a host whose cores are busy each meeting costs a
    # few scheduling turns, which one meeting per key would pay hundreds of times a step.

    def host_sums(self, pairs: Sequence[tuple[Key, Any]], deadline: Deadline) -> list[Any]:
        """This worker's push of each ``(key, value)`` summed with its host's others': the
        host's sum of each whole key (numpy, or CuPy for a key summed on the GPU), valid until
        this worker's next call of the keys."""
        with self._lock:
            return self._host_sums(pairs, deadline)

    def _host_sums(self, pairs: Sequence[tuple[Key, Any]], deadline: Deadline) -> list[Any]:
        held = [self._keys[key] for key, _ in pairs]
        if not held:
            return []
        label = self._count(held, "push")
        tables = [one.gpu for one in held if one.gpu is not None]
        failed: BaseException | None = None
        try:
            for one, (_, value) in zip(held, pairs, strict=True):
                if one.gpu is not None:
                    one.gpu.write(self.local_rank, value)
                else:
                    assert one.slots is not None
                    source = vals.host_copy(vals.flat_source(value))
                    np.copyto(one.slots[self.local_rank], source, casting="no")
            synchronize_all(tables)  # (before the others read the slots)
        except BaseException as exc:  # the others must not wait for these slots
            failed = exc
        self.meet((label, "written", held[0].pushes), deadline, failed)
        try:
            for one in held:
                start, stop = reduce_slice(one.result.size, self.size, self.local_rank)
                if one.gpu is not None:
                    one.gpu.reduce(start, stop)
                    continue
                assert one.slots is not None and one.sum is not None
                sum_slots(one.slots, start, stop, one.sum)
            synchronize_all(tables)
        except BaseException as exc:  # (a GPU that failed: the others must not wait either)
            failed = exc
        self.meet((label, "summed", held[0].pushes), deadline, failed)
        return [one.gpu.sum if one.gpu is not None else one.sum for one in held]

    def pull_into(self, keys: Sequence[Key], deadline: Deadline) -> list[np.ndarray]:
        """Begin a pull of ``keys``: once every worker of the host is in it, the arrays the
        owners land their chunks in."""
        with self._lock:
            held = [self._keys[key] for key in keys]
            if not held:
                return []
            label = self._count(held, "pull")
            self.meet((label, "pull", held[0].pulls), deadline)
            return [one.result for one in held]

    def pulled(
        self,
        keys: Sequence[Key],
        outs: Sequence[Any],
        deadline: Deadline,
        failed: BaseException | None = None,
    ) -> None:
        """End a pull of ``keys``: once every owner's chunks landed, copy each whole key into
        its ``out`` (unless this worker's or another's part ``failed``: raises it)."""
        with self._lock:
            held = [self._keys[key] for key in keys]
            if not held:
                return
            label = _label(held)
            self.meet((label, "landed", held[0].pulls), deadline, failed)
            for one, out in zip(held, outs, strict=True):
                target = vals.FlatTarget(out)
                target.write(0, one.result.size, one.result)
                target.finish()

    @staticmethod
    def _count(held: list[HostKey], call: str) -> str:
        """Count a push or pull of the keys ``held``; the label of their meetings (every
        worker of the host makes the same calls, so their counts and labels agree)."""
        for one in held:
            if call == "push":
                one.pushes += 1
            else:
                one.pulls += 1
        return _label(held)

    def close(self) -> None:
        """Unmap the segments and close the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for held in self._keys.values():
            held.release()
        self._keys.clear()
        for socket in [self._inbox, *self._outboxes.values()]:
            socket.close(linger=0)
        self._context.term()
        try:
            Path(self._address(self.local_rank).removeprefix("ipc://")).unlink(missing_ok=True)
            self._folder.rmdir()  # (the last worker out removes it)
        except OSError:
            pass


def _peer_error(note: Any, where: str) -> KVStoreError:
    """The error another worker of the host reported (``[class name, message, rank of the
    lost peer]``), as this worker's: a lost worker or server stays one (with its rank), anything
    else is a :class:`~kvstore.errors.KVStoreError` saying where it happened."""
    name, message, who = note
    if name == "WorkerLostError":
        return WorkerLostError(f"{where}: {message}", rank=who)
    if name == "ServerLostError":
        return ServerLostError(f"{where}: {message}", server=who)
    return KVStoreError(f"{where}: {name}: {message}")


def _label(held: Sequence[HostKey]) -> str:
    """The keys of one call, as their meetings' tags name them: their places in the host's init
    order (a long list is shortened to its ends, its count and a checksum of all)."""
    indexes = [one.index for one in held]
    if len(indexes) <= 4:
        return "key " + ", ".join(f"#{i}" for i in indexes)
    checksum = zlib.crc32(np.asarray(indexes, np.int64).tobytes())
    return f"keys #{indexes[0]}..#{indexes[-1]} ({len(indexes)} keys, {checksum:08x})"


def _describe(tag: tuple[Any, ...]) -> str:
    """A step of the protocol, in words."""
    if len(tag) == 3:
        label, step, count = tag
        return f"step {step!r} of call {count} of the host's {label}"
    return f"{tag[0]!r}" + (f" of the host's key #{tag[1]}" if len(tag) > 1 else "")


__all__ = ["HostGroup", "HostKey", "group_tag", "reduce_slice", "sum_slots"]
