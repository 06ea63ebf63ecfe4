"""A turn's effects have one interpreter: volutectl/gate/turns.py's `Turns.apply` is the
one place that steps a turn (volutectl/gate/lifecycle.py's `step`) and carries out what
the step asks for; volutectl/gate/liveness.py hands `Turns` events and calls its
methods, and touches none of its fields. What each effect does is tested through the
gate (test_gate_loop.py, test_gate_turns.py, test_gate_leftovers.py); this says where."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from volutectl.gate import liveness
from volutectl.gate.turns import Turns

PACKAGE = Path(__file__).resolve().parents[2] / "volutectl"


def _calls_of_step(path: Path) -> list[str]:
    """The functions in `path` that call lifecycle's `step`."""
    tree = ast.parse(path.read_text())
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "step"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "lifecycle"
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{function.name}")
    return found


def test_only_turns_apply_steps_a_turn() -> None:
    steps = [where for path in sorted(PACKAGE.rglob("*.py")) for where in _calls_of_step(path)]
    assert steps == ["gate/turns.py:apply"]


def test_liveness_touches_no_field_of_turns_only_its_methods() -> None:
    tree = ast.parse(inspect.getsource(liveness))
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "turns"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"  # self.turns, not self.settings.turns
    }
    methods = {name for name, member in vars(Turns).items() if inspect.isfunction(member)}
    assert used, "liveness tells Turns what it learnt"
    assert used <= methods, sorted(used - methods)
