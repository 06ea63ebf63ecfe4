"""The test tiers in the junit report, and the one verdict over it.

Two halves that share the tier names:

- a pytest plugin (`pytest -p volute_testbed.junit`): every test marked `system`,
  `install` or `install_arm64` gets a junit property `tier=<marker>`, so the report
  alone says how many tests of each tier ran and how many were skipped;
- the verdict (`python -m volute_testbed.junit REPORT...`), used by ./run-tests on its
  reports (a full run has two: its serial phase's and its parallel phase's, which
  `--merge-into` also writes as one report) and by .ci/run on the reports of both its
  steps. It prints one line per tier,
  "<label>: <tier> tier: N executed, N skipped", then the count "N passed, N failed,
  N errors, N skipped", and exits 1 when the run must fail:
  - pytest exited non-zero (`--status`; 5 means it collected no tests);
  - a report is missing or unreadable;
  - any test failed or errored: an error (a broken fixture, a failed teardown) fails a
    run as a failure does, and is counted apart from failures;
  - with `--no-skips`, a test of a tier was skipped (an xfail counts as skipped);
  - a tier given with `--require` executed no test.

A test case counts once: failed if it has a failure, else an error if it has an error,
else skipped if skipped, else passed.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

TIERS = ("system", "install", "install_arm64")
OUTCOMES = ("passed", "failed", "errors", "skipped")
SHOWN_SKIPS = 10


# -- the pytest plugin ----------------------------------------------------------------------


def pytest_itemcollected(item: pytest.Item) -> None:
    for marker in TIERS:
        if item.get_closest_marker(marker) is not None:
            item.user_properties.append(("tier", marker))
            return


# -- the verdict ------------------------------------------------------------------------------


def outcome(case: ET.Element) -> str:
    kinds = {child.tag for child in case}
    if "failure" in kinds:
        return "failed"
    if "error" in kinds:
        return "errors"
    if "skipped" in kinds:
        return "skipped"
    return "passed"


def tier(case: ET.Element) -> str | None:
    for prop in case.iter("property"):
        if prop.get("name") == "tier":
            return prop.get("value")
    return None


class Tally:
    """Outcomes over every report, in total and per tier, and the skipped tier tests."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.tiers: dict[str, Counter[str]] = {}
        self.skipped: dict[str, list[str]] = {}

    def add(self, case: ET.Element) -> None:
        result = outcome(case)
        self.total[result] += 1
        name = tier(case)
        if name is None:
            return
        self.tiers.setdefault(name, Counter())[result] += 1
        if result == "skipped":
            test = f"{case.get('classname', '?')}::{case.get('name', '?')}"
            self.skipped.setdefault(name, []).append(test)

    def executed(self, name: str) -> int:
        counts = self.tiers.get(name, Counter())
        return counts["passed"] + counts["failed"] + counts["errors"]


def merge(reports: list[str], into: str) -> None:
    """Write every test suite of `reports` (those that can be read) into one report."""
    merged = ET.Element("testsuites")
    for path in reports:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue  # the verdict over `reports` says so
        merged.extend([root] if root.tag == "testsuite" else list(root.iter("testsuite")))
    ET.ElementTree(merged).write(into, encoding="utf-8", xml_declaration=True)


def verdict(
    reports: list[str],
    *,
    status: int | None = None,
    no_skips: bool = False,
    required: tuple[str, ...] = (),
    label: str = "run-tests",
    count_prefix: str = "",
) -> int:
    """Print the tier lines, the problems and the count; return the exit status."""

    def say(line: str = "", *, error: bool = False) -> None:
        print(line, file=sys.stderr if error else sys.stdout, flush=True)

    problems: list[str] = []
    if status == 5:
        problems.append("pytest collected no tests (exit 5)")
    elif status:
        problems.append(f"pytest exited {status}")
    tally = Tally()
    for path in reports:
        try:
            cases = list(ET.parse(path).getroot().iter("testcase"))
        except (OSError, ET.ParseError) as error:
            problems.append(f"no junit report at {path}: {error}")
            continue
        for case in cases:
            tally.add(case)
    if tally.total["failed"] or tally.total["errors"]:
        problems.append(
            f"{tally.total['failed']} tests failed and {tally.total['errors']} had errors"
        )
    for name in TIERS:
        counts = tally.tiers.get(name, Counter())
        if name == "install_arm64" and name not in required and not counts:
            continue
        say(f"{label}: {name} tier: {tally.executed(name)} executed, {counts['skipped']} skipped")
        if no_skips and counts["skipped"]:
            skipped = tally.skipped[name]
            more = " ..." if len(skipped) > SHOWN_SKIPS else ""
            shown = ", ".join(skipped[:SHOWN_SKIPS]) + more
            problems.append(f"{counts['skipped']} {name} tests were skipped: {shown}")
        if name in required and tally.executed(name) == 0:
            problems.append(f"the {name} tier did not run (0 {name} tests executed)")
    for problem in problems:
        say(f"{label}: FAIL: {problem}", error=True)
    say(count_prefix + ", ".join(f"{tally.total[kind]} {kind}" for kind in OUTCOMES))
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m volute_testbed.junit", description="The verdict over junit reports."
    )
    parser.add_argument("reports", nargs="+", metavar="REPORT", help="junit XML files")
    parser.add_argument("--status", type=int, help="pytest's exit status, if one ran")
    parser.add_argument(
        "--no-skips", action="store_true", help="fail if a system or install test was skipped"
    )
    parser.add_argument(
        "--require", action="append", default=[], choices=TIERS, help="a tier that must run"
    )
    parser.add_argument("--label", default="run-tests", help="prefix of the tier lines")
    parser.add_argument("--count-prefix", default="", help="prefix of the count line")
    parser.add_argument("--merge-into", metavar="REPORT", help="also write the reports as one")
    args = parser.parse_args(argv)
    if args.merge_into:
        merge(args.reports, args.merge_into)
    return verdict(
        args.reports,
        status=args.status,
        no_skips=args.no_skips,
        required=tuple(args.require),
        label=args.label,
        count_prefix=args.count_prefix,
    )


if __name__ == "__main__":
    sys.exit(main())
