"""Where things are: the checkout under test, and the interpreter the tests run with.

The container side runs what the host side runs: `PYTHON` is this very interpreter and
`SCRIPTS` the directory its environment installs console scripts into (a venv's bin/,
wherever that venv lives), never a path assumed inside the checkout. machine.py binds
the checkout and this environment (sys.prefix) into every machine at the same paths.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

# This package is installed editable from the checkout it serves (packaging/dev-setup).
CHECKOUT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
SCRIPTS = Path(sysconfig.get_path("scripts"))
