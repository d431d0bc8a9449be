"""Profiles: validation errors name the key path; overrides go through the same validation; every setting
is described, in `llmops profiles show` and the generated reference page."""

import ast
from pathlib import Path

import pytest
import yaml

from tasks.platform import config
from tasks.platform.config import Profile, Section, available_profiles, describe_profile, load_profile, sha256_json
from tasks.platform.config.reference import optional_section, render_reference
from tasks.platform.errors import BadInput
from tasks.platform.project import PROJECT_ROOT


def test_every_shipped_profile_validates():
    assert "cpu-tiny" in available_profiles()
    for name in available_profiles():
        assert load_profile(name).name == name


def test_unknown_key_names_its_path():
    with pytest.raises(BadInput, match=r"^profile cpu-tiny: train\.lora_rnk: unknown key$"):
        load_profile("cpu-tiny", ["train.lora_rnk=3"])


def test_wrong_type_names_its_path():
    with pytest.raises(BadInput, match=r"train\.lora_rank: Input should be a valid integer"):
        load_profile("cpu-tiny", ["train.lora_rank=many"])


def test_unknown_key_in_a_profile_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ndata: {source: x.jsonl}\nregistry: {model_name: m}\nevaluate: {max_new_tokns: 3}\n")
    with pytest.raises(BadInput, match=r"evaluate\.max_new_tokns: unknown key"):
        load_profile(str(bad))


def test_overrides_are_typed_like_yaml():
    profile = load_profile("cpu-tiny", ["train.learning_rate=1e-4", "train.quantization_bit=4", "train.bf16=false"])
    assert profile.train.learning_rate == pytest.approx(1e-4)
    assert profile.train.quantization_bit == 4
    assert profile.train.bf16 is False


def test_override_without_equals_is_rejected():
    with pytest.raises(BadInput, match="expected key=value"):
        load_profile("cpu-tiny", ["train.learning_rate"])


def test_unknown_profile_lists_available():
    with pytest.raises(BadInput, match="cpu-tiny"):
        load_profile("no-such-profile")


def test_relative_data_path_resolves_next_to_the_profile():
    profile = load_profile("cpu-tiny")
    assert profile.data.source.endswith("profiles/data/antonyms.jsonl")


def test_profile_digest_changes_with_any_value():
    a = load_profile("cpu-tiny")
    assert a.digest == load_profile("cpu-tiny").digest
    assert a.digest != load_profile("cpu-tiny", ["evaluate.max_new_tokens=4"]).digest


# Digests of the shipped profiles' resolved values at 7a2ae40, before the profiles stopped restating
# the schema's defaults (data paths relative to the repository, so the pin holds in any checkout); updated
# when quantize.tensorrt_llm (trtllm-build) gave way to quantize.modelopt and the engine section to LLM API
# arguments (the CPU profiles' own values did not change; their quantize stage key leaves modelopt out).
# A change here changes every stage's cache key: only a deliberate change of a value may update it.
# Updated when serve.vllm gained gpu_memory_utilization and tensor_parallel_size (vLLM on cuda), and when
# serve.tensorrtllm gave way to serve.backend llmapi (the GPU profiles' serving settings moved into engine,
# the vLLM profile lost its unused build_engine stage; the CPU profiles' own values did not change), and when the
# benchmark measured in interleaved rounds (bench.rounds, max_rounds, confidence; request_count 32 -> 128,
# warmup_request_count 2 -> 4; gate.max_latency_ratio; cpu-tiny's gate.min_throughput_ratio 0.5 -> 0.8), and when
# the gate gained a person's approval (gate.approval, approval_timeout_s; required on the GPU profiles), and when
# the canary gained a shadow window (canary.shadow_s, shadow_fraction, shadow_min_requests; gate.min_shadow_agreement),
# and when the served models' queues got a bound (serve.max_queue_size), and when the benchmark got a second tool
# (bench.tool, profile_runs, aiperf_environment; gate.min_goodput_ratio), and when tune_serving searched every engine
# (tune.max_num_tokens; tune on in the GPU profiles), and when versions could serve as adapters (serve.lora;
# serve.vllm.max_lora_rank, max_loras), and when the flywheel got a review (flywheel.*, serve.capture.trusted_clients,
# train.mask_history, gate.approval harvested by default; cpu-tiny's curated data.eval_source, the same 39 records its
# hash split held out, and mask_history), and when training could span nodes (hardware.nodes) and
# be planned (base_model.architecture; the 72B profile), and
# when qwen-7b-qlora-2xa10 moved from fp16 to bf16 (GPU audit RISK 3), and
# when the GPU profiles' train image moved to PyTorch 25.12 and qwen-7b-vllm-h100 to serving ModelOpt FP8 on vLLM 0.27.1,
# and when the GPU profiles' benchmark moved to AIPerf (bench.tool aiperf), and when the gateway became the router
# (serve.listen.control_host, control_port; canary.hold_s; serve.health; serve.replicas), and when serve.limits'
# defaults were raised above a first load test's and max_in_flight_per_key added, and serve.listen.gateway_metrics_*,
# and when serve.version_pinning came, and evaluate.engine, and data.harvest_eval_source (the curated exam of
# harvested records when a run's --data is not the profile's own), and when three GPU profiles moved from fa2 to sdpa,
# and when the gateway took signed client tokens (serve.auth.jwt, null by default), and when the gate got a judge
# (evaluate.judge, null by default; gate.max_judge_drop, min_judge_score), and when the 7B and 8B profiles stated their
# base's architecture (`make gpu-bench` builds it) and qwen-7b-vllm-h100 trained 4 x 8 (its memory plan overflowed),
# and when serving could scale with its load (serve.autoscale, null by default), and when a user's own data was
# judged as its references need (evaluate.metric and max_new_tokens auto, min_relative_improvement, permutation_check,
# confidence 0.9 and min_improvement 0 by default; cpu-tiny's margin for its exam only; gate.quality_on_interval), and
# when a release's liveness lease became seconds (canary.lease_s 15; canary.hold_s the approval hold alone), and when
# preference tuning came (train.stage dpo/kto, pref_beta, pref_loss, pref_ftx; cpu-tiny-dpo), and when the gate
# got a pairwise judge (gate.min_win_rate 0.5).
RESOLVED_DIGESTS = {
    "cpu-tiny": "9898bc5a11e5d3e439745cf2d37dd2d688e142b0306450e3fb0495e674bec330",
    "cpu-tiny-dpo": "2ebe76f9cb6b0b46166a2a8a551ab22c6b32fd8bd3dc2ffed4f6b8dc063b1c00",
    "cpu-tiny-qa-zh": "64feb4ee0d2828b36ae997dae8f7afa1913fdfcff5d33446d31ec058ffa7c865",
    "llama3-8b-h100-fp8": "5bfcfeec5b431477ec0883dfce230a6aa1d322d74642d0c407436ab9a68bbdd6",
    "qwen-7b-qlora-2xa10": "14cb2c90234d3f68968532860184cc3cb585b3ef99a07b68cdda3196d55154e8",
    "qwen-7b-vllm-h100": "7a2a35f353958f0d4c28b792a18136f66dc80dbb7c129ea4bd059abb39f6602f",
    "qwen2-14b-int4-tp2": "2b917c1a1390ac38e3388756166587eb4cc6bfe9cede1b5c1e9e5d50ecd9d288",
    "qwen2.5-72b-lora-2x8xh100": "838b6271c7eb7e7b71b4f4c568fb9e5793792889a9822e58775c70c7f30100c0",
}


def checkout_independent_digest(profile: Profile) -> str:
    values = profile.model_dump(mode="json")
    for key in ("source", "eval_source", "harvest_eval_source"):
        path = values["data"][key]
        if isinstance(path, str) and path.startswith(str(PROJECT_ROOT)):
            values["data"][key] = Path(path).relative_to(PROJECT_ROOT).as_posix()
    return sha256_json(values)


@pytest.mark.parametrize("name", sorted(RESOLVED_DIGESTS))
def test_shipped_profiles_resolve_to_the_pinned_values(name):
    assert checkout_independent_digest(load_profile(name)) == RESOLVED_DIGESTS[name]


def test_the_pins_cover_every_shipped_profile():
    assert set(available_profiles()) == set(RESOLVED_DIGESTS)


def all_sections(cls: type[Section] = Profile, path: str = "") -> list[tuple[str, type[Section]]]:
    found = [(path, cls)]
    for name, field in cls.model_fields.items():
        annotation = field.annotation
        nested = annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None
        if nested or optional_section(field):
            found += all_sections(nested or optional_section(field), f"{path}.{name}".lstrip("."))
    return found


def test_every_setting_and_section_is_described():
    undescribed = [
        f"{path}.{name}".lstrip(".")
        for path, cls in all_sections()
        for name, field in cls.model_fields.items()
        if not (field.description or (isinstance(field.annotation, type) and issubclass(field.annotation, Section)))
    ]
    assert not undescribed, f"settings without Field(description=...): {undescribed}"
    assert all(cls.__doc__ for _, cls in all_sections()), "every section class needs a docstring"


def test_the_committed_reference_page_is_current():
    page = PROJECT_ROOT / "docs" / "reference" / "profiles.md"
    assert page.read_text() == render_reference(), (
        "docs/reference/profiles.md is stale: python -m tasks.platform.config.reference > docs/reference/profiles.md"
    )


def test_reference_lists_every_setting_with_its_type_and_default():
    page = render_reference()
    assert "| `lora_rank` | `int` (>= 1) | `8` | Rank of the LoRA matrices. |" in page
    assert "| `model_name` | `str` (length >= 1) | required |" in page
    assert "## serve.vllm" in page and "## hardware.kubernetes" in page
    # Every setting is a row, but a section nested in another: an optional one (base_model.architecture,
    # serve.auth.jwt, evaluate.judge, serve.autoscale) is both.
    nested = ("base_model.architecture", "serve.auth.jwt", "evaluate.judge", "serve.autoscale")
    optional = [path for path, _ in all_sections() if path in nested]
    rows = sum(len(cls.model_fields) for _, cls in all_sections()) - (len(all_sections()) - 1) + len(optional)
    assert page.count("\n| `") == rows and optional
    assert "## base_model.architecture" in page and "| `architecture` | `ModelArchitecture \\| null` | `null` |" in page


def test_show_is_the_resolved_profile_as_commented_yaml():
    profile = load_profile("cpu-tiny", ["train.lora_rank=4"])
    shown = describe_profile(profile)
    assert yaml.safe_load(shown) == profile.model_dump(mode="json")
    lines = shown.splitlines()
    at = lines.index("  lora_rank: 4")
    assert lines[at - 1] == "  # Rank of the LoRA matrices. (default: 8)"
    at = lines.index("  stage: sft")  # a long description wraps over several comment lines above its setting
    start = next(i for i in range(at - 1, -1, -1) if not lines[i - 1].startswith("  #"))
    comment = " ".join(line.removeprefix("  # ") for line in lines[start:at])
    assert comment.startswith("LlamaFactory training stage: sft (supervised fine-tuning on answers), dpo")
    assert comment.endswith("makes SFT then DPO (base_model.source).")


@pytest.mark.parametrize("name", ["qwen 7b", "team/model", "models:prod", "-lead", ".hidden", ""])
def test_model_name_must_fit_triton_and_mlflow(name):
    with pytest.raises(BadInput, match=r"^profile cpu-tiny: registry\.model_name: ") as caught:
        load_profile("cpu-tiny", [f"registry.model_name='{name}'"])
    assert "\n" not in str(caught.value)


def test_model_name_with_dots_dashes_and_underscores_is_accepted():
    assert load_profile("cpu-tiny", ["registry.model_name=Qwen2.5-7b_sft"]).registry.model_name == "Qwen2.5-7b_sft"


def test_every_name_imported_from_the_config_package_exists():
    imported = set()
    for folder in ("flows", "tasks", "tests", "benchmarks"):
        for source in (PROJECT_ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "tasks.platform.config":
                    imported |= {alias.name for alias in node.names}
    assert "ProfileName" in imported and "HEAVY_STAGES" in imported
    assert not {name for name in imported if not hasattr(config, name)}


def test_the_run_forms_overrides_field_points_to_the_reference():
    from prefect.utilities.callables import parameter_schema

    from flows.release import release

    described = parameter_schema(release.fn).model_dump()["properties"]["overrides"]["description"]
    assert "docs/reference/profiles.md" in described and "llmops profiles show" in described
    assert (PROJECT_ROOT / "docs" / "reference" / "profiles.md").is_file()


def test_trust_settings_come_only_from_profile_files_and_approval_may_only_rise(tmp_path):
    for override in (
        "serve.capture.trusted_clients=[mallory]",
        "flywheel.review=rules",
        "flywheel.max_client_share=1",
        "flywheel={review: rules}",
    ):
        with pytest.raises(BadInput, match="decides whom the pipeline trusts, so no override or run parameter"):
            load_profile("cpu-tiny", [override])
    assert load_profile("cpu-tiny").gate.approval == "harvested"  # a release on harvested data waits for a person
    assert load_profile("cpu-tiny", ["gate.approval=required"]).gate.approval == "required"
    with pytest.raises(BadInput, match=r"^--set gate.approval=none: the profile file asks for harvested"):
        load_profile("cpu-tiny", ["gate.approval=none"])
    from tests.profile_files import cpu_tiny_file

    required = cpu_tiny_file(tmp_path / "strict.yaml", {"gate": {"approval": "required"}})
    with pytest.raises(BadInput, match="the profile file asks for required"):
        load_profile(str(required), ["gate.approval=harvested"])


def test_unreviewed_harvests_need_trusted_clients_masked_history_and_a_curated_exam(tmp_path):
    def profile(flywheel: dict, **sections: str) -> Path:
        path = tmp_path / "p.yaml"
        body = {"name": "p", "data": {"source": "d.jsonl"}, "registry": {"model_name": "m"}, "flywheel": flywheel}
        path.write_text(yaml.safe_dump(body | {k: yaml.safe_load(v) for k, v in sections.items()}))
        return path

    with pytest.raises(
        BadInput, match=r"flywheel.review rules needs serve.capture.trusted_clients, train.mask_history"
    ):
        load_profile(str(profile({"review": "rules"})))
    ok = profile(
        {"review": "rules"},
        serve="{capture: {trusted_clients: [curator]}}",
        train="{mask_history: true}",
        data="{source: d.jsonl, eval_source: exam.jsonl}",
    )
    assert load_profile(str(ok)).flywheel.review == "rules"
    # DPO labels a pair's last answers alone and its exam is its own pairs' held-out prompts: trusted clients suffice
    dpo = profile({"review": "rules"}, serve="{capture: {trusted_clients: [curator]}}", train="{stage: dpo}")
    assert load_profile(str(dpo)).train.stage == "dpo"
    with pytest.raises(BadInput, match=r"flywheel.review rules needs serve.capture.trusted_clients$"):
        load_profile(str(profile({"review": "rules"}, train="{stage: dpo}")))
    with pytest.raises(BadInput, match="anonymous is whoever reaches a gateway without keys"):
        load_profile(str(profile({}, serve="{capture: {trusted_clients: [anonymous]}}")))


def test_other_data_is_judged_on_its_own_split_and_the_profiles_exam_stays_with_its_own_data(tmp_path, monkeypatch):
    """cpu-tiny's curated exam (antonyms) is the exam of cpu-tiny's data; a user's --data is judged on a hash split
    of itself unless the run names its exam; the curated set stays the exam of harvested records."""
    data_dir = PROJECT_ROOT / "profiles" / "data"
    exam, finance = str(data_dir / "antonyms-eval.jsonl"), str(data_dir / "finance_qa_zh.jsonl")
    own = load_profile("cpu-tiny").data
    assert (own.eval_source, own.harvest_eval_source) == (exam, None)
    monkeypatch.chdir(PROJECT_ROOT)  # the profile's own data named as a user would, relative to the working folder
    assert load_profile("cpu-tiny", data="profiles/data/antonyms.jsonl").data.eval_source == exam
    for other in (
        load_profile("cpu-tiny", data=finance).data,
        load_profile("cpu-tiny", [f"data.source={finance}"]).data,
        load_profile("cpu-tiny", data="s3://datasets/sft/").data,
    ):
        assert (other.eval_source, other.harvest_eval_source, other.curated_exam) == (None, exam, exam)
    assert load_profile("cpu-tiny", data=finance, eval_data="profile").data.eval_source == exam  # retrain, flywheel
    named = load_profile("cpu-tiny", data=finance, eval_data="s3://exams/qa/").data
    assert (named.eval_source, named.harvest_eval_source) == ("s3://exams/qa/", None)
    held_out = str(tmp_path / "held_out.jsonl")
    assert load_profile("cpu-tiny", [f"data.eval_source={held_out}"], finance).data.eval_source == held_out
    assert load_profile("cpu-tiny", data=finance, eval_data="").data.eval_source is None  # an empty run parameter
    # a profile without a curated exam: nothing moves
    assert load_profile("cpu-tiny-qa-zh", data=finance).data.harvest_eval_source is None


def test_a_name_with_a_trailing_newline_is_no_triton_or_profile_name():
    """Issue 74, a Low finding: the names' `$` matched before a trailing newline, so `svc\n` passed as a Triton model
    name (the registry's, a route table's) and a profile name."""
    from pydantic import TypeAdapter, ValidationError

    from tasks.control.contract import RoutesError, RouteTable
    from tasks.platform.config.base import TritonName
    from tasks.platform.config.loading import on_disk_profile

    with pytest.raises(ValidationError, match="is not a Triton model name"):
        TypeAdapter(TritonName).validate_python("svc\n")
    assert TypeAdapter(TritonName).validate_python("svc") == "svc"
    assert on_disk_profile("cpu-tiny\n") is None and on_disk_profile("cpu-tiny") is not None
    with pytest.raises(RoutesError, match="is not a model name"):
        RouteTable.of({"service": "svc", "champion": {"name": "svc-v1\n"}})
