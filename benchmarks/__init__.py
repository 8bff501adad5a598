"""The project's benchmarks, one module per question, each run from the repository root as
``python -m benchmarks.NAME`` (``--preset smoke`` in seconds, ``--preset full`` for the numbers
in ``docs/performance.md``). Processes a benchmark starts run its modules the same way
(:func:`benchmarks.common.module_command`, from :data:`benchmarks.common.REPO`)."""
