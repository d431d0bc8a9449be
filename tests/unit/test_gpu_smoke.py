"""benchmarks/gpu_smoke.py (`make gpu-smoke`) where no GPU is: it refuses without one, its GPU settings validate,
its carried bitsandbytes wheel still installs once slimmed, and its steps run on the CPU (--allow-cpu) through the
project's own stage code: a base, a LoRA adapter, evaluate, merge, and the Python-backend model's answers equal to
evaluate's."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "benchmarks" / "gpu_smoke.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "infra" / "gpu"))

import gpu_smoke  # noqa: E402
import slim_wheel  # noqa: E402


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SMOKE), "--out", str(tmp_path / "smoke.json")], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 2
    assert "no CUDA GPU visible to torch" in done.stderr and "--allow-cpu" in done.stderr
    assert not (tmp_path / "smoke.json").exists()


def test_the_gpu_settings_are_a_valid_cuda_profile():
    profile = gpu_smoke.smoke_profile(True, [])
    assert profile.hardware.accelerator == "cuda" and profile.hardware.compute_dtype == "bfloat16"
    assert profile.train.bf16 and profile.base_model.tiny.hidden_size == 1024
    assert gpu_smoke.smoke_profile(False, []) == gpu_smoke.smoke_profile(False, [])  # the CPU run: cpu-tiny as is
    assert gpu_smoke.smoke_profile(False, []).hardware.accelerator == "cpu"


def test_a_slimmed_wheel_installs_without_what_it_dropped(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    files = {
        "demo/__init__.py": b"VALUE = 1\n",
        "demo/libdemo_cuda118.so": b"x" * 4096,
        "demo/libdemo_cuda130.so": b"y" * 16,
        "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
        "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "demo-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("demo-1.0.dist-info/RECORD", record)
    before, after = slim_wheel.slim(wheel, ["demo/libdemo_*.so"], ["libdemo_cuda130.so"])
    assert after < before
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert "demo/libdemo_cuda118.so" not in names and "demo/libdemo_cuda130.so" in names
        assert "libdemo_cuda118" not in zf.read("demo-1.0.dist-info/RECORD").decode()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--target",
            str(tmp_path / "site"),
            str(wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "demo" / "libdemo_cuda130.so").is_file()
    assert not (tmp_path / "site" / "demo" / "libdemo_cuda118.so").exists()


def test_the_carried_wheels_are_pinned_like_the_cpu_stack():
    """What the smoke carries is the project's own training stack: each package that the CPU environment also pins
    has the same version there (infra/constraints-cpu.txt)."""
    pins = dict(
        line.lower().replace("_", "-").split("==")
        for line in (ROOT / "infra" / "constraints-cpu.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    carried = [
        line.lower().replace("_", "-").split("==")
        for line in (ROOT / "infra" / "gpu" / "smoke-wheels.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    ]
    shared = [(name, version) for name, version in carried if name in pins]
    assert {"llamafactory", "transformers", "peft", "trl", "datasets", "bitsandbytes"} <= {n for n, _ in shared}
    assert [(n, v) for n, v in shared if pins[n] != v] == []


def test_the_smoke_runs_its_steps_on_the_cpu(tmp_path):
    """The steps that need no GPU-only package, shortened: a 20-step pretrain and 10 LoRA steps."""
    out = tmp_path / "smoke.json"
    command = [sys.executable, str(SMOKE), "--allow-cpu", "--work", str(tmp_path / "work"), "--out", str(out)]
    command += ["--skip", "qlora", "--skip", "nodes", "--skip", "quantize"]
    command += ["--set", "base_model.tiny.pretrain_steps=20", "--set", "train.max_steps=10"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = {step["name"]: step for step in json.loads(out.read_text())["steps"]}
    assert {name for name, step in steps.items() if step["status"] == "ok"} == {
        "base",
        "lora",
        "evaluate",
        "merge",
        "serve",
    }
    assert steps["memory"]["status"] == "skipped" and steps["memory"]["note"] == "needs a CUDA GPU"
    assert steps["lora"]["numbers"]["steps"] == 10
    assert steps["merge"]["numbers"]["max_abs_dlogits"] <= steps["merge"]["numbers"]["tolerance"]
    answered = steps["serve"]["numbers"]["answers_equal_evaluate"].split("/")
    assert answered[0] == answered[1]  # fp32: the served model answers exactly as evaluate's generate
    assert "step      status" in done.stdout


@pytest.mark.parametrize("argv", [["--skip", "nothing"], ["--bogus"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as stopped:
        gpu_smoke.parse_args(argv)
    assert stopped.value.code == 2


def test_the_smoke_names_the_pinned_images_whose_cuda_needs_a_newer_driver():
    """The GPU machine lent on 2026-11-26 had driver 580.159.04: every pinned image needs a newer one (R590, R615)."""
    assert (
        gpu_smoke.images_needing_a_newer_driver("580.159.04") == "train (590.44.01), trtllm (590.44.01), vllm (615.61)"
    )
    assert gpu_smoke.images_needing_a_newer_driver("590.48.01") == "vllm (615.61)"
    assert gpu_smoke.images_needing_a_newer_driver("615.61") == ""
