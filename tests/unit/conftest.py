"""Fixtures shared by the unit tests' modules."""

from __future__ import annotations

import pytest

from localai_tw.worker.staging import StagingRoots


@pytest.fixture
def roots(tmp_path):
    """Empty models, data and staging directories for a worker's file staging."""
    for name in ("models", "data", "staging"):
        (tmp_path / name).mkdir()
    return StagingRoots(str(tmp_path / "models"), str(tmp_path / "data"),
                        str(tmp_path / "staging"))
