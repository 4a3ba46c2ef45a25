"""BENCHMARKS.md and RELIABILITY.md against the evidence: committed result
files, the tests the suite collects, the recorded kill counts."""
