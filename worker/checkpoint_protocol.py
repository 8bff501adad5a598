"""The worker's side of the checkpoint collectives: save, load, and the codec state in memory.

``save_checkpoint``: every worker waits for its pushes and writes its part (its codec state,
:mod:`kvstore.worker.checkpointing`) into a staging directory, then asks every server to write
its shard (SAVE); rank 0 writes the manifest and renames the directory into place
(:mod:`kvstore.checkpoint`), and a barrier keeps everyone until it did (with replication, a
barrier before it too: see :meth:`CheckpointProtocol.save`). ``load_checkpoint``:
every worker checks the manifest, the job and its keys and reads its part, then the servers
load in phases (LOAD 0: read and check, 1: commit, 2: abort), so that nothing changes anywhere
unless every part could be restored. A worker that could not do its part still takes part in
the collective, with its error (``er``), so that the servers refuse the call for everyone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvstore import checkpoint
from kvstore._version import __version__
from kvstore.errors import CheckpointError, KVStoreError, ServerLostError
from kvstore.optimizer_spec import make_optimizer_spec
from kvstore.topology import Key
from kvstore.wire import BarrierFields, LoadFields, SaveFields
from kvstore.worker import checkpointing as ckpt
from kvstore.worker import prefetch
from kvstore.worker.compressed_pulls import forget_held
from kvstore.worker.keys import KeyState
from kvstore.worker.pushes import Pushes
from kvstore.worker.request import wait_all
from kvstore.worker.store_state import StoreState

logger = logging.getLogger(__name__)


class CheckpointProtocol:
    """Runs a store's checkpoint calls (the store holds its API lock around each).

    Args:
        store: the state the store's parts share.
        pushes: the store's pushes (waited for before any state is read or replaced).
    """

    def __init__(self, store: StoreState, pushes: Pushes) -> None:
        self._store = store
        self._pushes = pushes

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save the job's state into the directory ``path`` (see ``KVStore.save_checkpoint``)."""
        store = self._store
        target = Path(path).absolute()
        staging = checkpoint.staging_path(target)
        mine = checkpoint.worker_file(store.rank)
        local_error: BaseException | None = None
        sha = ""
        try:
            self._pushes.wait_all()  # (an error here fails the call everywhere, not just here)
            if store.rank == 0:
                checkpoint.clear_stale_manifest(staging)
            arrays, meta = ckpt.codec_state(store.keys.values(), store.rank)
            sha = checkpoint.write_part(staging, mine, arrays, meta)
        except (OSError, KVStoreError) as exc:
            local_error = exc
        # Even when this worker failed: the servers refuse the call for everyone then.
        call_error: KVStoreError | None = None
        try:
            self._call(SaveFields(str(staging)), local_error, f"save to {target}")
        except KVStoreError as exc:
            if store.options.replicas == 1:  # (a refusal for everyone: nobody goes on)
                raise
            call_error = exc
        if store.options.replicas > 1:
            # With replication a lost server's part is written again for each worker that
            # sent it there (its retry, on the shard's next replica), and a retry can fail for
            # one worker alone: every worker's calls end before rank 0 renames the staging
            # directory (a retry still writing would find it gone), and a worker whose call
            # failed still meets the others, so that none of them waits for it.
            self._barrier()
        finish_error: BaseException | None = None
        if store.rank == 0 and call_error is None:  # every part is in: manifest, rename
            try:
                checkpoint.finalize(
                    target,
                    staging,
                    self._manifest(),
                    checkpoint.part_names(store.num_servers, store.num_workers),
                )
            except (OSError, KVStoreError) as exc:
                finish_error = exc
        self._barrier()  # nobody returns before rank 0 finished (or failed)
        if call_error is not None:
            raise call_error
        if finish_error is not None:
            raise CheckpointError(
                f"could not complete the checkpoint {target}: {finish_error}"
            ) from finish_error
        if store.rank != 0:
            entry = checkpoint.read_manifest(target)["files"].get(mine, {})
            if entry.get("sha256") != sha:
                raise CheckpointError(
                    f"rank 0 did not complete the checkpoint {target} (see its error)"
                )

    def _barrier(self) -> None:
        store = self._store
        store.transport.submit(0, BarrierFields(), what="checkpoint barrier").wait(
            store.options.timeout
        )

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore the state saved by :meth:`save` (see ``KVStore.load_checkpoint``)."""
        store = self._store
        target = Path(path).absolute()
        local_error: BaseException | None = None
        manifest: dict[str, Any] = {}
        plan: dict[Key, list[dict[str, Any] | None]] = {}
        try:
            self._pushes.wait_all()
            manifest = checkpoint.read_manifest(target)
            checkpoint.check_job(
                manifest,
                mode=store.mode,
                num_workers=store.num_workers,
                num_servers=store.num_servers,
            )
            checkpoint.compare_keys(manifest["keys"], self._key_specs())
            mine = checkpoint.worker_file(store.rank)
            arrays, meta = checkpoint.read_part(target, mine, manifest)
            plan = ckpt.plan_restore(store.keys, arrays, meta, str(target / mine))
        except (OSError, KVStoreError) as exc:
            local_error = exc
        try:
            self._call(LoadFields(str(target), 0), local_error, f"load {target}")
        except KVStoreError:
            try:  # every server drops what it staged; nothing changed anywhere
                self._call(LoadFields(str(target), 2), None, "abort")
            except KVStoreError as exc:
                logger.debug("aborting the load of %s: %s", target, exc)
            raise
        self._call(LoadFields(str(target), 1), None, f"load {target}")
        for key, state in store.keys.items():
            state.key_encoder = None
            state.encoders = [None] * len(state.chunks)
            state.restored = plan[key]
            prefetch.reset(state)  # values of a push from before the load
            forget_held(state)
        saved = manifest.get("optimizer")
        if saved is not None:
            store.optimizer = make_optimizer_spec(saved["name"], saved["params"])

    def codec_state(self, states: Iterable[KeyState]) -> dict[str, Any]:
        """This worker's codec state of the keys ``states`` (see ``KVStore.codec_state``), once
        their pushes are answered."""
        states = list(states)
        self._pushes.wait_all(states)
        return ckpt.codec_state_dict(states, self._store.rank)

    def load_codec_state(self, saved: Mapping[str, Any]) -> None:
        """Restore what :meth:`codec_state` returned (see ``KVStore.load_codec_state``)."""
        keys = self._store.keys
        plan = ckpt.plan_codec_state(keys, saved, self._store.rank)
        states = [keys[key] for key in plan]
        self._pushes.wait_all(states)  # (an in-flight round still writes into its encoder)
        for state in states:
            state.key_encoder = None
            state.encoders = [None] * len(state.chunks)
            state.restored = plan[state.key]

    def _key_specs(self) -> list[dict[str, Any]]:
        return [
            checkpoint.key_spec(s.key, s.shape, s.dtype, s.codec.spec())
            for s in self._store.keys.values()
        ]

    def _manifest(self) -> dict[str, Any]:
        store = self._store
        optimizer = store.optimizer
        return {
            "pskv": __version__,
            "mode": store.mode,
            "num_workers": store.num_workers,
            "num_servers": store.num_servers,
            "optimizer": None
            if optimizer is None
            else {"name": optimizer.name, "params": dict(optimizer.params)},
            "keys": self._key_specs(),
        }

    def _call_replicas(self, call: SaveFields | LoadFields, what: str) -> None:
        """With replication: send the call to the server that answers for each shard, naming
        the shards (it writes or reads a part per shard; a load goes to every live server, as
        each holds backups to load too). Where a server is lost during the call, the call is
        sent again for its shards to their next live replica (every worker does the same, so
        that replica gathers all of them)."""
        store = self._store
        transport = store.transport
        deadline = store.deadline()
        plan = transport.shards_by_server()
        if isinstance(call, LoadFields):
            plan = {s: plan.get(s, []) for s in sorted({*plan, *transport.live_servers()})}
        retry = None
        while plan:
            requests = {
                server: transport.submit(
                    server,
                    dataclasses.replace(call, shards=shards, retry=retry),
                    what=f"{what} (server {server})",
                )
                for server, shards in plan.items()
            }
            retry = True
            moved: list[int] = []
            for server, request in requests.items():
                try:
                    request.wait(deadline)
                except ServerLostError:
                    if transport.is_lost(server) and plan[server]:
                        moved += plan[server]
                        continue
                    raise
            routes = transport.shards_by_server()
            plan = {}
            for shard in moved:
                server = next(s for s, shards in routes.items() if shard in shards)
                if transport.is_lost(server):
                    raise ServerLostError(
                        f"{what}: no live replica of server {shard}'s shard is left", server
                    )
                plan.setdefault(server, []).append(shard)

    def _call(
        self, call: SaveFields | LoadFields, local_error: BaseException | None, what: str
    ) -> None:
        """Send a collective SAVE or LOAD to every server and wait for all of them. With
        ``local_error`` (this worker could not do its part) the servers refuse the call for
        every worker, and this worker raises its own error."""
        store = self._store
        if local_error is not None:
            call.failure = f"{type(local_error).__name__}: {local_error}"[:2000]
        try:
            if store.options.replicas > 1:
                self._call_replicas(call, what)
            else:
                requests = [
                    store.transport.submit(s, call, what=f"{what} (server {s})")
                    for s in range(store.num_servers)
                ]
                wait_all(requests, store.options.timeout)
        except KVStoreError:
            if local_error is None:
                raise
        if local_error is not None:  # (the servers' error only repeats it)
            if isinstance(local_error, KVStoreError):  # (a lost worker stays a WorkerLostError)
                raise local_error
            raise CheckpointError(f"{what}: {local_error}") from local_error
