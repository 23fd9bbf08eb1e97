"""GPU tests (marker ``gpu``): skipped without CUDA. A package, so its module names do not clash with tests/unit."""
