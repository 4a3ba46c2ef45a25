"""The benchmark harness (``dcpstore bench``, benchmarks/) on small sizes, and
who may import whom around it."""
