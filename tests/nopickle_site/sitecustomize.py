"""Installs the no-pickle guard (tests/helpers/nopickle.py) at interpreter start-up when SLUICE_NO_PICKLE_LOG is set: a test
puts this folder first on a subprocess's PYTHONPATH to guard that process from its first import on."""

import os
import sys

if os.environ.get("SLUICE_NO_PICKLE_LOG"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.helpers import nopickle

    nopickle.install_from_env()
