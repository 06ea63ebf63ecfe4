"""Where things are: the checkout under test, and the interpreter the tests run with."""

from __future__ import annotations

import sys
from pathlib import Path

# This package is installed editable from the checkout it serves (packaging/dev-setup).
CHECKOUT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
