"""How `make test` spreads the suite over its workers (tests/conftest.py), and what tests/README.md says of it: the
modules that share the cpu-tiny store
are one unit of work, so one worker runs them and the second finds the first's training; the modules it orders and
groups by path still exist (a renamed module would fall silently to the end of the queue, or train twice); and
tests/cpu_by_kind.py, which says where the suite's CPU goes, counts a real command's processes by kind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, SHARE_A_WORKER, SLOWEST_FIRST

MODULE = """import os
from pathlib import Path


def test_where_it_ran():
    Path({out!r}).write_text(os.environ["PYTEST_XDIST_WORKER"])
"""


def test_the_modules_it_orders_and_groups_exist():
    named = [ROOT / "tests" / module for module in SLOWEST_FIRST] + [ROOT / module for module in SHARE_A_WORKER]
    assert [str(path) for path in named if not path.is_file()] == []


def test_the_modules_sharing_a_store_run_on_one_worker(tmp_path: Path):
    """A real `pytest -n 3 --dist=loadfile` of three modules under the suite's paths, with the project's scheduler hook:
    two units of work (the pair, the third module), the third worker shut down at once; without the hook, three
    units, one to each worker."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('project_conftest', {str(ROOT / 'tests' / 'conftest.py')!r})\n"
        "project = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(project)\n"
        "pytest_xdist_make_scheduler = project.pytest_xdist_make_scheduler\n"
    )
    modules = [*SHARE_A_WORKER, "tests/integration/test_release.py"]
    for module in modules:
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text(MODULE.format(out=str(tmp_path / f"{Path(module).stem}.worker")))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PREFECT_HOME"))}
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist=loadfile", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    workers = {Path(module).stem: (tmp_path / f"{Path(module).stem}.worker").read_text() for module in modules}
    assert workers["test_serving"] == workers["test_attach"] != workers["test_release"], workers


def test_every_test_module_says_what_it_proves_in_the_tests_readme():
    readme = (ROOT / "tests" / "README.md").read_text()
    modules = sorted(path.name for path in (ROOT / "tests").glob("*/test_*.py"))
    assert [name for name in modules if f"`{name}`" not in readme] == []


def test_cpu_by_kind_counts_each_process_the_command_started_by_its_kind():
    """A real command that spins for a second of CPU: it is counted to its kind (one of `--kind`, so that no process
    of a test running beside this one matches it) with about that second, and the exit code is the command's; a
    process that spent its second before the command started and sleeps through it is not counted."""
    import psutil

    spin = "import time, sys\nt = time.process_time()\nwhile time.process_time() - t < 1: pass\n"
    earlier = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(30)", "probe-3f9c1e-earlier"])
    try:
        deadline = time.monotonic() + 30
        while sum(psutil.Process(earlier.pid).cpu_times()[:2]) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        command = [sys.executable, "-c", spin + "sys.exit(3)", "probe-3f9c1e"]
        kinds = ["--kind", "probe-3f9c1e-earlier=earlier", "--kind", "probe-3f9c1e=probe"]
        result = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "cpu_by_kind.py"), "--every", "0.1", *kinds, "--", *command],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        earlier.kill()
    assert result.returncode == 3, result.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in result.stdout.splitlines()[3:]}
    count, cpu_s, _ = rows["probe"]
    assert int(count) == 1 and 0.8 <= float(cpu_s) <= 1.3
    assert "earlier" not in rows


def test_cpu_by_kind_refuses_a_kind_without_its_name():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "cpu_by_kind.py"), "--kind", "probe", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--kind 'probe': expected PATTERN=NAME" in result.stderr
