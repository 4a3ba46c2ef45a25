"""Unit tests: one piece of the package's logic at a time, in one process
(options, read planning, record format, checksums, the restricted unpickler,
the commit session, the storage kit), and the package's shape itself (its
layered import graph, its public API)."""
