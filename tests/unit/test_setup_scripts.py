"""The setup scripts must not fail at random: no pipeline whose reader can exit before its writer."""

import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [*sorted((ROOT / "infra").rglob("*.sh")), ROOT / "Makefile", ROOT / ".ci" / "run"]
# A reader that may stop reading early: head, grep -q/-m, sed NNq, awk ... exit.
EARLY_READER = re.compile(r"\|\s*(head\b|grep\b[^|]*\s-[a-zA-Z]*[qm]|sed\b[^|]*\d+q|awk\b[^|]*\bexit\b)")


def test_glibc_detection_succeeds_50_times_in_a_row():
    expected_version = platform.libc_ver()[1]
    outcomes = [
        subprocess.run(["bash", str(ROOT / "infra/local/platform.sh")], capture_output=True, text=True)
        for _ in range(50)
    ]
    failures = [(o.returncode, o.stderr) for o in outcomes if o.returncode != 0]
    assert not failures, failures[:3]
    versions = {o.stdout.split()[1] for o in outcomes}
    assert versions == {expected_version}


def test_no_script_pipes_into_a_reader_that_may_exit_early():
    risky = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in SCRIPTS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if not line.lstrip().startswith("#") and EARLY_READER.search(line)
    ]
    assert not risky, risky
