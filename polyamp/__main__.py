"""``python -m polyamp``: the same as the ``polyamp`` command."""

import sys

from polyamp.cli import main

sys.exit(main())
