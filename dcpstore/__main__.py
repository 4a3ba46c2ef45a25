"""``python -m dcpstore``: the ``dcpstore`` command, for where the venv's
``bin`` is not on ``PATH``. Imports no more than the console script does, so
``--help``, ``ls`` and ``gc`` still start without torch."""

import sys

from dcpstore._impl.cli import main

sys.exit(main())
