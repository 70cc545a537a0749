"""Shared fixtures: tiny real-architecture models (seeded) and the path to ../shared real data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")

SHARED = Path(__file__).resolve().parents[2] / "shared"
REALDATA = SHARED / "realdata"


@pytest.fixture(scope="session")
def realdata() -> Path:
    # Real material must be present: a missing ../shared is a failure, never a skip.
    assert REALDATA.is_dir(), f"missing real test data at {REALDATA}"
    return REALDATA
