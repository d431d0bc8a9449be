"""Triton Python-backend model: a ModelOpt Hugging Face checkpoint (or a merged model) served by TensorRT-LLM's
LLM API, `tensorrt_llm.LLM` (PyTorch backend, in-flight batching), behind the `llm` interface every served version
exposes (text_input, chat_history, max_tokens, stream, exclude_input_in_output ...: infra/triton/llm/config.pbtxt).

Why our own model and not upstream's (TensorRT-LLM v1.2.1 triton_backend/all_models/llmapi/tensorrt_llm/1/model.py):
- upstream hands `text_input` to `generate_async` as a string (`_convert_request`: `prompt = text_input[0]`), so
  the LLM tokenizes it without the chat template, and a template rendered to text elsewhere is tokenized again
  with special tokens added: not the token ids training saw. Here the prompt is encoded by model_text.py's
  encode_prompt (the tokenizer's chat template, as training and the other served models) and given as ids;
- upstream streams `output.text` (`_create_response`), the whole answer so far in every response; the router,
  the gateway and genai-perf expect deltas of whole characters (model_text.py's stream_delta);
- its inputs are named differently (`streaming`, `sampling_param_max_tokens`, no chat_history) and it echoes the
  prompt unless `sampling_param_exclude_input_from_output` is sent (helpers.py): a translation in the router would
  make the router depend on the backend of each version it splits traffic between.
What is kept from upstream: the same LLM() keyword arguments (its model.yaml's keys, here the `llm_args`
parameter), the engine on an asyncio loop of its own with responses sent from another thread, and the GPU pinning
and MPI hygiene of its multi-instance mode (upstream's model.py, the 1.2 line as stored @044a90d; the r26.07 image
copies triton_backend/all_models from TensorRT-LLM's release/1.2.1 branch, tensorrtllm_backend r26.07
dockerfile/Dockerfile.triton.trt_llm_backend L18, L174; documented in its docs/llmapi.md "Running Multiple Model
Instances"):
- inherited MPI job variables cleared when this module is imported (upstream L39-80), so the LLM's own MPI world
  never attaches to a job tritonserver may have been started in;
- CUDA_VISIBLE_DEVICES and TRTLLM_VISIBLE_DEVICES set from `gpu_device_ids` before tensorrt_llm (torch) is
  imported (upstream's initialize: CUDA opens the devices at import and spawned children inherit that state; its
  MPI workers take TRTLLM_VISIBLE_DEVICES as their CUDA_VISIBLE_DEVICES);
- LLM(gpus_per_node=<this instance's GPUs>) (upstream: `llm_engine_args["gpus_per_node"] = len(self._gpu_id_list)`).

Processes: tritonserver runs as one plain process (upstream's `--no-mpi` multi-instance mode); each LLM spawns its
own MPI workers, at tensor parallelism 1 too (BaseLLM.__init__: MpiPoolSession(n_workers=world_size);
executor.py GenerationExecutor.create), so candidates load and unload one by one without `mpirun` or the C++
backend's orchestrator flags. Those workers are not tied to this stub's life: engine_guard.py kills them when
tritonserver or the stub dies.

TensorRT-LLM API used (v1.2.1, as upstream's model.py uses it): LLM(model, **kwargs); llm.generate_async(inputs,
sampling_params, streaming=True) -> RequestOutput, async-iterable, with .outputs[0].text (cumulative), .finished,
.abort(); llm.shutdown(); SamplingParams(max_tokens, min_tokens, temperature, top_k, seed) (sampling_params.py). min_tokens
is the gateway's min_tokens, and its ignore_eos as min_tokens = max_tokens ("Lower bound on the number of tokens to
generate. Values < 1 have no effect": SamplingParams' docstring and field, read at the only stored revision of
tensorrt_llm/sampling_params.py, 000a01de (1.0.0rc4); the index holds no copy at the 1.2.1 tag to check it there).
A per-request seed is accepted by SamplingParams but ignored by 1.2's default sampler (TorchLlmArgs.sampler_type
`auto` runs TorchSampler, which took per-request seeds only with NVIDIA/TensorRT-LLM#17172, merged 2026-08-04, after
1.2.1): a sampled request with random_seed is refused there rather than answered unreproducibly.
"""

import asyncio
import json
import os
import queue
import re
import threading

# MPI job and namespace variables (not configuration: OMPI_MCA_*, PMIX_MCA_* stay), as upstream's model clears them
MPI_JOB_VARIABLES = {
    *("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    *("OMPI_COMM_WORLD_NODE_RANK", "OMPI_UNIVERSE_SIZE", "OMPI_FIRST_RANKS", "OMPI_APP_CTX_NUM_PROCS"),
    *("PMIX_RANK", "PMIX_NAMESPACE", "PMIX_SERVER_URI", "PMIX_SERVER_URI2", "PMIX_SERVER_URI21", "PMIX_SERVER_URI3"),
    *("PMIX_SERVER_TMPDIR", "PMIX_SYSTEM_TMPDIR", "PMIX_SECURITY_MODE", "PMIX_GDS_MODULE", "PMIX_BFROPS_MODULE"),
    *("PMIX_PTL_MODULE", "PMIX_VERSION", "PMIX_HOSTNAME"),
    *("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_SPAWNED", "PMI_APPNUM"),
}
MPI_JOB_PREFIXES = ("OMPI_MCA_orte_", "ORTE_")


def clear_inherited_mpi_job(environ):
    for key in [k for k in environ if k in MPI_JOB_VARIABLES or k.startswith(MPI_JOB_PREFIXES)]:
        del environ[key]


clear_inherited_mpi_job(os.environ)

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from engine_guard import engine_processes, guard_engine  # noqa: E402

# engine_guard.py (tasks/serving/) and model_text.py (tasks/text/) are copied next to this file when the model is rendered
from model_roots import served_folder  # noqa: E402
from model_text import chat_history, chat_template_on, encode_prompt, input_value, stream_delta  # noqa: E402

CANCEL_CHECK_EVERY = 16  # decoding steps between two checks that the client still waits
SEEDED_SAMPLING_FROM = (1, 3)  # TensorRT-LLM releases whose default sampler honours SamplingParams.seed (#17172)


def honours_seeds(version):
    """Whether this TensorRT-LLM's default sampler takes per-request seeds: from 1.3 on (#17172), never in 1.2."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= SEEDED_SAMPLING_FROM


def instance_gpus(gpu_device_ids, instance_name):
    """This instance's GPUs: the i-th ';'-separated group, i from the instance name's last number
    (Triton names instances `<group>_<i>`; upstream model.py parses it the same way)."""
    groups = gpu_device_ids.split(";")
    found = re.search(r"_(\d+)$", instance_name or "")
    index = int(found.group(1)) if found else 0
    if index >= len(groups):
        raise ValueError(f"gpu_device_ids {gpu_device_ids!r} has no GPU group for instance {instance_name}")
    return groups[index].strip()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        gpus = instance_gpus(params["gpu_device_ids"], args.get("model_instance_name"))
        # before tensorrt_llm (torch) opens the CUDA devices: the MPI workers the LLM spawns inherit this state, and
        # take TRTLLM_VISIBLE_DEVICES as their CUDA_VISIBLE_DEVICES
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["TRTLLM_VISIBLE_DEVICES"] = gpus
        # OpenMPI refuses to start processes as root without these (mpirun's --allow-run-as-root): containers often
        # run as root, and the LLM's workers are started by OpenMPI
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        llm_args = {**json.loads(params["llm_args"]), "gpus_per_node": len(gpus.split(","))}
        try:
            import tensorrt_llm
            from tensorrt_llm import LLM, SamplingParams
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise pb_utils.TritonModelException(
                f"serve.backend llmapi: tensorrt_llm is not importable by this Triton's Python ({exc}); serve from "
                "NGC tritonserver:26.07-trtllm-python-py3"
            ) from exc
        self.SamplingParams = SamplingParams
        self.trtllm_version = tensorrt_llm.__version__
        self.seeded_sampling = honours_seeds(self.trtllm_version)
        # A relative model_dir is inside this model's version folder: the checkpoint came with the load request.
        model_dir = served_folder(args, params["model_dir"], "model_dir")  # its folder or the store's (model_roots.py)
        if not any(name.endswith(".safetensors") for name in os.listdir(model_dir)):
            raise pb_utils.TritonModelException(f"llmapi: no *.safetensors checkpoint in {model_dir}")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.chat = params.get("apply_chat_template", "true") == "true"
        self.default_max_tokens = int(params.get("default_max_tokens", "16"))
        self.context_tokens = int(llm_args["max_seq_len"])
        self.responses = queue.Queue()
        self.response_thread = threading.Thread(target=self.send_responses, name="llm-responses", daemon=True)
        self.response_thread.start()
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="llm-engine-loop", daemon=True)
        self.loop_thread.start()

        async def create():
            # built off the loop (loading takes minutes), as upstream's _run_llm_engine does
            return await asyncio.get_running_loop().run_in_executor(None, lambda: LLM(model=model_dir, **llm_args))

        try:
            self.llm = asyncio.run_coroutine_threadsafe(create(), self.loop).result()
        except Exception as exc:
            raise pb_utils.TritonModelException(f"TensorRT-LLM LLM for {model_dir} failed to start: {exc}") from exc
        self.watcher = guard_engine(engine_processes())  # its MPI workers die with tritonserver or this stub

    def parse(self, request):
        text = input_value(request, "text_input", None)
        if text is None:
            raise ValueError("text_input is required")
        history = chat_history(input_value(request, "chat_history", ""))
        max_tokens = int(input_value(request, "max_tokens", self.default_max_tokens))
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids = encode_prompt(self.tokenizer, text, history, chat_template_on(request, self.chat))
        if len(ids) + max_tokens > self.context_tokens:
            raise ValueError(
                f"max_tokens {max_tokens} + {len(ids)} prompt tokens exceed the model's context of "
                f"{self.context_tokens} tokens; ask for at most {max(self.context_tokens - len(ids), 0)}"
            )
        seed = input_value(request, "random_seed", None)
        top_k = int(input_value(request, "top_k", 0))
        top_p = float(input_value(request, "top_p", 1.0))
        temperature = max(float(input_value(request, "temperature", 0.0)), 0.0)  # 0: greedy
        if seed is not None and temperature > 0 and not self.seeded_sampling:
            raise ValueError(
                f"random_seed: TensorRT-LLM {self.trtllm_version} samples without per-request seeds (its TorchSampler "
                "ignores them; NVIDIA/TensorRT-LLM#17172 added them after 1.2.1), so this answer could not be "
                "reproduced; leave random_seed out, or ask for temperature 0"
            )
        sampling = self.SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(int(input_value(request, "min_length", 0)), max_tokens) or None,
            temperature=temperature,
            top_k=top_k if top_k > 0 else None,  # None: all tokens
            top_p=top_p if top_p < 1 else None,  # None: all tokens (SamplingParams.top_p, sampling_params.py as above)
            seed=int(seed) if seed is not None and temperature > 0 else None,  # greedy answers need no seed
        )
        stream = bool(input_value(request, "stream", False))
        echo = not bool(input_value(request, "exclude_input_in_output", False))
        return ids, sampling, text, stream, echo

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self.parse(request)
            except Exception as exc:  # a bad request fails alone
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            asyncio.run_coroutine_threadsafe(self.generate(request, sender, *job), self.loop)
        return None

    async def generate(self, request, sender, ids, sampling, prompt, stream, echo):
        sent, finished, steps, counted = "", False, 0, 0
        try:
            outputs = self.llm.generate_async(ids, sampling, streaming=True)
            async for output in outputs:
                steps += 1
                # the client went away: free its batch slot and KV blocks (upstream's cancellation_loop aborts so)
                if steps % CANCEL_CHECK_EVERY == 0 and request.is_cancelled():
                    outputs.abort()
                    self.responses.put((sender, None, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))
                    return
                text, finished = output.outputs[0].text, output.finished
                # CompletionOutput.token_ids: extended by each response (cumulative); .length is its length
                # (tensorrt_llm/executor/result.py, CompletionOutput and _handle_sequence)
                made = output.outputs[0].length
                if stream:
                    delta, sent = stream_delta(text, sent, finished)
                    if delta or finished:
                        reason = output.outputs[0].finish_reason if finished else None
                        self.respond(sender, delta, finished, made - counted, reason)
                        counted = made
                elif finished:
                    self.respond(sender, (prompt + text) if echo else text, True, made, output.outputs[0].finish_reason)
            if not finished:
                raise RuntimeError("the LLM ended the request without a final output")
        except Exception as exc:
            error = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"TensorRT-LLM: {exc}"))
            self.responses.put((sender, error, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))

    def respond(self, sender, text, final, made, finish_reason=None):
        """One response: its text, the tokens it came from (`made`: usage), and on the last one the LLM's
        finish_reason (CompletionOutput.finish_reason: stop, length, ...)."""
        outputs = [
            pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
            pb_utils.Tensor("token_count", np.array([[made]], dtype=np.int32)),
        ]
        if finish_reason:
            outputs.append(pb_utils.Tensor("finish_reason", np.array([[finish_reason.encode()]], dtype=np.object_)))
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.responses.put((sender, pb_utils.InferenceResponse(output_tensors=outputs), flags))

    def send_responses(self):
        """Sending is a blocking round trip to Triton: done here, off the engine's loop (as upstream's _response_loop)."""
        while (item := self.responses.get()) is not None:
            sender, response, flags = item
            try:
                sender.send(response, flags=flags)
            except Exception:  # a client that went away: its sender is closed
                pass

    def finalize(self):
        self.llm.shutdown()
        self.watcher.kill()
        self.responses.put(None)
        self.response_thread.join(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)
