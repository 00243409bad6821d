"""The test suite itself stays within a CI machine's disk."""

from __future__ import annotations

import pytest


def test_a_passed_tests_folder_is_removed(pytestconfig: pytest.Config):
    # The SmolLM2 and paper-rehearsal tests leave about 1 GB each in tmp_path; kept for every test of the
    # last three sessions, they filled a CI disk (ENOSPC in unrelated tests). A failed test's folder stays.
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"
