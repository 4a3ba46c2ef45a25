"""Installs a crash run's storage hook in the process engine's checkpoint
process (tests/support/crashkit.py): Python imports this module at start-up in
every process whose ``PYTHONPATH`` holds this directory -- a crash child
puts it there for its checkpoint process only -- and it does something
only where ``DCPSTORE_CRASH_HOOK`` is set (faults.SharedEvents.environment)."""

import os

if os.environ.get("DCPSTORE_CRASH_HOOK"):
    from tests.support import faults

    faults.install_shared_hook()
