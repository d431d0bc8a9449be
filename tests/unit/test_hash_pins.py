"""Hash-pinned installs: every environment installs only files whose sha256 infra/hashes/ lists, those lists are the
ones of the pins (a pin changed without them is refused), and pip refuses a file whose hash was not pinned."""

import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("pin_hashes", ROOT / "infra" / "pin_hashes.py")
assert SPEC is not None and SPEC.loader is not None
pin_hashes = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(pin_hashes)

SETUP_SCRIPTS = sorted((ROOT / "infra" / "local").glob("*.sh"))


def pinned_with_hashes(text: str) -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    pin: tuple[str, str] | None = None
    for line in text.splitlines():
        if match := re.match(r"^(\S+)==(\S+) \\$", line):
            pin = (match[1], match[2])
            found[pin] = []
        elif match := re.match(r"^    --hash=sha256:([0-9a-f]{64})( \\)?$", line):
            assert pin is not None
            found[pin].append(match[1])
        else:
            assert line.startswith("#"), line
    return found


def test_every_environment_installs_only_the_files_its_pins_hash():
    assert set(pin_hashes.environments()) == {"aiperf", "compat", "cpu", "lmeval", "perf-analyzer", "pip", "vllm"}
    checked = subprocess.run(
        [sys.executable, ROOT / "infra" / "pin_hashes.py", "--check"], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr
    for environment in pin_hashes.environments():
        hashed = pinned_with_hashes(pin_hashes.hash_file(environment).read_text())
        assert list(hashed) == pin_hashes.pins(pin_hashes.pin_file(environment))
        assert all(hashed.values()), [pin for pin, hashes in hashed.items() if not hashes]
    # the local torch CPU wheel (not on PyPI) is pinned to the one file this machine installs
    assert len(pinned_with_hashes(pin_hashes.hash_file("cpu").read_text())[("torch", "2.13.0+cpu")]) == 1
    # no pip call of a setup script installs or downloads without --require-hashes, but the project's own editable one
    unchecked = [
        f"{script.name}: {line.strip()}"
        for script in SETUP_SCRIPTS
        for line in script.read_text().replace("\\\n", " ").splitlines()
        if re.search(r"-m pip (install|download)", line) and "--require-hashes" not in line and " -e ." not in line
    ]
    assert not unchecked, unchecked


def test_a_pin_changed_without_its_hashes_is_refused(tmp_path):
    infra = tmp_path / "infra"
    (infra / "hashes").mkdir(parents=True)
    shutil.copy(ROOT / "infra" / "pin_hashes.py", infra)
    shutil.copy(ROOT / "infra" / "constraints-pip.txt", infra)
    shutil.copy(ROOT / "infra" / "hashes" / "pip.txt", infra / "hashes")
    check = [sys.executable, infra / "pin_hashes.py", "--check", "pip"]
    assert subprocess.run(check, capture_output=True).returncode == 0
    (infra / "constraints-pip.txt").write_text("pip==26.2\n")
    refused = subprocess.run(check, capture_output=True, text=True)
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        "pin_hashes: error: infra/hashes/pip.txt does not match infra/constraints-pip.txt: "
        "run `python3 infra/pin_hashes.py pip`"
    )


def make_wheel(folder: Path, name: str, version: str, body: str) -> Path:
    """The smallest wheel pip installs: a module, METADATA, WHEEL and RECORD."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}.py", body)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def test_pip_refuses_a_file_whose_hash_is_not_the_pinned_one(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "llmops_pinned_probe", "1.0+local", "ANSWER = 42\n")
    hashes = pin_hashes.local_hashes("llmops-pinned-probe", "1.0+local", [wheels])  # a release PyPI has not
    assert len(hashes) == 1

    def install(requirements: str) -> subprocess.CompletedProcess:
        (tmp_path / "requirements.txt").write_text(requirements)
        shutil.rmtree(tmp_path / "target", ignore_errors=True)
        return subprocess.run(
            [
                *(sys.executable, "-m", "pip", "install", "--isolated", "--disable-pip-version-check", "--no-index"),
                *("--find-links", wheels, "--no-deps", "--require-hashes", "--target", tmp_path / "target"),
                *("-r", tmp_path / "requirements.txt"),
            ],
            capture_output=True,
            text=True,
        )

    pinned = f"llmops_pinned_probe==1.0+local --hash=sha256:{hashes[0]}\n"
    assert install(pinned).returncode == 0
    assert (tmp_path / "target" / "llmops_pinned_probe.py").read_text() == "ANSWER = 42\n"
    tampered = install(pinned.replace(hashes[0], hashes[0][::-1]))
    assert tampered.returncode == 1
    assert "THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE" in tampered.stderr
    assert not (tmp_path / "target" / "llmops_pinned_probe.py").exists()
    unpinned = install("llmops_pinned_probe==1.0+local\n")
    assert unpinned.returncode == 1 and "Hashes are required in --require-hashes mode" in unpinned.stderr
