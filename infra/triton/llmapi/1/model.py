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
parameter), the engine on an asyncio loop of its own with responses sent from another thread, and
CUDA_VISIBLE_DEVICES set from `gpu_device_ids` before tensorrt_llm is imported (upstream's `initialize`).

Tensor parallelism: tritonserver runs as one plain process; an LLM with tensor_parallel_size > 1 spawns its own
MPI workers (tensorrt_llm/llmapi/llm.py BaseLLM.__init__: MpiPoolSession(n_workers=world_size) when no MPI world
was started for it), so candidates load and unload one by one without `mpirun` or the C++ backend's orchestrator
flags.

TensorRT-LLM API used (v1.2.1, as upstream's model.py uses it): LLM(model, **kwargs); llm.generate_async(inputs,
sampling_params, streaming=True) -> RequestOutput, async-iterable, with .outputs[0].text (cumulative), .finished,
.abort(); llm.shutdown(); SamplingParams(max_tokens, min_tokens, temperature, top_k, seed) (sampling_params.py).
"""

import asyncio
import json
import os
import queue
import re
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

# model_text.py is tasks/text/model_text.py, copied next to this file when the model is rendered
from model_text import chat_history, encode_prompt, input_value, stream_delta

CANCEL_CHECK_EVERY = 16  # decoding steps between two checks that the client still waits


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
        llm_args = json.loads(params["llm_args"])
        # before tensorrt_llm (torch) opens the CUDA devices: the MPI workers the LLM spawns inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = instance_gpus(params["gpu_device_ids"], args.get("model_instance_name"))
        try:
            from tensorrt_llm import LLM, SamplingParams
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise pb_utils.TritonModelException(
                f"serve.backend llmapi: tensorrt_llm is not importable by this Triton's Python ({exc}); serve from "
                "NGC tritonserver:26.07-trtllm-python-py3"
            ) from exc
        self.SamplingParams = SamplingParams
        # A relative model_dir is inside this model's version folder: the checkpoint came with the load request.
        model_dir = os.path.join(args["model_repository"], args["model_version"], params["model_dir"])
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

    def parse(self, request):
        text = input_value(request, "text_input", None)
        if text is None:
            raise ValueError("text_input is required")
        history = chat_history(input_value(request, "chat_history", ""))
        max_tokens = int(input_value(request, "max_tokens", self.default_max_tokens))
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids = encode_prompt(self.tokenizer, text, history, self.chat)
        if len(ids) + max_tokens > self.context_tokens:
            raise ValueError(
                f"max_tokens {max_tokens} + {len(ids)} prompt tokens exceed the model's context of "
                f"{self.context_tokens} tokens; ask for at most {max(self.context_tokens - len(ids), 0)}"
            )
        seed = input_value(request, "random_seed", None)
        top_k = int(input_value(request, "top_k", 0))
        sampling = self.SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(int(input_value(request, "min_length", 0)), max_tokens) or None,
            temperature=max(float(input_value(request, "temperature", 0.0)), 0.0),  # 0: greedy
            top_k=top_k if top_k > 0 else None,  # None: all tokens
            seed=int(seed) if seed is not None else None,
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
        sent, finished, steps = "", False, 0
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
                if stream:
                    delta, sent = stream_delta(text, sent, finished)
                    if delta or finished:
                        self.respond(sender, delta, finished)
                elif finished:
                    self.respond(sender, (prompt + text) if echo else text, True)
            if not finished:
                raise RuntimeError("the LLM ended the request without a final output")
        except Exception as exc:
            error = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"TensorRT-LLM: {exc}"))
            self.responses.put((sender, error, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))

    def respond(self, sender, text, final):
        output = pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.responses.put((sender, pb_utils.InferenceResponse(output_tensors=[output]), flags))

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
        self.responses.put(None)
        self.response_thread.join(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)
