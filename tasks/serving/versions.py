"""A served version: what one registered version serves on a Triton and how it is loaded and unloaded there, with one
implementation per `serve.lora`: its merged model in an engine of its own (MergedVersion, tasks/serving/models.py),
or its LoRA adapter on the service's base engine (AdapterVersion, tasks/serving/adapters.py). Which one a version is
is decided once, where it is made from its store artifacts (tasks/serving/champion.py:served_from); everything after
asks the version itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.platform.config import Profile
    from tasks.serving.client import Triton


def model_name(service: str, version: str) -> str:
    return f"{service}-v{version}"


def service_models_pattern(service: str) -> str:
    """The regular expression of `service`'s Triton models, whole names only: its versions (`<service>-v<N>`) and
    its base engine (`<service>-base`), never another service's whose name begins with this one's (`chat` and
    `chat-mini-v1`). Python's re and Prometheus' RE2 read it alike (PromQL's =~ is anchored), and it has no backslash
    for a PromQL string to escape: a name holds letters, digits, `_`, `-` and `.` (TRITON_NAME), and a dot is `[.]`."""
    return service.replace(".", "[.]") + "-(v[0-9]+|base)"


def of_service(name: str, service: str) -> bool:
    """`name` is one of `service`'s Triton models (service_models_pattern)."""
    return re.fullmatch(service_models_pattern(service), name) is not None


@dataclass
class Served:
    version: str
    name: str  # its Triton model, `<service>-v<N>`
    model_dir: Path  # the merged model: tokenizer for genai-perf, the champion's task score
    artifact_sha256: str = ""  # the store artifact it serves, as its model config names it (the gate reads it back)
    sources: dict[str, str] = field(default_factory=dict)  # the store artifacts it serves, by stage
    settings: dict | None = None  # the serving settings it was released with (serve.model_settings), where known
    store: str = ""  # the S3 artifact store it came from (s3://BUCKET/PREFIX), which a Triton with no disk fetches from

    def fetched_by(self, triton: Triton) -> bool:
        """Whether `triton` fetches this version's files from the store itself (tasks/serving/model_roots.py): one
        sharing no disk with this process, where the store is S3; otherwise the files travel with the load request."""
        return triton.repository is None and bool(self.store)

    def store_object(self, digest: str) -> str:
        """The URI a rendered config names for the store object `digest` (tasks/serving/model_roots.py:fetched)."""
        return f"{self.store}/objects/{digest}"

    @property
    def answered_by(self) -> tuple[str, str | None]:
        """(the Triton model that answers this version, the adapter that model is asked for or None)."""
        return self.name, None

    @property
    def models(self) -> list[str]:
        """Every Triton model serving this version needs loaded: its own and the one that answers it."""
        return sorted({self.name, self.answered_by[0]})

    def install(self, triton: Triton, profile: Profile) -> float:
        """Render and load the version's models on `triton`; the seconds the load took."""
        raise NotImplementedError

    def retire(self, triton: Triton, service: str) -> None:
        """Unload the version's models from `triton`."""
        raise NotImplementedError
