"""A run that rewrites golden files fails, so every update is reviewed before a green run."""

import pytest

from tests import goldens


def test_a_rewritten_golden_fails_the_run_that_wrote_it(tmp_path, monkeypatch):
    golden = tmp_path / "golden" / "config.pbtxt"
    golden.parent.mkdir()
    golden.write_text("old\n")
    monkeypatch.setattr(goldens, "UPDATE", True)
    with pytest.raises(pytest.fail.Exception, match="rewrote golden"):
        goldens.matches_golden(golden, "new\n")
    assert golden.read_text() == "new\n"
    goldens.matches_golden(golden, "new\n")  # the next run, with nothing to rewrite, passes


def test_a_differing_golden_fails_without_update(tmp_path):
    golden = tmp_path / "config.pbtxt"
    golden.write_text("reviewed\n")
    with pytest.raises(AssertionError, match="differs from what is rendered now"):
        goldens.matches_golden(golden, "changed\n")
    assert golden.read_text() == "reviewed\n"
