"""volutectl: bound concurrent agent turns and test runs on small hosts, with systemd.

This package's __init__ stays empty on purpose: `volutectl deliver` runs often and
must import nothing it does not need.
"""

__version__ = "0.1.0"
