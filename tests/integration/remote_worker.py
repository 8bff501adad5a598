"""A worker process that a test drives line by line, to kill or stop it at a chosen moment.

``python remote_worker.py``, with the job's ``KVSTORE_*`` variables in its environment, reads
one JSON command per line from stdin and answers each with one JSON line on stdout:
``{"ok": result}``, or ``{"error": class name, "rank": the lost rank or null, "message": ...}``.

Commands (``keys``: a list of str keys; values: lists of floats, as float32 arrays of the
key's length):

- ``{"op": "create", "mode": M, "retry_duplicate": S}``: ``kvstore.create(M)``, retrying for up
  to S seconds while a server still holds this rank (its previous holder not yet declared lost);
- ``{"op": "init"|"push", "keys": [...], "values": [[...], ...]}``;
- ``{"op": "pull", "keys": [...], "length": L}``: the pulled values, as lists;
- ``{"op": "barrier"}``, ``{"op": "set_optimizer", "name": N, "params": {...}}``,
  ``{"op": "close"}``, ``{"op": "exit"}``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

import kvstore


def _create(mode: str, retry_duplicate: float) -> Any:
    deadline = time.monotonic() + retry_duplicate
    while True:
        try:
            return kvstore.create(mode)
        except kvstore.ConfigError as exc:
            if "already connected" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _run(kv: Any, command: dict[str, Any]) -> tuple[Any, Any]:
    op = command["op"]
    if op == "create":
        return _create(command["mode"], command.get("retry_duplicate", 0.0)), None
    keys = command.get("keys", [])
    values = [np.asarray(v, np.float32) for v in command.get("values", [])]
    if op == "init":
        kv.init(keys, values)
    elif op == "push":
        kv.push(keys, values)
    elif op == "pull":
        outs = [np.zeros(command["length"], np.float32) for _ in keys]
        kv.pull(keys, out=outs)
        return kv, [o.tolist() for o in outs]
    elif op == "barrier":
        kv.barrier()
    elif op == "set_optimizer":
        kv.set_optimizer(command["name"], **command.get("params", {}))
    elif op == "close":
        kv.close()
    else:
        raise ValueError(f"unknown command {op!r}")
    return kv, None


def main() -> int:
    kv = None
    print(json.dumps({"ok": "started"}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            break
        try:
            kv, result = _run(kv, command)
            answer: dict[str, Any] = {"ok": result}
        except Exception as exc:
            answer = {
                "error": type(exc).__name__,
                "rank": getattr(exc, "rank", None),
                "message": str(exc),
            }
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
