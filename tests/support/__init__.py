"""What the tests share: fixtures' backends, fault injection, crash and
multi-rank launchers, oracles, the framework harnesses, and the scripts
child processes run (``python -m tests.support.NAME`` from the repository
root). Imported by full name, ``from tests.support import faults``; nothing
here is collected by pytest."""
