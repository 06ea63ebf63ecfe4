"""docs/protocol.schema.json for the tests: each message's JSON Schema, by its name.

Shared by tests/unit/test_protocol_schema.py (the schemas against the message classes)
and tests/system/test_raw_client.py (the real gate's replies against the schemas).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

CHECKOUT = Path(__file__).resolve().parents[1]
SCHEMA_FILE = CHECKOUT / "docs" / "protocol.schema.json"
DOC_FILE = CHECKOUT / "docs" / "protocol.md"


@functools.cache
def document() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())
    return loaded


def definitions() -> dict[str, dict[str, Any]]:
    defs: dict[str, dict[str, Any]] = document()["$defs"]
    return defs


@functools.cache
def validator(name: str) -> Draft202012Validator:
    """A validator for the definition `name` (a message's class name, or Request, Reply,
    Event), resolving its references within the same document."""
    doc = document()
    schema = {"$schema": doc["$schema"], "$defs": doc["$defs"], "$ref": f"#/$defs/{name}"}
    return Draft202012Validator(schema)


def problems(name: str, instance: object) -> list[str]:
    """Why `instance` is not a valid `name`, one line each; [] if it is."""
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '(the message)'}: {error.message}"
        for error in validator(name).iter_errors(instance)
    ]


def is_valid(name: str, instance: object) -> bool:
    return bool(validator(name).is_valid(instance))
