"""serve.lora adapter: every version of a service as a LoRA adapter on one vLLM engine of the base model.

The engine is the Triton model `<service>-base` (infra/triton/vllm with enable_lora), loaded once; each version
stays its own Triton model `<service>-v<N>` (infra/triton/lora), which holds no weights and answers nothing: loading
it registers its adapter in the engine's adapter map (tasks/serving/adapter_registry.py), unloading it retires the
adapter. The gateway asks the engine for a version with the version's name as `lora_name`
(tasks/control/contract.py); the benchmark tools do the same. A canary loads an adapter of megabytes instead of a
second engine.

Before an adapter loads: its base must be the one the engine serves (a version trained on another base is refused),
its rank must fit serve.vllm.max_lora_rank, the engine must have room for one more adapter (serve.vllm.max_loras),
and it may hold nothing vLLM refuses or drops at load (tasks/serving/lora_support.py: whole modules, DoRA, a resized
vocabulary).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from tasks.platform.config import Profile
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import logger
from tasks.quality.contract import require_kept
from tasks.serving import vllm as vllm_serving
from tasks.serving.client import Triton
from tasks.serving.lora_support import refuse_what_vllm_refuses
from tasks.serving.model_config import serving_model
from tasks.serving.models import triton_unload_quietly
from tasks.serving.repository import load_rendered, model_folders, render_model
from tasks.serving.versions import Served, of_service


@dataclass(kw_only=True)
class AdapterVersion(Served):
    """A version served as its LoRA adapter on the service's base engine (serve.lora adapter)."""

    adapter_dir: Path  # the train stage's adapter
    base_dir: Path  # the base model it was trained on, which the engine serves
    base_sha256: str  # that base's store artifact
    base_model: str  # the Triton model of the base engine, `<service>-base`

    @property
    def answered_by(self) -> tuple[str, str | None]:
        return self.base_model, self.name

    def install(self, triton: Triton, profile: Profile) -> float:
        return install_adapter(triton, profile, self, profile.registry.model_name)

    def retire(self, triton: Triton, service: str) -> None:
        """Unload the version's model (its adapter retired in the engine's map, which the engine then frees), and the
        engine when no other adapter serves on it (a first release rolled back, or a service that stays merged)."""
        triton_unload_quietly(triton, self.name)
        base = base_model_name(service)
        # this version may still be listed: Triton unloads in the background, after the requests in flight
        if triton.is_ready(base) and not set(held_adapters(triton, service)) - {self.name}:
            triton_unload_quietly(triton, base)


def base_model_name(service: str) -> str:
    return f"{service}-base"


def adapter_rank(adapter_dir: Path) -> int:
    """The largest LoRA rank in a PEFT adapter (`r`, or a per-module `rank_pattern`)."""
    path = adapter_dir / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
        return max([int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckFailed(f"serve.lora adapter: {path}: not a PEFT LoRA adapter config ({exc})") from None


def served_artifact(adapter_sha256: str, base_sha256: str) -> str:
    """What an adapter version serves, as its model config's artifact_sha256 and the gate's check read it."""
    return f"{adapter_sha256}@{base_sha256}"


def held_adapters(triton: Triton, service: str) -> list[str]:
    """The versions loaded on `triton` as adapters of `service`'s engine: not a merged version of the same service,
    which serves next to them while a service moves from merged models to adapters."""
    base = base_model_name(service)
    return [
        name
        for name in triton.loaded_models()
        if name != base and of_service(name, service) and adapter_base(triton, name) == base
    ]


def adapter_base(triton: Triton, name: str) -> str | None:
    """The base engine model `name` is an adapter of, as its loaded config says; None for any other model (or one
    unloaded meanwhile)."""
    try:
        return triton.model_parameter(name, "base_model") or None
    except requests.RequestException:
        return None


def install_adapter(triton: Triton, profile: Profile, served: AdapterVersion, service: str) -> float:
    """Load `served` as an adapter (and the base engine when none serves); the seconds the adapter's own load took."""
    refuse_what_vllm_refuses(served.name, served.adapter_dir, served.base_dir)
    rank = adapter_rank(served.adapter_dir)
    if rank > profile.serve.vllm.max_lora_rank:
        raise CheckFailed(
            f"serve.lora adapter: {served.name}'s adapter has rank {rank}, above serve.vllm.max_lora_rank "
            f"{profile.serve.vllm.max_lora_rank}; raise it (the base engine then restarts) or train a lower train.lora_rank"
        )
    base = base_model_name(service)
    with model_folders(triton) as repository:
        ensure_base(triton, profile, served, base, repository)
        held = held_adapters(triton, service)
        if len(held) >= profile.serve.vllm.max_loras:
            raise CheckFailed(
                f"serve.lora adapter: {base} holds {len(held)} adapters ({', '.join(held)}), serve.vllm.max_loras is "
                f"{profile.serve.vllm.max_loras}; raise it or unload a version"
            )
        fetched = served.fetched_by(triton)
        shipped = triton.repository is None and not fetched
        adapter_dir = served.store_object(served.sources["train"]) if fetched else served.adapter_dir.resolve()
        values: dict[str, object] = {
            "base_model": base,
            "adapter_dir": "adapter" if shipped else adapter_dir,
            "artifact_sha256": served.artifact_sha256,
        }
        folder = render_model("lora", repository, served.name, values)
        if shipped:  # no shared filesystem: the adapter's files go with the load request
            shutil.copytree(served.adapter_dir, folder / "1" / "adapter")
        check_adapter_contract(profile, served)
        logger().info(f"canary: loading {served.name} as an adapter on {base} (rank {rank})")
        started = time.monotonic()
        load_rendered(triton, served.name, repository, profile.serve.load_timeout_s)
        load_s = time.monotonic() - started
        logger().info(f"canary: {served.name} loaded in {load_s:.2f}s (adapter on {base})")
        return load_s


def ensure_base(triton: Triton, profile: Profile, served: AdapterVersion, base: str, repository: Path) -> None:
    """The base engine loaded with LoRA enabled, serving the base `served` was trained on; a different base is
    refused, never replaced under the versions it serves."""
    if triton.is_ready(base):
        serving = triton.model_parameter(base, "artifact_sha256")
        if serving != served.base_sha256:
            raise CheckFailed(
                f"serve.lora adapter: {served.name} was trained on base {served.base_sha256[:12]}, but {base} serves "
                f"base {serving[:12]}; an adapter only serves on its own base (release it as serve.lora merged, or "
                "retrain on the served base)"
            )
        return
    template, values = serving_model(profile, served.base_dir, served.base_sha256)  # vllm, enable_lora true
    fetched = served.fetched_by(triton)
    shipped = triton.repository is None and not fetched
    if fetched or shipped:  # no shared disk: fetched by the Triton from the S3 store, or sent with the request
        values = {**values, "model_dir": served.store_object(served.base_sha256) if fetched else "model"}
    folder = render_model(template, repository, base, values)
    if shipped:
        shutil.copytree(served.base_dir, folder / "1" / "model")
    if triton.is_local():
        vllm_serving.require_room(profile, base)
    logger().info(f"canary: loading the base engine {base} on Triton {triton.url} (LoRA adapters by name)")
    started = time.monotonic()
    load_rendered(triton, base, repository, profile.serve.load_timeout_s)
    logger().info(f"canary: {base} loaded in {time.monotonic() - started:.1f}s (vllm backend)")


def check_adapter_contract(profile: Profile, served: AdapterVersion) -> None:
    """The tokenizer of the base the adapter serves on must keep the contract training recorded (template, special
    tokens, stop ids): the engine encodes with the base's tokenizer (tasks/quality/contract.py)."""
    require_kept(
        served.model_dir, served.base_dir, f"the base model {served.base_dir} that {served.name}'s adapter serves on"
    )
