"""The two lines a launcher and the servers it starts exchange over the server's stdio.

A server prints :data:`READY_PREFIX` and its address on stdout once it serves (see
``kvstore-server``); the launcher reads it there. To stop a server when the job is done, the
launcher writes :data:`STOP_REQUEST` to the server's stdin and closes it: the server stops
through its own shutdown, whatever sits between the two (``ssh`` and ``srun`` pass stdin on,
but turn signals into something else). A server started with ``--stop-on-stdin-eof`` whose
stdin closes without the request knows its launcher is gone, and stops too.
"""

from __future__ import annotations

READY_PREFIX = "KVSTORE_READY"
"""The start of a server's ready line, ``KVSTORE_READY tcp://HOST:PORT``."""

STOP_REQUEST = b"stop\n"
"""What a launcher writes to a server's stdin, before closing it, to stop the server."""
