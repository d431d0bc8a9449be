"""infra/images: what can be checked without Docker or a GPU. Each image starts from the NGC release its
name says, installs an extra that pyproject.toml defines, never replaces the TensorRT-LLM image's own
packages, and every heavy stage of every GPU profile runs in one of them (as its Kubernetes job's image)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tasks.platform.config import HEAVY_STAGES, available_profiles, load_profile
from tasks.platform.stage_cache import job_variables

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "infra" / "images"
GPU_PROFILES = [p for p in available_profiles() if load_profile(p).hardware.accelerator == "cuda"]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def dockerfile(name: str) -> str:
    return (IMAGES / f"{name}.Dockerfile").read_text()


@pytest.mark.parametrize(
    ("name", "base", "extra"),
    [
        ("train", "nvcr.io/nvidia/pytorch:25.06-py3", "gpu-train"),
        ("trtllm", "nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3", "gpu"),
    ],
)
def test_each_image_starts_from_its_ngc_release_and_installs_an_extra_we_define(name, base, extra):
    text = dockerfile(name)
    assert re.search(rf"^FROM {re.escape(base)}$", text, re.M), f"{name}.Dockerfile: FROM {base}"
    assert f"'.[{extra}]'" in text and extra in EXTRAS


def test_the_tensorrt_llm_image_keeps_its_own_packages():
    text = dockerfile("trtllm")
    assert "pip freeze > /tmp/image-constraints.txt" in text and "-c /tmp/image-constraints.txt" in text
    # Neither side of the transformers split leaks into the other's image.
    assert not any("transformers" in r or "llamafactory" in r for r in EXTRAS["gpu"])
    assert "tensorrt-llm==0.20.0" in EXTRAS["gpu"]


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_every_heavy_stage_runs_in_the_image_made_for_it(profile_name):
    profile = load_profile(profile_name)
    images = {stage: job_variables(profile, stage)["image"] for stage in HEAVY_STAGES}
    assert {images[s] for s in ("train", "evaluate", "merge")} == {"ghcr.io/example/llmops-train:25.06"}
    assert {images[s] for s in ("quantize", "build_engine")} == {"ghcr.io/example/llmops-trtllm:25.06"}
    assert set(profile.run.remote_stages) == set(HEAVY_STAGES)  # each on a Kubernetes job of its image
