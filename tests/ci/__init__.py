"""The CI's own plumbing: what .ci/run installs and how the suites skip
without it, and scripts/gpu-check.sh without a GPU."""
