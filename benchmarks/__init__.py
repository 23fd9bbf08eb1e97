"""The benchmark suite, run from the repository root as modules: ``python -m benchmarks.<name>``
(``make bench`` = ``python -m benchmarks.run_all``). Shared pieces live in :mod:`benchmarks.common`."""
