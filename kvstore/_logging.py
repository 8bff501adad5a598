"""Logging setup for entry points. The library itself only creates loggers and never prints."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"


def configure(role: str, default_level: str = "WARNING") -> None:
    """Send ``kvstore`` logs to stderr with a role prefix; level from ``KVSTORE_LOG_LEVEL``.

    Called once by each entry point (server, launcher); a no-op for the level if the variable
    holds an unknown name (the default is used and a warning is logged).
    """
    raw = os.environ.get("KVSTORE_LOG_LEVEL", "").strip().upper() or default_level
    level = logging.getLevelName(raw)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(role=role)))
    root = logging.getLogger("kvstore")
    root.handlers[:] = [handler]
    root.propagate = False
    if isinstance(level, int):
        root.setLevel(level)
    else:
        root.setLevel(default_level)
        root.warning("KVSTORE_LOG_LEVEL=%r is not a log level; using %s", raw, default_level)
