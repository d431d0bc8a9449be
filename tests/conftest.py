import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Prefect and Hugging Face state of the test process stays out of the user's home.
# Each xdist worker its own (the workers inherit the environment of the process that starts them).
if "PREFECT_HOME" not in os.environ or "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(
        prefix=f"llmops-test-prefect-{os.environ.get('PYTEST_XDIST_WORKER', '')}"
    )
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER" in os.environ:
    # Two workers on 2 cores: torch's OpenMP threads spin while they wait for work, and two processes that each
    # spin on both cores run 5 times slower than one (2 threads of a small matmul loop: 1.6 s alone, 8.3 s each
    # side by side, 2.9 s each with PASSIVE). Passive waiting changes no result, only what idle threads cost.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def cpu_tiny_store(tmp_path_factory):
    """One artifact store for the cpu-tiny releases of several test modules: each training runs once in the
    session and later modules' releases of the same model are cache hits (the stages' own tests are elsewhere)."""
    return tmp_path_factory.mktemp("cpu-tiny-store")


@pytest.fixture(scope="session")
def shared_prefect(tmp_path_factory):
    """One real Prefect server (sqlite) for the session's releases; see tests/servers.py SHARED_PREFECT."""
    from tasks.platform.local_stack import start_prefect
    from tasks.platform.ports import free_port
    from tests.servers import SHARED_PREFECT

    folder = tmp_path_factory.mktemp("prefect-server")
    server = start_prefect(folder / "home", free_port(), folder)
    SHARED_PREFECT["PREFECT_API_URL"] = server.url
    yield server.url
    SHARED_PREFECT.clear()
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _stop_prefect_at_the_end():
    yield
    from flows.cli import stop_prefect_services

    stop_prefect_services()


# The slowest modules, slowest first (seconds on 2 cores with two workers, build/junit.xml of the fresh-clone CI run
# of 7a55cd0, 2026-11-28): `make test`'s workers take whole modules in this order, so the long ones start at once and
# the short ones fill the end. In that run the tests summed to 2,719 s and pytest took 1,380 s: the two workers were
# busy to the end. A module's time varies by a minute or two between runs of one commit. test_serving goes first
# although test_release took longer: with test_attach it is one unit of work (SHARE_A_WORKER below), 1,130 s.
SLOWEST_FIRST = (
    "integration/test_serving.py",  # 722
    "integration/test_release.py",  # 747
    "integration/test_service.py",  # 492
    "integration/test_attach.py",  # 408
    "integration/test_approval.py",  # 103
    "integration/test_quality_gate.py",  # 85
    "unit/test_cli.py",  # 36
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        module = item.path.relative_to(ROOT / "tests").as_posix()
        return SLOWEST_FIRST.index(module) if module in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: a module's tests keep their order


# Modules whose releases use the worker's cpu_tiny_store: one unit of `make test`'s --dist=loadfile, so one worker
# runs them one after the other and test_attach's release finds cpu-tiny trained by test_serving's (a module each,
# test_attach ran on the other worker about one run in two and trained it again: base model, training, merge).
# Not xdist's loadgroup: it marks a group in item._nodeid, which pytest 9 no longer reads (nodes.py:289-292).
SHARE_A_WORKER = {"tests/integration/test_serving.py": "cpu-tiny", "tests/integration/test_attach.py": "cpu-tiny"}


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModulesSharingAStore(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return SHARE_A_WORKER.get(module, module)

    return ModulesSharingAStore(config, log)
