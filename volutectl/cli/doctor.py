"""`volutectl doctor`: print volutectl/host/doctor.py's checks, as lines or one JSON object."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from volutectl.cli.options import config_option
from volutectl.host.doctor import exit_code, run_checks
from volutectl.visible import visible


@click.command("doctor")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
def doctor_command(config_path: str | None, as_json: bool) -> int:
    """Say which protections take effect on this host, and what to change.

    Exits 78 if the config is invalid or a mind fails preflight, 69 if the systemd
    manager is out of reach, else 0 (warnings included).
    """
    checks = run_checks(config_path)
    code = exit_code(checks)
    if as_json:
        document = {"exit_code": code, "checks": [asdict(check) for check in checks]}
        click.echo(json.dumps(document, indent=2))
    else:
        for check in checks:
            click.echo(visible(check.line()))  # paths, users, preflight's words: shown
    return code
