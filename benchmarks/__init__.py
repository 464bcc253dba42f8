"""distrain's benchmark suite: ``python -m benchmarks.run`` (see ``docs/performance.md``)."""
