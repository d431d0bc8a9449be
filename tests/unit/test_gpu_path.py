"""The GPU path on a CPU machine: every GPU profile validates, and what it renders (the ModelOpt and
TensorRT-LLM commands, the LLM API arguments, the tensorrtllm Triton model repository) matches the
reviewed golden files.

Regenerate after a change:  LLMOPS_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_gpu_path.py (the run that
rewrites fails; review the diff, then run again)
"""

import json
import os
import shlex
from pathlib import Path

import pytest

from tasks.build_engine import check_cache_key, require_gpu_for
from tasks.platform.config import PROFILES_DIR, available_profiles, load_profile
from tasks.platform.errors import BadInput
from tasks.serving import tensorrt_llm
from tasks.serving.llm_api import llm_args
from tasks.serving.models import tensorrtllm_models
from tasks.serving.repository import render_model
from tests.goldens import matches_golden

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
GPU_PROFILES = [p for p in available_profiles() if load_profile(p).hardware.accelerator == "cuda"]
ENGINE_PROFILES = [p for p in GPU_PROFILES if load_profile(p).serve.backend == "tensorrtllm"]  # vLLM: test_vllm_cuda


def rendered_commands(profile_name: str) -> str:
    profile = load_profile(profile_name)
    quantize = tensorrt_llm.quantize_command(
        profile.quantize.modelopt,
        Path("/work/merged"),
        Path("/work/calibration.jsonl"),
        Path("/work/checkpoint"),
        python="python",
    )
    check = tensorrt_llm.check_command(
        Path("/work/checkpoint"),
        Path("/work/llm_args.json"),
        Path("/work/q.jsonl"),
        Path("/work/report.json"),
        profile.evaluate.max_new_tokens,
        python="python",
    )
    return "".join(
        f"# {stage}\n{shlex.join(command)}\n" for stage, command in (("quantize", quantize), ("build_engine", check))
    )


def test_the_three_gpu_profiles_exist_and_validate():
    assert {"qwen-7b-qlora-2xa10", "llama3-8b-h100-fp8", "qwen2-14b-int4-tp2"} <= set(GPU_PROFILES)


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_gpu_profile_header_shows_the_command_to_run_it(profile_name):
    header = [line for line in (PROFILES_DIR / f"{profile_name}.yaml").read_text().splitlines() if line.startswith("#")]
    assert any(f"llmops run --profile {profile_name}" in line for line in header)


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_gpu_stage_commands_match_golden(profile_name):
    matches_golden(GOLDEN / profile_name / "commands.sh", rendered_commands(profile_name))


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_llm_api_arguments_match_golden(profile_name):
    """What build_engine checks the checkpoint under, and Triton's llmapi model.yaml serves it with."""
    rendered = json.dumps(llm_args(load_profile(profile_name)), indent=2, sort_keys=True) + "\n"
    matches_golden(GOLDEN / profile_name / "llm_args.json", rendered)


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_triton_tensorrtllm_repository_matches_golden(profile_name, tmp_path):
    profile = load_profile(profile_name)
    models = tensorrtllm_models(profile, f"{profile.registry.model_name}-v3", Path("/engines/v3"), "e" * 64, 40960)
    for name, (template, values) in models.items():
        folder = render_model(template, tmp_path, name, values)
        config = (folder / "config.pbtxt").read_text()
        assert "${" not in config
        matches_golden(GOLDEN / profile_name / "triton" / name / "config.pbtxt", config)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(models)
    assert sorted(p.name for p in (GOLDEN / profile_name / "triton").iterdir()) == sorted(models)  # none stale


def test_golden_values_are_what_the_profiles_ask_for():
    """The reviewed facts behind the golden files, stated once in words."""
    qwen7b = (GOLDEN / "qwen-7b-qlora-2xa10" / "commands.sh").read_text()
    assert "--qformat int4_awq --dtype float16 --awq_block_size 128" in qwen7b and "--kv_cache_fp8" not in qwen7b
    qwen7b_args = json.loads((GOLDEN / "qwen-7b-qlora-2xa10" / "llm_args.json").read_text())
    assert qwen7b_args["max_input_len"] == 2048 and qwen7b_args["max_seq_len"] == 2048 + 512  # train.cutoff_len
    assert qwen7b_args["tensor_parallel_size"] == 1 and qwen7b_args["backend"] == "pytorch"
    trt7b = (GOLDEN / "qwen-7b-qlora-2xa10" / "triton" / "qwen-7b-sft-v3-trtllm" / "config.pbtxt").read_text()
    assert 'string_value: "0;1"' in trt7b and "count: 2" in trt7b  # two instances, one A10 each
    assert 'string_value: "/engines/v3/engine"' in trt7b and "decoupled: true" in trt7b
    assert 'string_value: "inflight_fused_batching"' in trt7b and 'string_value: "0.85"' in trt7b

    llama = (GOLDEN / "llama3-8b-h100-fp8" / "commands.sh").read_text()
    assert "--qformat fp8 --dtype bfloat16 --kv_cache_fp8" in llama and "--awq_block_size" not in llama
    assert "python -m tasks.runners.tensorrt_llm_check --model_dir /work/checkpoint" in llama
    llama_args = json.loads((GOLDEN / "llama3-8b-h100-fp8" / "llm_args.json").read_text())
    assert (llama_args["max_input_len"], llama_args["max_num_tokens"], llama_args["max_batch_size"]) == (
        4096,
        16384,
        256,
    )

    qwen14b = (GOLDEN / "qwen2-14b-int4-tp2" / "commands.sh").read_text()
    assert "--qformat int4_awq --dtype bfloat16 --awq_block_size 128" in qwen14b and "mpirun" not in qwen14b
    assert json.loads((GOLDEN / "qwen2-14b-int4-tp2" / "llm_args.json").read_text())["tensor_parallel_size"] == 2
    trt14b = (GOLDEN / "qwen2-14b-int4-tp2" / "triton" / "qwen2-14b-sft-v3-trtllm" / "config.pbtxt").read_text()
    assert 'string_value: "0,1"' in trt14b and "count: 1" in trt14b  # one instance over both GPUs


def test_each_candidate_gets_its_own_model_names_and_engine_path():
    profile = load_profile("qwen-7b-qlora-2xa10")
    v3 = tensorrtllm_models(profile, "svc-v3", Path("/engines/a"), "a" * 64, 40960)
    v4 = tensorrtllm_models(profile, "svc-v4", Path("/engines/b"), "b" * 64, 40960)
    assert not set(v3) & set(v4)
    assert v3["svc-v3"][1]["tensorrt_llm_model"] == "svc-v3-trtllm"
    assert v3["svc-v3-trtllm"][1]["engine_dir"].endswith("/engines/a/engine")
    assert v4["svc-v4-trtllm"][1]["engine_dir"].endswith("/engines/b/engine")


def test_check_cache_key_changes_with_each_of_its_inputs():
    base = ("a" * 64, {"max_batch_size": 64}, "1.2.1", "sm90 NVIDIA H100", "d" * 64, {"max_new_tokens": 8})
    variants = [
        ("b" * 64, *base[1:]),
        (base[0], {"max_batch_size": 128}, *base[2:]),
        (*base[:2], "1.3.0", *base[3:]),
        (*base[:3], "sm86 NVIDIA A10", *base[4:]),
        (*base[:4], "e" * 64, base[5]),
        (*base[:5], {"max_new_tokens": 16}),
    ]
    keys = {str(check_cache_key(*v)) for v in [base, *variants]}
    assert len(keys) == 7


def test_profile_rules_for_the_gpu_backends():
    with pytest.raises(BadInput, match="quantize.backend modelopt needs hardware.accelerator cuda"):
        load_profile("cpu-tiny", ["quantize.backend=modelopt"])
    with pytest.raises(BadInput, match="loads Hugging Face checkpoints: quantize.backend modelopt or none"):
        load_profile("qwen-7b-qlora-2xa10", ["quantize.backend=onnx-int8"])
    with pytest.raises(BadInput, match="tensor_parallel_size x pipeline_parallel_size = 4 exceeds hardware.gpus 2"):
        load_profile("qwen2-14b-int4-tp2", ["engine.pipeline_parallel_size=2"])
    with pytest.raises(BadInput, match="engine.max_num_tokens 2048 is below train.cutoff_len 4096"):
        load_profile("llama3-8b-h100-fp8", ["engine.max_num_tokens=2048"])
    load_profile("llama3-8b-h100-fp8", ["engine.max_num_tokens=2048", "engine.enable_chunked_prefill=true"])
    with pytest.raises(BadInput, match="quantize.modelopt.qformat"):
        load_profile("llama3-8b-h100-fp8", ["quantize.modelopt.qformat=int8_wo"])


def test_the_removed_engine_backend_is_refused_with_what_to_use_instead():
    with pytest.raises(BadInput, match="tensorrt-llm .* was removed.*use quantize.backend modelopt"):
        load_profile("llama3-8b-h100-fp8", ["quantize.backend=tensorrt-llm"])


def test_nvfp4_is_a_config_error_unless_the_gpu_is_blackwell():
    with pytest.raises(BadInput, match="nvfp4 needs a Blackwell GPU .* not H100: use fp8 or int4_awq"):
        load_profile("llama3-8b-h100-fp8", ["quantize.modelopt.qformat=nvfp4"])
    with pytest.raises(BadInput, match="nvfp4 needs a Blackwell GPU .* not None"):
        load_profile("llama3-8b-h100-fp8", ["quantize.modelopt.qformat=nvfp4", "hardware.gpu_type=null"])
    blackwell = load_profile("llama3-8b-h100-fp8", ["quantize.modelopt.qformat=nvfp4", "hardware.gpu_type=B200"])
    assert "--qformat nvfp4" in shlex.join(
        tensorrt_llm.quantize_command(blackwell.quantize.modelopt, Path("/m"), Path("/c"), Path("/o"))
    )


def test_an_nvfp4_checkpoint_is_refused_on_a_gpu_before_blackwell(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    require_gpu_for(tmp_path, "sm100 NVIDIA B200")
    with pytest.raises(BadInput, match=r"NVFP4 checkpoint needs a Blackwell GPU \(sm100\+\), this is sm90 NVIDIA H100"):
        require_gpu_for(tmp_path, "sm90 NVIDIA H100")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    require_gpu_for(tmp_path, "sm89 NVIDIA L40S")


def test_llm_args_take_prompt_lengths_from_training_not_from_the_eval_split():
    profile = load_profile("qwen-7b-qlora-2xa10", ["train.cutoff_len=3000", "engine.max_output_len=100"])
    args = llm_args(profile)
    assert (args["max_input_len"], args["max_seq_len"]) == (3000, 3100)
    extra = llm_args(load_profile("qwen-7b-qlora-2xa10", ["engine.extra_args={enable_attention_dp: true}"]))
    assert extra["enable_attention_dp"] is True


def test_tensorrt_llm_stages_refuse_clearly_without_tensorrt_llm(tmp_path):
    try:
        import tensorrt_llm as _  # noqa: F401

        pytest.skip("tensorrt_llm is installed here")
    except ImportError:
        pass
    with pytest.raises(BadInput, match=r"tensorrt_llm is not installed here: .*infra/images/trtllm.Dockerfile"):
        tensorrt_llm.installed_version()


def test_qlora_config_for_two_gpus_launches_torchrun_with_4bit_base():
    from tasks.train import launch_env, llamafactory_config

    profile = load_profile("qwen-7b-qlora-2xa10")
    config = llamafactory_config(profile.train, Path("/m"), Path("/d"), Path("/o"), None)
    assert config["quantization_bit"] == 4 and config["quantization_method"] == "bnb"
    assert config["lora_target"] == "q_proj,v_proj" and config["lora_rank"] == 8 and config["lora_alpha"] == 32
    assert config["fp16"] is True and config["include_num_input_tokens_seen"] == "non_padding"
    env = launch_env(profile.hardware)
    assert env["FORCE_TORCHRUN"] == "1" and env["NPROC_PER_NODE"] == "2"


def test_gpu_profiles_name_models_that_exist_with_the_modules_they_target():
    sources = {name: load_profile(name) for name in ("qwen-7b-qlora-2xa10", "qwen2-14b-int4-tp2")}
    assert sources["qwen-7b-qlora-2xa10"].base_model.source == "Qwen/Qwen2.5-7B-Instruct"
    assert sources["qwen2-14b-int4-tp2"].base_model.source == "Qwen/Qwen2.5-14B-Instruct"
    for profile in sources.values():  # Qwen2 architecture: separate projections, no remote code
        assert set(profile.train.lora_target.split(",")) <= {"q_proj", "k_proj", "v_proj", "o_proj", "all"}


def test_the_engine_model_reshapes_its_scalar_inputs_as_upstream_does():
    """tensorrtllm_backend all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt: request_output_len
    and streaming carry `reshape: { shape: [ ] }` like every other per-request scalar."""
    config = (Path(__file__).resolve().parents[2] / "infra/triton/tensorrtllm/tensorrt_llm/config.pbtxt").read_text()
    for name in ("request_output_len", "streaming", "input_lengths", "end_id"):
        line = next(line for line in config.splitlines() if f'name: "{name}"' in line)
        assert "reshape: { shape: [ ] }" in line, line


def test_an_ngc_tritonserver_runs_with_its_own_environment(monkeypatch):
    """Only the nvidia-pytriton binary gets this venv's libraries and Python; an image without the wheel
    must not need it (importing pytriton there would fail)."""
    import sys

    from tasks.serving.server import server_env

    monkeypatch.setitem(sys.modules, "pytriton", None)  # as in an NGC image: not installed
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/tritonserver/lib")
    env = server_env(bundled=False)
    assert env["LD_LIBRARY_PATH"] == "/opt/tritonserver/lib" and env["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize(
    ("profile_name", "spans_gpus"),
    [("qwen2-14b-int4-tp2", True), ("qwen-7b-qlora-2xa10", True), ("llama3-8b-h100-fp8", False)],
)
def test_triton_starts_in_orchestrator_mode_where_models_span_gpus(profile_name, spans_gpus, tmp_path):
    """TP2 (one instance over "0,1") and two single-GPU instances ("0;1") need the backend's orchestrator
    mode: tritonserver as MPI rank 0 alone, model ranks spawned by the backend; one GPU needs nothing."""
    from tasks.serving.champion import triton_launch

    launcher, env = triton_launch(load_profile(profile_name), tmp_path)
    if spans_gpus:
        assert launcher == ["mpirun", "--allow-run-as-root", "-n", "1"]
        assert env == {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
    else:
        assert (launcher, env) == ([], {})
    assert triton_launch(load_profile("cpu-tiny"), tmp_path) == ([], {})


def test_an_engine_built_by_another_tensorrt_llm_is_refused_before_loading(tmp_path):
    import json

    from tasks.platform.errors import CheckFailed

    engine = tmp_path / "qwen-7b-sft-v3" / "engine"
    engine.mkdir(parents=True)
    (engine / "config.json").write_text(json.dumps({"version": "0.19.0", "pretrained_config": {}, "build_config": {}}))
    assert tensorrt_llm.engine_version(engine) == "0.19.0"
    tensorrt_llm.require_serving_version(engine, "0.19.0", "http://triton:8000")  # same release: fine
    with pytest.raises(CheckFailed) as refused:
        tensorrt_llm.require_serving_version(engine, "0.20.0", "http://triton:8000")
    assert str(refused.value) == (
        "engine qwen-7b-sft-v3 was built with TensorRT-LLM 0.19.0, but Triton at http://triton:8000 serves "
        "TensorRT-LLM 0.20.0 (serve.tensorrtllm.server_version): rebuild the engine with 0.20.0 or serve it "
        "on a 0.19.0 image"
    )
    (engine / "config.json").write_text(json.dumps({"pretrained_config": {}}))
    with pytest.raises(CheckFailed, match="no TensorRT-LLM version"):
        tensorrt_llm.engine_version(engine)


# Public model shapes (their config.json on the hub): layers, heads, KV heads, hidden size, parameters.
SHAPES = {
    "Qwen/Qwen2.5-7B-Instruct": (28, 28, 4, 3584, 7.62e9),
    "Qwen/Qwen2.5-14B-Instruct": (48, 40, 8, 5120, 14.8e9),
    "meta-llama/Meta-Llama-3-8B-Instruct": (32, 32, 8, 4096, 8.03e9),
}
WEIGHT_BYTES = {"full_prec": 2, "int8_wo": 1, "fp8": 1, "int4_awq": 0.5, "w4a8_awq": 0.5}


def engine_like(profile, folder: Path, qformat: str | None = None) -> Path:
    """An engine folder with the config.json keys and rank files trtllm-build writes, sized as this
    profile's model would be (sparse files: nothing is written)."""
    import json

    checkpoint, ranks = profile.quantize.modelopt, profile.engine.world_size
    qformat = qformat or checkpoint.qformat
    layers, heads, kv_heads, hidden, params = SHAPES[profile.base_model.source]
    config = {
        "version": "0.20.0",
        "pretrained_config": {
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "hidden_size": hidden,
            "dtype": checkpoint.dtype,
            "mapping": {
                "tp_size": profile.engine.tensor_parallel_size,
                "pp_size": profile.engine.pipeline_parallel_size,
            },
            "quantization": {"kv_cache_quant_algo": "FP8" if checkpoint.kv_cache_fp8 else None},
        },
        "build_config": {"max_seq_len": llm_args(profile)["max_seq_len"]},
    }
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    for rank in range(ranks):
        with open(folder / f"rank{rank}.engine", "wb") as engine:
            engine.truncate(int(params * WEIGHT_BYTES[qformat] / ranks))
    return folder


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_each_gpu_profile_fits_champion_and_candidate_on_its_gpus(profile_name, tmp_path):
    from tasks.serving import memory_plan

    profile = load_profile(profile_name)
    engine = memory_plan.footprint(engine_like(profile, tmp_path / "engine"))
    tokens = memory_plan.kv_tokens_for_canary(engine, profile.hardware.gpu_memory_gb, profile_name)
    used = 2 * engine.weights_bytes + 2 * tokens * engine.kv_bytes_per_token
    assert used <= profile.hardware.gpu_memory_gb * memory_plan.GIB * (1 - memory_plan.HEADROOM)
    assert tokens >= 4 * llm_args(profile)["max_seq_len"], tokens  # room for a few sequences each, not just one


def test_a_canary_that_cannot_fit_is_refused_with_what_to_change(tmp_path):
    """Two fp16 7B engines on one 24 GB A10: 2 x 14.2 GiB of weights alone exceed the GPU."""
    from tasks.serving import memory_plan

    profile = load_profile("qwen-7b-qlora-2xa10")
    engine = memory_plan.footprint(engine_like(profile, tmp_path / "engine", qformat="full_prec"))
    assert engine.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, fp16
    with pytest.raises(BadInput) as refused:
        memory_plan.kv_tokens_for_canary(engine, 24, "qwen-7b-sft-v4")
    message = str(refused.value)
    assert message.startswith("qwen-7b-sft-v4: champion and candidate engines (14.2 GiB of weights per GPU each)")
    assert "24 GB GPUs (hardware.gpu_memory_gb)" in message and "give the candidate GPUs of its own" in message


class StubTensor:
    """pb_utils.Tensor as the BLS uses it."""

    def __init__(self, name, array):
        import numpy as np

        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class StubResponse:
    def __init__(self, output_tensors=(), error=None):
        self.output_tensors, self._error = list(output_tensors), error

    def has_error(self):
        return self._error is not None


def stub_engine_responses(tokens: list[int], streaming: bool):
    """The engine model's responses: the answer a few byte-level tokens at a time, or whole."""
    if not streaming:
        yield StubResponse(
            [StubTensor("output_ids", [[tokens + [0, 0]]]), StubTensor("sequence_length", [[len(tokens)]])]
        )
        return
    for start in range(0, len(tokens), 3):
        chunk = tokens[start : start + 3]
        yield StubResponse([StubTensor("output_ids", [[chunk]]), StubTensor("sequence_length", [[len(chunk)]])])
    yield StubResponse()  # the final flag alone


def stub_pb_utils(tokens: list[int]):
    """A stand-in for Triton's pb_utils: the calls the BLS makes, with the preprocessing and engine models."""
    import types

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names):
            self.model, self.inputs = model_name, {t.name(): t for t in inputs}

        def exec(self, decoupled=False):
            if self.model.endswith("-pre"):
                assert set(self.inputs) <= {"text_input", "chat_history", "max_tokens", "exclude_input_in_output"}
                names = ("input_ids", "input_lengths", "request_output_len", "end_id", "pad_id")
                return StubResponse([StubTensor(n, [[1]]) for n in names])
            assert decoupled and self.model.endswith("-trtllm") and "streaming" in self.inputs
            return stub_engine_responses(tokens, bool(self.inputs["streaming"].as_numpy().reshape(-1)[0]))

    return types.SimpleNamespace(
        Tensor=StubTensor,
        InferenceRequest=InferenceRequest,
        InferenceResponse=StubResponse,
        TritonError=str,
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
        get_output_tensor_by_name=lambda r, n: next((t for t in r.output_tensors if t.name() == n), None),
    )


class StubSender:
    """A decoupled response sender that records each text piece, and None for the final flag."""

    def __init__(self, into: list):
        self.into = into

    def send(self, response=None, flags=0):
        assert response is None or not response.has_error(), response._error
        if response is not None:
            self.into.append(response.output_tensors[0].as_numpy().reshape(-1)[0].decode())
        if flags:
            self.into.append(None)


def load_rendered_bls(tmp_path: Path, tokenizer_dir: Path, monkeypatch):
    """The entry BLS rendered for a GPU profile (with its model_text.py), imported the way the stub does it."""
    import importlib.util
    import json
    import sys

    profile = load_profile("qwen-7b-qlora-2xa10")
    template, values = tensorrtllm_models(profile, "m-v1", tmp_path / "engine", "e" * 64, 40960)["m-v1"]
    bls = render_model(template, tmp_path / "repository", "m-v1", values)
    monkeypatch.syspath_prepend(str(bls / "1"))
    monkeypatch.delitem(sys.modules, "model_text", raising=False)
    spec = importlib.util.spec_from_file_location("tensorrtllm_bls", bls / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = {
        "parameters": {
            "preprocessing_model": {"string_value": "m-v1-pre"},
            "tensorrt_llm_model": {"string_value": "m-v1-trtllm"},
            "engine_decoupled": {"string_value": "true"},
            "tokenizer_dir": {"string_value": str(tokenizer_dir)},
        }
    }
    model.initialize({"model_config": json.dumps(config)})
    return model


def test_the_tensorrtllm_entry_model_streams_whole_characters(tmp_path, monkeypatch):
    """The entry BLS's own logic (infra/triton/tensorrtllm/bls/1/model.py), run outside Triton: a stand-in
    for Triton's pb_utils (the calls the router also makes on a real Triton) and an engine that streams a
    Chinese answer a few byte-level tokens per response. The client gets whole characters that add up
    to the answer, in streaming and in one response."""
    import sys
    import types

    from transformers import AutoTokenizer

    from tasks.base_model import train_tokenizer

    tokenizer_dir = tmp_path / "tokenizer"
    train_tokenizer(["opposite of hot", "cold"] * 4, 300).save_pretrained(tokenizer_dir)
    answer = "利率下调，债券价格上涨。"
    tokens = AutoTokenizer.from_pretrained(tokenizer_dir)(answer, add_special_tokens=False)["input_ids"]
    assert len(tokens) > len(answer)  # characters split over byte tokens
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub_pb_utils(tokens))
    model = load_rendered_bls(tmp_path, tokenizer_dir, monkeypatch)

    for stream in (True, False):
        sent: list[str | None] = []
        request = types.SimpleNamespace(
            inputs=lambda s=stream: [StubTensor("text_input", [[b"q"]]), StubTensor("stream", [[s]])],
            get_response_sender=lambda into=sent: StubSender(into),
        )
        model.generate(request)
        assert sent[-1] is None and "".join(sent[:-1]) == answer, sent
        assert not any("\ufffd" in piece for piece in sent[:-1])
        assert len(sent) > 3 if stream else len(sent) == 2
    model.finalize()
