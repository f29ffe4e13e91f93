"""Shared test fixtures.

The real trace fixtures live in ``../shared/fixtures/`` beside the checkout (read in place,
never copied). In a user's own clone that folder is absent and those tests skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = Path(
    os.environ.get("DMUON_SHARED_FIXTURES", REPO_ROOT.parent / "shared" / "fixtures")
)


@pytest.fixture(scope="session")
def shared_fixtures() -> Path:
    """Path of ``../shared/fixtures``; skips the test where it is absent."""
    if not SHARED_FIXTURES.is_dir():
        pytest.skip(
            f"shared fixtures not found at {SHARED_FIXTURES} (set DMUON_SHARED_FIXTURES "
            "to the folder holding nccl/, nsys/, flight_recorder/)"
        )
    return SHARED_FIXTURES
