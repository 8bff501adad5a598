"""numba, started once per process before any compiled function is defined, compiled or loaded.

numba builds its CPU target context the first time a function is decorated, compiled or loaded
from its cache, and building it races with a compile on another thread: a decorator takes the
context's lock and then numba's compiler lock, a ``cfunc`` compile takes them the other way
round, and two threads doing both at once deadlock (numba 0.68: a codec kernel module imported
on one thread while the zero-copy sender compiled its free function on another). Importing this
module builds the context and loads its registries, under the compiler lock; Python's import
lock makes any other thread that imports it wait until that is done, and after it both locks
are only ever held briefly. So every module that defines numba functions imports this one
(``tests/unit/test_numba_started.py`` checks), and code that compiles one elsewhere imports it
first.
"""

from __future__ import annotations

from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import cpu_target

with global_compiler_lock:
    cpu_target.target_context.refresh()
