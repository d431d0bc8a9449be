"""serve.backend llmapi without a GPU: the canary's memory plan on each GPU profile, the rendered model's own
logic (infra/triton/llmapi/1/model.py) with a stand-in LLM, and a plain tritonserver process for it."""

import asyncio
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tasks.platform.config import available_profiles, load_profile
from tasks.platform.errors import BadInput
from tasks.serving import memory_plan
from tasks.serving.llm_api import llm_args
from tasks.serving.model_config import serving_model
from tasks.serving.repository import config_parameters, render_model

GPU_PROFILES = [p for p in available_profiles() if load_profile(p).serve.backend == "llmapi"]
# Public model shapes (their config.json on the hub): layers, heads, KV heads, hidden, intermediate, vocab, parameters
SHAPES = {
    "Qwen/Qwen2.5-7B-Instruct": (28, 28, 4, 3584, 18944, 152064, 7.62e9),
    "Qwen/Qwen2.5-14B-Instruct": (48, 40, 8, 5120, 13824, 152064, 14.8e9),
    "meta-llama/Meta-Llama-3-8B-Instruct": (32, 32, 8, 4096, 14336, 128256, 8.03e9),
    "Qwen/Qwen2.5-72B-Instruct": (80, 64, 8, 8192, 29568, 152064, 72.7e9),
}
WEIGHT_BYTES = {"none": 2, "fp8": 1, "int4_awq": 0.5, "nvfp4": 0.5}  # per parameter; none: bf16/fp16


def checkpoint_like(profile, folder: Path, qformat: str | None = None) -> Path:
    """A Hugging Face checkpoint folder as ModelOpt's export writes it (config.json, hf_quant_config.json,
    *.safetensors), sized as this profile's model would be (a sparse file: nothing is written)."""
    quantize = profile.quantize.modelopt
    layers, heads, kv_heads, hidden, intermediate, vocab, params = SHAPES[profile.base_model.source]
    folder.mkdir(parents=True)
    config = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "torch_dtype": quantize.dtype,
    }
    (folder / "config.json").write_text(json.dumps(config))
    kv_algo = "FP8" if quantize.kv_cache_fp8 else None
    (folder / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": kv_algo}}))
    with open(folder / "model.safetensors", "wb") as weights:
        weights.truncate(int(params * WEIGHT_BYTES[qformat or quantize.qformat]))
    return folder


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_each_gpu_profile_fits_champion_and_candidate_on_its_gpus(profile_name, tmp_path):
    profile = load_profile(profile_name)
    args = llm_args(profile)
    tokens = memory_plan.canary_kv_tokens(profile, checkpoint_like(profile, tmp_path / "ckpt"), profile_name)
    model = memory_plan.footprint(
        tmp_path / "ckpt", args["tensor_parallel_size"], 1, args["max_num_tokens"], args["max_batch_size"]
    )
    gib = memory_plan.GIB
    # each model: its worker's context and workspaces, the Triton stub's own CUDA context, the decode CUDA graphs
    runtime = memory_plan.RUNTIME_RESERVE_GIB + memory_plan.CUDA_CONTEXT_GIB + memory_plan.CUDA_GRAPHS_GIB
    per_model = model.weights_bytes + model.activation_bytes + runtime * gib
    real = memory_plan.GPU_GIB[profile.hardware.gpu_type] * gib
    held = memory_plan.TRITONSERVER_GIB * gib + 2 * per_model + 2 * tokens * model.kv_bytes_per_token
    assert held <= real * (1 - memory_plan.FRAGMENTATION) < held + 2 * model.kv_bytes_per_token  # all of it, no more
    assert tokens >= 4 * args["max_seq_len"], tokens  # room for a few sequences each, not just one


def test_the_plan_counts_every_cuda_process_and_pool_a_canary_puts_on_a_gpu():
    """Besides the TensorRT-LLM workers: tritonserver's own context and 64 MB CUDA pool on every GPU, each model's
    Triton stub (a CUDA process of its own) and its decode CUDA graphs, captured after the KV cache is sized."""
    assert memory_plan.TRITONSERVER_GIB >= 64 / 1024 and memory_plan.CUDA_CONTEXT_GIB > 0
    assert memory_plan.CUDA_GRAPHS_GIB > 0 and memory_plan.runtime_gib_per_model() == pytest.approx(3.0)
    gpu_doc = (Path(__file__).resolve().parents[2] / "docs" / "gpu.md").read_text()
    assert "419k tokens per model" in gpu_doc and "64k" in gpu_doc  # the planned budgets the docs state


def test_gpu_memory_is_what_the_gpu_reports_not_what_it_is_sold_as():
    assert memory_plan.gpu_gib("A10", 24, "p") == pytest.approx(22.49)  # not 24
    assert memory_plan.gpu_gib("h100", 80, "p") == pytest.approx(79.65)
    assert memory_plan.gpu_gib("B200", 180, "p") == pytest.approx(180e9 / 2**30)  # unknown type: GB -> GiB
    with pytest.raises(BadInput, match="hardware.gpu_memory_gb is not set"):
        memory_plan.gpu_gib("B200", None, "profile p")


def test_a_canary_that_cannot_fit_is_refused_with_what_to_change(tmp_path):
    """Two bf16 7B checkpoints on one A10 (22.5 GiB): 2 x 14.2 GiB of weights alone exceed the GPU."""
    profile = load_profile("qwen-7b-qlora-2xa10")
    ckpt = checkpoint_like(profile, tmp_path / "ckpt", qformat="none")
    model = memory_plan.footprint(ckpt, 1, 1, profile.engine.max_num_tokens, profile.engine.max_batch_size)
    assert model.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, fp16
    with pytest.raises(BadInput) as refused:
        memory_plan.canary_kv_tokens(profile, ckpt, "qwen-7b-sft-v4")
    message = str(refused.value)
    assert message.startswith("qwen-7b-sft-v4: champion and candidate (14.2 GiB of weights")
    assert "on 22.5 GiB GPUs" in message and "give the candidate GPUs of its own" in message


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_triton_for_llmapi_is_a_plain_process(profile_name, tmp_path):
    """No mpirun, no orchestrator flags: an LLM spanning GPUs spawns its own MPI workers."""
    from tasks.serving.champion import triton_launch

    assert triton_launch(load_profile(profile_name), tmp_path) == ([], {})


class Tensor:
    def __init__(self, name, value):
        self._name, self._array = name, np.asarray(value)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class StubLLM:
    """tensorrt_llm.LLM.generate_async's result as the model uses it: async-iterable RequestOutputs whose
    outputs[0].text is the whole answer so far (one more token decoded each step), .length the tokens made so far,
    and .finish_reason "stop" on the last."""

    def __init__(self, prefixes):
        self.prefixes, self.calls = prefixes, []

    def generate_async(self, inputs, sampling_params, streaming=False):
        self.calls.append((inputs, sampling_params, streaming))
        prefixes = self.prefixes

        class Outputs:
            def abort(self):
                pass

            async def __aiter__(self):
                for n, text in enumerate(prefixes, 1):
                    last = n == len(prefixes)
                    completion = types.SimpleNamespace(text=text, length=n, finish_reason="stop" if last else None)
                    yield types.SimpleNamespace(outputs=[completion], finished=n == len(prefixes))

        return Outputs()


def llmapi_module(tmp_path, monkeypatch, model_dir: Path | None = None):
    """The rendered llmapi model.py (and the helpers copied next to it), imported as Triton's stub imports it."""
    stub = types.SimpleNamespace(
        Tensor=Tensor,
        InferenceResponse=lambda output_tensors=(), error=None: (list(output_tensors), error),
        TritonError=str,
        TritonModelException=RuntimeError,
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
    )
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    template, values = serving_model(load_profile("qwen-7b-qlora-2xa10"), model_dir or tmp_path, "e" * 64, 40960)
    folder = render_model(template, tmp_path / "repository", "m-v1", values)
    monkeypatch.syspath_prepend(str(folder / "1"))
    for helper in ("model_text", "engine_guard"):
        monkeypatch.delitem(sys.modules, helper, raising=False)
    spec = importlib.util.spec_from_file_location("llmapi_model", folder / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, folder


def llmapi_model(tmp_path, tokenizer, prefixes, monkeypatch):
    """The rendered llmapi model with its engine replaced by StubLLM (TensorRT-LLM 1.2.1's, whose sampler has no
    per-request seeds)."""
    module, _ = llmapi_module(tmp_path, monkeypatch)
    model = module.TritonPythonModel()
    model.tokenizer, model.chat, model.default_max_tokens, model.context_tokens = tokenizer, True, 16, 4096
    model.SamplingParams = lambda **kwargs: kwargs
    model.trtllm_version, model.seeded_sampling = "1.2.1", False
    model.llm = StubLLM(prefixes)
    model.responses = __import__("queue").Queue()
    return module, model


def test_the_llmapi_model_encodes_like_training_and_streams_whole_characters(tmp_path, monkeypatch):
    from tasks.base_model import train_tokenizer
    from tasks.quality.chat import encode_prompt
    from tasks.quality.models import load_tokenizer

    train_tokenizer(["opposite of hot", "cold"] * 4, 300).save_pretrained(tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    answer = "利率下调，债券价格上涨。"
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    prefixes = [tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1)]
    assert any(p.endswith("\ufffd") for p in prefixes)  # characters split over byte tokens
    module, model = llmapi_model(tmp_path, tokenizer, prefixes, monkeypatch)
    assert module.instance_gpus("0;1", "m-v1_0_1") == "1" and module.instance_gpus("0,1", "m-v1_0_0") == "0,1"

    for stream in (True, False):
        inputs = [Tensor("text_input", [[b"q"]]), Tensor("stream", [[stream]]), Tensor("max_tokens", [[8]])]
        request = types.SimpleNamespace(inputs=lambda inputs=inputs: inputs, is_cancelled=lambda: False)
        job = model.parse(request)
        assert job[0] == encode_prompt(tokenizer, "q", [], True)  # the chat template, as training
        assert job[1] == {
            "max_tokens": 8,
            "min_tokens": None,
            "temperature": 0.0,
            "top_k": None,
            "top_p": None,
            "seed": None,
        }
        asyncio.run(model.generate(request, None, *job))
        pieces, counted, reasons = [], 0, []
        while not model.responses.empty():
            _, (tensors, error), flags = model.responses.get()
            assert error is None
            pieces.append(tensors[0].as_numpy().reshape(-1)[0].decode())
            named = {t.name(): t.as_numpy().reshape(-1)[0] for t in tensors}
            counted += int(named["token_count"])
            reasons += [named["finish_reason"].decode()] if "finish_reason" in named else []
        assert flags == 1 and not any("\ufffd" in p for p in pieces)
        assert counted == len(ids) and reasons == ["stop"]  # usage: the tokens the LLM made, and why it stopped
        if stream:
            assert "".join(pieces) == answer and len(pieces) > 3
        else:
            assert pieces == [f"q{answer}"]  # one response, the prompt echoed as the llm model does
    assert model.llm.calls[0][2] is True  # streaming from the LLM either way: cancellation every few steps


def request_of(**inputs):
    tensors = [Tensor(name, [[value]]) for name, value in inputs.items()]
    return types.SimpleNamespace(inputs=lambda: tensors, is_cancelled=lambda: False)


def test_a_seeded_sampled_request_is_refused_where_tensorrt_llm_ignores_seeds(tmp_path, monkeypatch):
    """TensorRT-LLM 1.2's TorchSampler ignores SamplingParams.seed (#17172 came after 1.2.1): a sampled answer asked
    for with random_seed could not be reproduced, so it is refused with the reason; greedy answers need no seed."""
    from tasks.base_model import train_tokenizer
    from tasks.quality.models import load_tokenizer

    train_tokenizer(["opposite of hot", "cold"] * 4, 300).save_pretrained(tmp_path / "tok")
    module, model = llmapi_model(tmp_path, load_tokenizer(tmp_path / "tok"), ["cold"], monkeypatch)
    with pytest.raises(ValueError, match=r"^random_seed: TensorRT-LLM 1\.2\.1 samples without per-request seeds"):
        model.parse(request_of(text_input=b"q", temperature=np.float32(0.7), random_seed=np.uint64(7)))
    assert model.parse(request_of(text_input=b"q", temperature=np.float32(0.7)))[1]["seed"] is None
    assert model.parse(request_of(text_input=b"q", random_seed=np.uint64(7)))[1]["seed"] is None  # greedy
    model.seeded_sampling = True  # a TensorRT-LLM with per-request seeds
    assert (
        model.parse(request_of(text_input=b"q", temperature=np.float32(0.7), random_seed=np.uint64(7)))[1]["seed"] == 7
    )
    assert [module.honours_seeds(v) for v in ("1.2.1", "1.1.0", "1.3.0rc29", "1.4.0rc1")] == [False, False, True, True]


def test_the_llmapi_model_pins_its_gpus_and_clears_mpi_state_as_upstreams_multi_instance_model(tmp_path, monkeypatch):
    """Inherited MPI job variables are gone once the model is imported; CUDA_VISIBLE_DEVICES and
    TRTLLM_VISIBLE_DEVICES name the instance's GPUs before tensorrt_llm is imported; the LLM gets gpus_per_node; and
    the processes the LLM started (its MPI workers) are handed to the watcher that kills them with tritonserver."""
    import os
    import subprocess

    from tasks.base_model import train_tokenizer

    for name in (
        "CUDA_VISIBLE_DEVICES",
        "TRTLLM_VISIBLE_DEVICES",
        "OMPI_ALLOW_RUN_AS_ROOT",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
    ):
        monkeypatch.delenv(name, raising=False)  # restored after the test: initialize sets them
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("PMIX_NAMESPACE", "mpirun-job")
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "tcp://x")
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_include", "eth0")  # configuration: kept
    checkpoint = tmp_path / "checkpoint"
    train_tokenizer(["opposite of hot", "cold"] * 4, 300).save_pretrained(checkpoint)
    (checkpoint / "model.safetensors").write_bytes(b"")
    module, folder = llmapi_module(tmp_path, monkeypatch, checkpoint)
    assert (folder / "1" / "engine_guard.py").is_file()
    assert "OMPI_COMM_WORLD_RANK" not in os.environ and "PMIX_NAMESPACE" not in os.environ
    assert "OMPI_MCA_orte_hnp_uri" not in os.environ and os.environ.get("OMPI_MCA_btl_tcp_if_include") == "eth0"  # noqa: SIM112 (OpenMPI spells it so)

    seen = {}

    class LLM:
        def __init__(self, model, **kwargs):
            names = ("CUDA_VISIBLE_DEVICES", "TRTLLM_VISIBLE_DEVICES", "OMPI_ALLOW_RUN_AS_ROOT")
            seen.update(model=model, kwargs=kwargs, env={name: os.environ.get(name) for name in names})
            self.worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

        def shutdown(self):
            self.worker.kill()
            self.worker.wait()

    fake = types.ModuleType("tensorrt_llm")
    fake.__version__, fake.LLM, fake.SamplingParams = "1.2.1", LLM, dict
    monkeypatch.setitem(sys.modules, "tensorrt_llm", fake)
    config = json.loads(config_parameters((folder / "config.pbtxt").read_text())["llm_args"])
    parameters = {
        "model_dir": str(checkpoint),
        "gpu_device_ids": "0;1",
        "llm_args": json.dumps(config),
        "apply_chat_template": "true",
        "default_max_tokens": "16",
    }
    model = module.TritonPythonModel()
    model.initialize(
        {
            "model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in parameters.items()}}),
            "model_instance_name": "m-v1_0_1",
            "model_repository": str(folder),
            "model_version": "1",
        }
    )
    try:
        assert seen["env"] == {
            "CUDA_VISIBLE_DEVICES": "1",
            "TRTLLM_VISIBLE_DEVICES": "1",
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
        }
        assert seen["model"] == str(checkpoint) and seen["kwargs"]["gpus_per_node"] == 1
        assert {k: v for k, v in seen["kwargs"].items() if k != "gpus_per_node"} == config
        assert model.seeded_sampling is False
        watched, victims = model.watcher.args[-2:]
        assert watched == f"{os.getppid()},{os.getpid()}" and str(model.llm.worker.pid) in victims.split(",")
    finally:
        model.finalize()
    assert model.watcher.wait(timeout=10) is not None


def test_engine_processes_die_with_a_sigkilled_tritonserver(tmp_path):
    """engine_guard on real processes: a stand-in for tritonserver starts a stub, the stub an engine worker and the
    watcher; tritonserver is SIGKILLed; the worker and the stub are gone within seconds (a vLLM stub was seen stuck in
    its own exit after its tritonserver's SIGKILL, an orphan holding its memory)."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    helpers = Path(__file__).resolve().parents[2] / "tasks" / "serving"
    stub = (
        f"import subprocess, sys, time; sys.path.insert(0, {str(helpers)!r}); import engine_guard; "
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "engine_guard.guard_engine(engine_guard.engine_processes()); "
        f"open({str(tmp_path / 'pids')!r}, 'w').write(f'{{worker.pid}} {{__import__(\"os\").getpid()}}'); time.sleep(600)"
    )
    triton = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {stub!r}]); time.sleep(600)",
        ]
    )
    deadline = time.monotonic() + 30
    while not (tmp_path / "pids").is_file() or not (tmp_path / "pids").read_text():
        assert time.monotonic() < deadline, "the stand-in stub never started its worker"
        time.sleep(0.1)
    worker, stub_pid = (int(pid) for pid in (tmp_path / "pids").read_text().split())
    try:
        time.sleep(1)
        assert psutil.pid_exists(worker)  # nothing kills it while tritonserver lives
        triton.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        for pid, name in ((worker, "engine worker"), (stub_pid, "stub")):
            while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, f"the {name} outlived tritonserver"
                time.sleep(0.2)
    finally:
        triton.kill()
        triton.wait()
        for pid in (stub_pid, worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
