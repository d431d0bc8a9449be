"""Run profiles: YAML data validated by pydantic, overridable with `--set a.b=value`.

The schema lives in sections by concern (training, quantize, serving, release, machines), the whole
profile and its digest in profile, loading and overrides in loading, `llmops profiles show`'s rendering
in describe, and the reference page docs/reference/profiles.md in reference (`python -m
tasks.platform.config.reference > docs/reference/profiles.md` regenerates it).
"""

from tasks.platform.config.base import TRITON_NAME, Section, TritonName
from tasks.platform.config.describe import describe_profile
from tasks.platform.config.loading import (
    OPERATOR_PROFILES_ENV,
    PROFILE_EXAM,
    PROFILES_DIR,
    ProfileName,
    apply_override,
    available_profiles,
    check_api_profile,
    check_machine,
    check_received_profile,
    format_validation_error,
    load_profile,
    local_stages,
    on_disk_profile,
    parse_override,
    profile_path,
)
from tasks.platform.config.machines import HEAVY_STAGES, HardwareSection, HeavyStage, KubernetesSection, RunSection
from tasks.platform.config.policy import file_only_settings, refuse_file_only
from tasks.platform.config.profile import Profile, sha256_json
from tasks.platform.config.quantize import EngineSection, ModelOptQuantize, QuantizeSection, awq_indivisible
from tasks.platform.config.release import BenchSection, CanarySection, GateSection, RegistrySection
from tasks.platform.config.serving import ListenSection, ServeSection, VllmServing
from tasks.platform.config.training import (
    BaseModelSection,
    DataSection,
    EvaluateSection,
    MergeSection,
    TinyModel,
    TrainSection,
)

__all__ = [
    "HEAVY_STAGES",
    "OPERATOR_PROFILES_ENV",
    "PROFILES_DIR",
    "TRITON_NAME",
    "BaseModelSection",
    "BenchSection",
    "CanarySection",
    "DataSection",
    "EngineSection",
    "EvaluateSection",
    "GateSection",
    "HardwareSection",
    "HeavyStage",
    "KubernetesSection",
    "ListenSection",
    "MergeSection",
    "ModelOptQuantize",
    "PROFILE_EXAM",
    "Profile",
    "ProfileName",
    "QuantizeSection",
    "RegistrySection",
    "RunSection",
    "Section",
    "ServeSection",
    "TinyModel",
    "TrainSection",
    "TritonName",
    "VllmServing",
    "apply_override",
    "available_profiles",
    "awq_indivisible",
    "check_api_profile",
    "check_machine",
    "check_received_profile",
    "describe_profile",
    "file_only_settings",
    "format_validation_error",
    "load_profile",
    "local_stages",
    "on_disk_profile",
    "parse_override",
    "profile_path",
    "refuse_file_only",
    "sha256_json",
]
