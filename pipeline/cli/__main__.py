"""``python -m pipeline.cli``: the ``sluice`` command."""

import sys

from pipeline.cli import main

sys.exit(main())
