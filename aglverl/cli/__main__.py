"""``python -m aglverl.cli``: the ``aglverl`` command."""

import sys

from .main import main

sys.exit(main())
