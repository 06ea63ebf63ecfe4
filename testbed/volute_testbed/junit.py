"""A pytest plugin for ./run-tests: tags each test's junit record with its tier.

Every test marked `system`, `install` or `install_arm64` gets a junit property
`tier=<marker>`, so ./run-tests can count, from the report alone, how many tests of
each tier ran and how many were skipped, and fail a run in which the system tier
did not run. Loaded with `-p volute_testbed.junit`.
"""

from __future__ import annotations

import pytest

TIER_MARKERS = ("system", "install", "install_arm64")


def pytest_itemcollected(item: pytest.Item) -> None:
    for marker in TIER_MARKERS:
        if item.get_closest_marker(marker) is not None:
            item.user_properties.append(("tier", marker))
            return
