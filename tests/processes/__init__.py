"""Process-level behaviour: several real ranks, SIGKILL at every point of a
save, concurrent writers, hung storage, a full disk, the process engine's
checkpoint process, and resources over a long run (soak)."""
