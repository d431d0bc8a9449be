"""Register the deployments of infra/prefect.yaml, and push data that starts a retrain.

The deployments themselves are data (infra/prefect.yaml) and Prefect's own `prefect deploy`
reads them; here we only create the work pools they name and set the file's two variables.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import requests

from flows.retrain import DATA_EVENT
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.local_stack import BIN, CPU_POOL, ensure_process_pool, prefect_session
from tasks.platform.project import PROJECT_ROOT

PREFECT_FILE = PROJECT_ROOT / "infra" / "prefect.yaml"
GPU_POOL_TEMPLATE = PROJECT_ROOT / "infra" / "work-pools" / "kubernetes-gpu.json"
IMAGE_PROJECT_DIR = "/opt/llmops"  # the stage images' copy of this project (WORKDIR of infra/images/*.Dockerfile)


def deployment_variables(gpu_pool: str, gpu_pool_type: str) -> dict[str, str]:
    """The variables infra/prefect.yaml reads. `prefect deploy` bakes them into each deployment's pull step,
    so the stage deployment's runs start in the image's copy of the project on Kubernetes (a checkout's path
    does not exist in a pod), and in this checkout on a process pool."""
    return {
        "LLMOPS_PROJECT_DIR": str(PROJECT_ROOT),
        "LLMOPS_GPU_PROJECT_DIR": IMAGE_PROJECT_DIR if gpu_pool_type == "kubernetes" else str(PROJECT_ROOT),
        "LLMOPS_GPU_POOL": gpu_pool,
    }


def ensure_gpu_pool(api_url: str, pool: str) -> str:
    """The Kubernetes GPU pool with our job template; an existing pool is left as it is."""
    api = prefect_session(os.environ)
    found = api.get(f"{api_url}/work_pools/{pool}", timeout=10)
    if found.ok:
        return f"work pool {pool}: exists ({found.json()['type']})"
    template = json.loads(GPU_POOL_TEMPLATE.read_text())
    response = api.post(
        f"{api_url}/work_pools/",
        timeout=10,
        json={
            "name": pool,
            "type": "kubernetes",
            "base_job_template": template,
            "description": "llmops: heavy stages (train, quantize, build_engine) as Kubernetes jobs with GPUs",
        },
    )
    if response.status_code != 201:
        raise CheckFailed(f"creating work pool {pool}: HTTP {response.status_code} {response.text[:300]}")
    return f"work pool {pool}: created (kubernetes, template {GPU_POOL_TEMPLATE.relative_to(PROJECT_ROOT)})"


def deploy(gpu_pool: str, say: Callable[[str], None] = print) -> str:
    api_url = os.environ["PREFECT_API_URL"].rstrip("/")
    try:
        requests.get(f"{api_url}/health", timeout=10).raise_for_status()
    except requests.RequestException as exc:
        raise BadInput(
            f"PREFECT_API_URL {api_url}: no Prefect server answers ({type(exc).__name__}); "
            f"run `llmops stack up` or fix the URL"
        ) from None
    api = prefect_session(os.environ)
    ensure_process_pool(api_url, CPU_POOL, api)
    say(f"work pool {CPU_POOL}: ready (process)")
    if gpu_pool != CPU_POOL:
        say(ensure_gpu_pool(api_url, gpu_pool))
    found = api.get(f"{api_url}/work_pools/{gpu_pool}", timeout=10)
    if not found.ok:
        raise CheckFailed(f"work pool {gpu_pool}: HTTP {found.status_code} {found.text[:300]}")
    env = {**os.environ, **deployment_variables(gpu_pool, found.json()["type"]), "PREFECT_API_URL": api_url}
    command = [str(BIN / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_FILE)]
    say(f"deploy: {' '.join(command[1:])} (gpu pool {gpu_pool})")
    done = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        last = [line for line in output.strip().splitlines() if line.strip()][-3:]
        raise CheckFailed(f"prefect deploy of {PREFECT_FILE.name} failed (exit {done.returncode}): {' | '.join(last)}")
    names = deployment_names(api_url)
    return "\n".join(
        [
            f"deployed {len(names)} deployments to {api_url}:",
            *(f"  {n}" for n in names),
            f"UI: {api_url.removesuffix('/api')}/deployments",
        ]
    )


def deployment_names(api_url: str) -> list[str]:
    api = prefect_session(os.environ)
    response = api.post(
        f"{api_url}/deployments/filter", json={"deployments": {"tags": {"all_": ["llmops"]}}}, timeout=10
    )
    response.raise_for_status()
    flows = {f["id"]: f["name"] for f in api.post(f"{api_url}/flows/filter", json={}, timeout=10).json()}
    return sorted(f"{flows.get(d['flow_id'], '?')}/{d['name']}  (pool {d['work_pool_name']})" for d in response.json())


def push_data(source: str, destination: str) -> str:
    """Upload a dataset under `destination`, then emit `llmops.data.landed` for that location."""
    from prefect.events import emit_event

    path = Path(source)
    if not path.exists():
        raise BadInput(f"dataset {source}: not found")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise BadInput(f"dataset {source}: no files")
    base = path if path.is_dir() else path.parent
    if destination.startswith("s3://"):
        from tasks.platform.store import s3_client, split_s3_uri

        bucket, prefix = split_s3_uri(destination)
        client = s3_client()
        for file in files:
            client.upload_file(
                str(file), bucket, "/".join(p for p in (prefix.rstrip("/"), str(file.relative_to(base))) if p)
            )
    else:
        import shutil

        for file in files:
            target = Path(destination) / file.relative_to(base)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, target.with_suffix(target.suffix + ".partial"))
            target.with_suffix(target.suffix + ".partial").replace(target)  # a watcher never reads half a file
    location = destination if destination.endswith("/") else destination + "/"
    event = emit_event(
        event=DATA_EVENT,
        resource={"prefect.resource.id": f"llmops.data.{location}", "llmops.data.uri": location},
        payload={"files": [str(f.relative_to(base)) for f in files]},
    )
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=10)
    if event is None:
        raise CheckFailed("event llmops.data.landed was not emitted (events are off in this Prefect setting)")
    return f"pushed {len(files)} file(s) to {location}; emitted {DATA_EVENT} ({event.id})"
