"""infra/images: what can be checked without Docker or a GPU. Each image starts from the NGC release its
name says, installs an extra that pyproject.toml defines, never replaces its base image's own packages
(the constraint commands run here, on this machine's pip), and every heavy stage of every GPU profile runs
in one of them (as its Kubernetes job's image), started as the worker renders the job: the effective argv
is the image's ENTRYPOINT followed by Prefect's command."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from tasks.platform.config import HEAVY_STAGES, available_profiles, load_profile
from tasks.platform.stage_cache import job_variables
from tasks.training.launch import launch_command

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "infra" / "images"
GPU_TEMPLATE = ROOT / "infra" / "work-pools" / "kubernetes-gpu.json"
GPU_PROFILES = [p for p in available_profiles() if load_profile(p).hardware.accelerator == "cuda"]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
REQUIREMENTS_WITHOUT = IMAGES / "requirements_without.py"
# NGC's entrypoint runs /opt/nvidia/entrypoint.d, then `exec "$@"` (triton-inference-server/server@r26.07
# docker/cpu_only/nvidia_entrypoint.sh, the copy build.py:1482 installs where the CUDA base image has none).
EXEC_WRAPPERS = {"/opt/nvidia/nvidia_entrypoint.sh"}
NAME_EQUALS_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[^\s@;=]+$")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of infra/images/<name>.Dockerfile: comments dropped, continuations joined."""
    joined, pending = [], ""
    for line in (IMAGES / f"{name}.Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not (pending or line.strip()):
            continue
        pending += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            joined.append(pending.strip())
            pending = ""
    return [(text.split(None, 1)[0].upper(), " ".join(text.split()[1:])) for text in joined]


def only(name: str, instruction: str) -> str:
    (found,) = [args for kind, args in instructions(name) if kind == instruction]
    return found


def exec_form(name: str, instruction: str) -> list[str] | None:
    """ENTRYPOINT or CMD in exec (JSON) form; None when the Dockerfile sets none."""
    found = [args for kind, args in instructions(name) if kind == instruction]
    return json.loads(found[-1]) if found else None


def tag(name: str) -> str:
    """The image name the Dockerfile's header builds it as (`docker build ... -t TAG .`)."""
    (found,) = re.findall(r"^#\s+docker build -f \S+ -t (\S+) \.$", (IMAGES / f"{name}.Dockerfile").read_text(), re.M)
    return found


def run_here(command: str, tmp_path: Path) -> Path:
    """Run one `python -m pip ... > FILE` pipeline of a RUN line with this interpreter; the file it wrote."""
    here = re.sub(r"\bpython3? -m pip\b", f"{shlex.quote(sys.executable)} -m pip", command)
    written = re.search(r">\s*(\S+)\s*$", here)
    assert written, command
    target = tmp_path / Path(written[1]).name
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", here[: written.start()] + f"> {shlex.quote(str(target))}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return target


def assert_pip_takes_it_as_constraints(path: Path) -> None:
    lines = path.read_text().splitlines()
    assert lines and all(NAME_EQUALS_VERSION.match(line) for line in lines), [
        line for line in lines if not NAME_EQUALS_VERSION.match(line)
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps", "-c", str(path), "pip"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def image_requirements(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(REQUIREMENTS_WITHOUT), "--pyproject", str(ROOT / "pyproject.toml"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


PINS = yaml.safe_load((IMAGES / "images.yaml").read_text())
UPSTREAM = IMAGES / "upstream"


@pytest.mark.parametrize(
    ("name", "base", "extra"),
    [
        ("train", "nvcr.io/nvidia/pytorch:25.12-py3", "gpu-train"),
        ("trtllm", "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3", "gpu"),
    ],
)
def test_each_image_starts_from_its_ngc_release_and_installs_an_extra_we_define(name, base, extra):
    assert only(name, "FROM") == base == PINS[name]["from"] and tag(name) == PINS[name]["tag"]
    assert extra in EXTRAS
    assert f"'.[{extra}]'" in only(name, "RUN") or f"--extra {extra} " in only(name, "RUN")
    assert tag(name).endswith(":" + base.split(":")[1].split("-")[0])  # named by its NGC release


def test_the_tensorrt_llm_image_keeps_its_own_packages(tmp_path):
    """`pip freeze` writes `-e` and `name @ file://` lines that a constraints file refuses; the image's
    constraint command, run here on this machine's pip, must give name==version lines pip accepts."""
    commands = only("trtllm", "RUN").split(" && ")
    assert commands[0] == "python3 -m pip list --format=freeze > /tmp/image-constraints.txt"
    assert commands[1] == "python3 -m pip install --no-cache-dir -c /tmp/image-constraints.txt '.[gpu]'"
    assert_pip_takes_it_as_constraints(run_here(commands[0], tmp_path))
    # Neither side of the transformers split leaks into the other's image.
    assert not any("transformers" in r or "llamafactory" in r for r in EXTRAS["gpu"])
    assert any(r.startswith("nvidia-modelopt[torch]") for r in EXTRAS["gpu"])  # ModelOpt: the image's own


def test_the_gpu_extra_pins_the_tensorrt_llm_the_image_ships():
    (image_version,) = re.findall(r"^TENSORRT_LLM_VERSION=(\S+)$", only("trtllm", "ARG"), re.M)
    assert f"tensorrt-llm=={image_version}" in EXTRAS["gpu"]


def test_the_train_image_keeps_its_torch_and_installs_llamafactory_without_torchaudio(tmp_path):
    commands = only("train", "RUN").split(" && ")
    keep = commands[0]
    assert keep.endswith("> /tmp/keep-torch.txt") and "--format=freeze" in keep
    pinned = run_here(keep, tmp_path)
    assert "torch==" in pinned.read_text()  # this machine's torch, as name==version
    assert_pip_takes_it_as_constraints(pinned)
    pin = image_requirements("--extra", "gpu-train", "--pin", "llamafactory")
    assert pin == [r for r in EXTRAS["train"] if r.startswith("llamafactory==")]
    # LlamaFactory alone and without its dependencies, then the rest, then the project: torchaudio never
    # enters the resolution; then the torch family must be what the image had.
    assert commands[1].startswith("python -m pip install --no-cache-dir --no-deps -c /tmp/keep-torch.txt")
    assert "--extra gpu-train --pin llamafactory" in commands[1]
    assert commands[2].endswith("--extra gpu-train --without torchaudio > /tmp/requirements.txt")
    assert commands[3] == "python -m pip install --no-cache-dir -c /tmp/keep-torch.txt -r /tmp/requirements.txt"
    assert commands[4] == "python -m pip install --no-cache-dir --no-deps ."
    assert commands[5].endswith("| diff /tmp/keep-torch.txt -")
    assert "python -c 'import torchaudio' 2>/dev/null" in commands[6]
    assert "cp -r infra/images/torchaudio-placeholder/torchaudio" in commands[6]
    # the build's smoke test goes through the same launcher the train stage uses
    assert commands[7] == "python -m tasks.runners.llamafactory_launch version"
    assert launch_command(Path("cfg.yaml"))[1:3] == ["-m", "tasks.runners.llamafactory_launch"]


def test_the_train_requirements_are_llamafactorys_and_ours_minus_torchaudio():
    """Run against this machine's installed LlamaFactory, which requires torchaudio."""
    from importlib import metadata

    assert any(Requirement(r).name == "torchaudio" for r in metadata.requires("llamafactory") or [])
    names = {
        Requirement(line).name.lower() for line in image_requirements("--extra", "gpu-train", "--without", "torchaudio")
    }
    assert "torchaudio" not in names and "llamafactory" not in names
    assert {"prefect", "transformers", "peft", "bitsandbytes", "deepspeed", "torchvision", "trl", "datasets"} <= names


def test_the_torchaudio_placeholder_imports_and_fails_on_use_without_posing_as_installed():
    spec = importlib.util.spec_from_file_location(
        "torchaudio_placeholder", IMAGES / "torchaudio-placeholder" / "torchaudio" / "__init__.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ImportError, match=r"torchaudio\.load: this image has no torchaudio built for its torch"):
        module.load  # noqa: B018
    assert not hasattr(module, "__version__")
    assert not list((IMAGES / "torchaudio-placeholder").glob("*.dist-info"))  # pip still sees none


def image_of(reference: str) -> str:
    """Which Dockerfile builds an image reference (repository name; the tag is checked elsewhere)."""
    by_repository = {tag(n).rsplit(":", 1)[0]: n for n in ("train", "trtllm")}
    return by_repository[reference.rsplit(":", 1)[0]]


def render_stage_job(profile_name: str, stage: str) -> dict:
    """The container the Kubernetes worker submits for one heavy stage, through prefect-kubernetes' own
    template code (KubernetesWorkerJobConfiguration, 0.7.11) and Prefect's default flow-run command."""
    import asyncio

    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    async def render():
        config = await KubernetesWorkerJobConfiguration.from_template_and_values(
            json.loads(GPU_TEMPLATE.read_text()), job_variables(load_profile(profile_name), stage)
        )
        config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name=f"{stage}-abc"))
        return config.job_manifest["spec"]["template"]["spec"]["containers"][0]

    return asyncio.run(render())


def effective_argv(container: dict, entrypoint: list[str] | None, cmd: list[str] | None) -> list[str]:
    """Kubernetes: `command` replaces the image's ENTRYPOINT (and drops its CMD), `args` replaces CMD."""
    if "command" in container:
        return [*container["command"], *container.get("args", [])]
    return [*(entrypoint or []), *container.get("args", cmd or [])]


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_each_stage_job_starts_prefect_in_its_image(profile_name):
    for stage in HEAVY_STAGES:
        container = render_stage_job(profile_name, stage)
        name = image_of(container["image"])
        argv = effective_argv(container, exec_form(name, "ENTRYPOINT"), exec_form(name, "CMD"))
        if argv[0] in EXEC_WRAPPERS:
            argv = argv[1:]
        assert argv == ["prefect", "flow-run", "execute"], f"{profile_name}/{stage} in {name}.Dockerfile: {argv}"
        # `prefect` is a console script of a package the image installs (pip puts it next to the image's
        # python, on PATH: /usr/local/bin in the PyTorch image, /opt/venv-tritonserver/bin in Triton's)
        extra = "gpu-train" if name == "train" else "gpu"
        assert "prefect" in {Requirement(line).name for line in image_requirements("--extra", extra)}


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_every_heavy_stage_runs_in_the_image_made_for_it(profile_name):
    profile = load_profile(profile_name)
    # build_engine (the check on TensorRT-LLM) runs only where TensorRT-LLM serves
    runs = [s for s in HEAVY_STAGES if s != "build_engine" or profile.serve.backend == "llmapi"]
    images = {stage: job_variables(profile, stage)["image"] for stage in runs}
    assert {images[s] for s in ("train", "evaluate", "merge")} == {tag("train")}
    assert {images[s] for s in runs if s in ("quantize", "build_engine")} == {tag("trtllm")}
    assert set(profile.run.remote_stages) == set(runs)  # each on a Kubernetes job of its image


def test_genai_perf_comes_from_the_orchestrator_not_from_a_stage_image():
    """The benchmark stage runs in the release flow's own process (never a remote stage) and starts the
    genai-perf next to its interpreter; NGC ships genai-perf only in the -py3-sdk image, in no GPU image."""
    from tasks.load.genai_perf import genai_perf_command
    from tasks.platform.config import load_profile as load

    assert "benchmark" not in HEAVY_STAGES
    command = genai_perf_command("m", "h:8001", Path("tok"), load("cpu-tiny").bench, 1, Path("out"))
    assert command[0] == str(Path(sys.executable).parent / "genai-perf")
    assert "genai-perf==" in (ROOT / "infra" / "constraints-cpu.txt").read_text()
    assert not any("genai-perf" in r for extra in ("gpu", "gpu-train") for r in EXTRAS[extra])
    readme = (IMAGES / "README.md").read_text()
    assert "genai-perf" in readme and "-py3-sdk" in readme


@pytest.mark.parametrize("name", ["train", "trtllm"])
def test_the_build_context_leaves_the_checkouts_local_state_out(name):
    """`COPY . /opt/llmops` from a used checkout would carry .llmops/ (the Triton control key, the local
    stack's data) and the venvs into the image; each Dockerfile's own ignore file names all .gitignore does."""
    ignored = {
        line.strip()
        for line in (IMAGES / f"{name}.Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert ".git" in ignored
    for pattern in (ROOT / ".gitignore").read_text().splitlines():
        pattern = pattern.split("#")[0].strip().rstrip("/")
        if pattern:
            assert {pattern, f"**/{pattern}"} & ignored, f"{name}.Dockerfile.dockerignore: {pattern}"
    assert only(name, "COPY") == ". /opt/llmops"


def test_every_gpu_profile_names_the_pinned_images_and_the_readme_says_what_each_carries():
    """infra/images/images.yaml is the one list of images: each profile's stage images are its tags, the vLLM profile
    serves from its vLLM image, and the README names each image, its tag, what it carries, its driver and source."""
    readme = (IMAGES / "README.md").read_text()
    for name, image in PINS.items():
        assert image["from"] in readme and image["tag"] in readme and image["driver"] in readme, name
        assert image["read"].split()[0] in readme, name  # where it was read
    for profile_name in GPU_PROFILES:
        profile = load_profile(profile_name)
        images = {profile.hardware.kubernetes.image, *profile.hardware.kubernetes.stage_images.values()}
        assert images <= {PINS["train"]["tag"], PINS["trtllm"]["tag"]}, profile_name
        header = (ROOT / "profiles" / f"{profile_name}.yaml").read_text()
        if profile.serve.backend == "vllm":
            assert PINS["vllm"]["from"].split("/")[-1] in header and "-vllm-python-py3" in header
    assert only("trtllm", "ARG") == f"TENSORRT_LLM_VERSION={PINS['trtllm']['tensorrt_llm']}"


def upstream_requirements(release: str) -> list[Requirement]:
    lines = (UPSTREAM / f"tensorrt_llm-{release}.requires.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def can_meet_both(ours: Requirement, theirs: Requirement, installed: str | None) -> bool:
    """Whether some version satisfies both specifier sets: tried on every version either names (and the next ones
    past it) and on the one installed here."""
    candidates = {Version(installed)} if installed else set()
    for spec in (*ours.specifier, *theirs.specifier):
        version = Version(spec.version.removesuffix(".*"))
        release = list(version.release) + [0] * (3 - len(version.release))
        candidates |= {
            version,
            Version(f"{release[0]}.{release[1]}.{release[2] + 1}"),
            Version(f"{release[0]}.{release[1] + 1}.0"),
        }
    return any(
        ours.specifier.contains(v, prereleases=True) and theirs.specifier.contains(v, prereleases=True)
        for v in candidates
    )


@pytest.mark.parametrize("release", ["1.2.1", "1.3.0rc29"])
def test_what_the_tensorrt_llm_image_installs_does_not_contradict_what_tensorrt_llm_requires(release):
    """trtllm.Dockerfile installs the project's base dependencies and `gpu` extra under the image's own package list;
    whether every transitive pin fits the image's exact versions is known only once the image is built (its build
    then imports TensorRT-LLM and starts `prefect flow-run execute`). What can be checked here: no requirement of
    ours, nor of Prefect, MLflow and prefect-kubernetes as pinned (their installed metadata), excludes every version
    TensorRT-LLM itself accepts (its release's Requires-Dist, infra/images/upstream/). Run for the pinned 1.2.1 and for
    the newest 1.3 release candidate: a ceiling in the base (numpy<2, fastapi<0.136) would make a 1.3 image
    unbuildable, so those belong to the environments that need them (the cpu and gpu-train extras)."""
    from importlib import metadata

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ours = [Requirement(r) for r in (*project["dependencies"], *EXTRAS["gpu"])]
    for pinned in ("prefect", "mlflow", "mlflow-skinny", "prefect-kubernetes"):
        ours += [Requirement(r) for r in metadata.requires(pinned) or [] if "extra ==" not in r]
    theirs = {r.name.lower(): r for r in upstream_requirements(release) if not r.marker or r.marker.evaluate()}
    clashes = []
    for requirement in ours:
        upstream = theirs.get(requirement.name.lower())
        if upstream is None or (requirement.marker and not requirement.marker.evaluate()):
            continue
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            installed = None
        if not can_meet_both(requirement, upstream, installed):
            clashes.append(f"{requirement} vs tensorrt_llm {release}'s {upstream}")
    assert clashes == []
    assert "numpy<2" in EXTRAS["cpu"] and "fastapi<0.136" in EXTRAS["cpu"]  # the orchestrator's own ceilings
    assert not any(
        Requirement(r).name in ("numpy", "fastapi") and Requirement(r).specifier for r in project["dependencies"]
    )
