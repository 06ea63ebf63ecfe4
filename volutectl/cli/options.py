"""Command-line options that several commands share, each defined once.

Imported by the click commands only: `volutectl deliver`'s hot path parses its own
arguments without click (volutectl.cli.deliver).
"""

from __future__ import annotations

import click

# Not click.Path(dir_okay=False): a directory given here is a config error (exit 78)
# that names it, from volutectl.config.settings, like every other unreadable config
# file. A bare click.Path() checks nothing, and lets the shell complete file names.
config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(),
    metavar="PATH",
    default=None,
    help="Config file to read (default: $VOLUTE_CONFIG, else /etc/volute/volutectl.toml).",
)
