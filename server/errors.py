"""The exception a request handler raises to refuse a request."""

from __future__ import annotations

from kvstore.errors import ErrorCode


class RequestError(Exception):
    """A request the server refuses; becomes an ERROR reply with ``code`` (and, for
    ``WORKER_LOST``, the lost worker's rank)."""

    def __init__(self, code: ErrorCode, message: str, lost_rank: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.lost_rank = lost_rank


__all__ = ["RequestError"]
