"""Logging setup: one format for every kvstore process, the level from ``KVSTORE_LOG_LEVEL``.

The library itself only creates loggers under ``kvstore`` and never prints; this module decides
where their records go, in one format for servers, workers and the launcher::

    2025-01-02 03:04:05,678 INFO [server 0] kvstore.server.server: server 0/2 serving ...

(time, level, the process's role in brackets, logger, message; the launcher forwards each
child's lines with a ``[server I]`` / ``[worker R]`` prefix in front of that).

* Entry points own their process: :func:`configure` (``kvstore-server``, role ``server I``,
  default INFO; ``kvstore-launch``, role ``launch``, default INFO) always installs the stderr
  handler on the ``kvstore`` logger.
* A worker is a library inside someone's application, so :func:`configure_worker` (called by
  :func:`kvstore.create`, role ``worker R``) keeps an application's logging setup: if
  ``KVSTORE_LOG_LEVEL`` is set, or the root logger has no handlers (the application configured
  no logging), kvstore installs its stderr handler with the level from the variable (default
  WARNING); otherwise kvstore adds no handler, its records propagate to the application's
  handlers, and the ``kvstore`` logger gets level WARNING unless the application gave it one.

Either way the handler sits on the ``kvstore`` logger only (never the root logger), with
``propagate`` off so that a record is not printed twice.
"""

from __future__ import annotations

import logging
import os
import sys

from kvstore.errors import did_you_mean

FORMAT = "%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"
"""The record format of every kvstore process; ``{role}`` is ``server I``, ``worker R`` or
``launch``."""

LOGGER = "kvstore"
WORKER_DEFAULT_LEVEL = "WARNING"


class _Handler(logging.StreamHandler):
    """kvstore's stderr handler; its own class so that a later call replaces only this one."""


def formatter(role: str) -> logging.Formatter:
    """The formatter of :data:`FORMAT` for a process with this role."""
    return logging.Formatter(FORMAT.format(role=role))


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The level names ``KVSTORE_LOG_LEVEL`` takes."""


def _level(default_level: str) -> tuple[int, str | None]:
    """The level from ``KVSTORE_LOG_LEVEL`` (or ``default_level``), and a complaint if unknown."""
    raw = os.environ.get("KVSTORE_LOG_LEVEL", "").strip().upper() or default_level
    level = logging.getLevelName(raw)
    if isinstance(level, int):
        return level, None
    return (
        logging.getLevelName(default_level),
        f"KVSTORE_LOG_LEVEL={raw!r} is not a log level{did_you_mean([raw], LEVELS)}; "
        f"levels: {', '.join(LEVELS)}; using {default_level}",
    )


def _install(role: str, default_level: str, *, keep_foreign: bool) -> None:
    logger = logging.getLogger(LOGGER)
    handler = _Handler(sys.stderr)
    handler.setFormatter(formatter(role))
    if keep_foreign:  # handlers an application put on the kvstore logger itself stay
        others = [h for h in logger.handlers if not isinstance(h, _Handler)]
    else:
        others = []
    logger.handlers[:] = [*others, handler]
    logger.propagate = False
    level, complaint = _level(default_level)
    logger.setLevel(level)
    if complaint:
        logger.warning("%s", complaint)


def configure(role: str, default_level: str = "WARNING") -> None:
    """Send ``kvstore`` logs to stderr in :data:`FORMAT`; level from ``KVSTORE_LOG_LEVEL``.

    For entry points (server, launcher), which own their process: replaces every handler of
    the ``kvstore`` logger. An unknown level name is reported (a warning) and
    ``default_level`` used.
    """
    _install(role, default_level, keep_foreign=False)


def configure_worker(role: str) -> None:
    """Route a worker's ``kvstore`` logs without clobbering the application's logging.

    The rule (see the module docstring): with ``KVSTORE_LOG_LEVEL`` set, or no handler on the
    root logger, install kvstore's stderr handler (level from the variable, default WARNING);
    otherwise let records propagate to the application's handlers at level WARNING, or at the
    level the application set on the ``kvstore`` logger. Safe to call again (every
    :func:`kvstore.create` does): it replaces its own handler, never the application's.
    """
    if os.environ.get("KVSTORE_LOG_LEVEL", "").strip() or not logging.getLogger().handlers:
        _install(role, WORKER_DEFAULT_LEVEL, keep_foreign=True)
        return
    logger = logging.getLogger(LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(handler)
    logger.propagate = True
    if logger.level == logging.NOTSET:
        # Without this the kvstore loggers would inherit the application's level, and an
        # application debugging itself at DEBUG would get every kvstore round in its logs.
        logger.setLevel(WORKER_DEFAULT_LEVEL)
