"""Integration tests: saves, loads, the manager, tiers and the tools end to
end through the public API, on every backend target (local, S3 on moto, MSC,
fsspec, memory) in the test process; stock DCP as the oracle where it can be."""
