"""Value prefetch: pushes that also ask for the round's value, which the next pull takes.

In ``dist_sync``, once a key's push was followed by a pull, its later pushes are PUSHPULLs
whose replies the client keeps (``KeyState.prefetched``) until the pull: the values start
coming back as each chunk's round completes, while the rest of a long list is still being
encoded, instead of after ``pull`` is called, and a chunk costs one request instead of two. The
pull that follows only lands them in ``out``. A push whose values were not pulled before the
key's next push turns this off for the key until a pull follows a push again, so jobs that push
without pulling do not receive values they never read. ``dist_async`` never prefetches (a pull
reads the value as of the pull), nor do codecs with several round trips per step (their last
reply carries the codec's factors, not the value).
"""

from __future__ import annotations

from kvstore.worker.keys import KeyState
from kvstore.worker.request import Request


def asks_for_values(state: KeyState, mode: str) -> bool:
    """Whether the push about to be sent for ``state`` should ask for the round's values."""
    forget_unpulled(state)
    # (a multi-round push's last reply carries the codec's factors, not the value)
    multi_round = state.codec.round_trips > 1
    return mode != "dist_async" and state.pulled_after_push and not multi_round


def pushed(state: KeyState, prefetched: list[Request] | None) -> None:
    """A push of ``state`` was sent; ``prefetched``: its requests, if it asked for the values."""
    if prefetched is not None:
        state.prefetched = prefetched
    state.pushed_since_pull = True


def take(state: KeyState) -> list[Request] | None:
    """For a pull of ``state``: the requests of the last push, if it asked for the values
    (None: pull them). A pull that follows a push makes the next push ask for them."""
    prefetched, state.prefetched = state.prefetched, None
    if state.pushed_since_pull and prefetched is None:
        state.pulled_after_push = True  # the next push asks for the values
    state.pushed_since_pull = False
    return prefetched


def forget_unpulled(state: KeyState) -> None:
    """Before a new push of ``state``: drop the last push's values if no pull took them,
    and stop asking for them until a pull follows a push again."""
    if state.prefetched is not None:
        state.prefetched = None
        state.pulled_after_push = False


def reset(state: KeyState) -> None:
    """Forget the values of the last push and that it was not pulled: before a pushpull (a
    push and its own pull) and after a checkpoint load (values from before it)."""
    forget_unpulled(state)
    state.pushed_since_pull = False
