"""Entry model of a tensorrtllm candidate (BLS): <name>-pre, then <name>-trtllm, then detokenization of
the whole answer so far at each streamed step (see config.pbtxt). Like the router, `execute` hands each
request to a worker thread: the model is decoupled, and the engine batches the requests in flight.

Upstream references (tensorrtllm_backend v0.19/v0.20, all_models/inflight_batcher_llm):
- tensorrt_llm/config.pbtxt: inputs input_ids, input_lengths, request_output_len, end_id, pad_id, streaming,
  min_length, temperature, runtime_top_k, random_seed; outputs output_ids [beam, tokens], sequence_length;
- tensorrt_llm_bls/1/lib/decode.py: with streaming, each response carries the new tokens only, which the
  BLS accumulates (`accumulate_tokens`) and post-processes as a whole.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

# model_text.py is tasks/serving/model_text.py, copied next to this file when the model is rendered
from model_text import stream_delta

PRE_INPUTS = ("text_input", "chat_history", "max_tokens", "exclude_input_in_output")
PRE_OUTPUTS = ("input_ids", "input_lengths", "request_output_len", "end_id", "pad_id")
# request input -> tensorrt_llm input
PASSED_TO_ENGINE = {
    "stream": "streaming",
    "min_length": "min_length",
    "temperature": "temperature",
    "top_k": "runtime_top_k",
    "random_seed": "random_seed",
}


def text_tensor(text):
    return pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        self.pre, self.engine = params["preprocessing_model"], params["tensorrt_llm_model"]
        self.engine_decoupled = params.get("engine_decoupled", "true") == "true"
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer_dir"])
        self.workers = ThreadPoolExecutor(max_workers=64, thread_name_prefix="generate")

    def execute(self, requests):
        for request in requests:
            self.workers.submit(self.generate, request)
        return None

    def generate(self, request):
        sender = request.get_response_sender()
        try:
            given = {tensor.name(): tensor for tensor in request.inputs()}
            pre = pb_utils.InferenceRequest(
                model_name=self.pre,
                inputs=[given[name] for name in PRE_INPUTS if name in given],
                requested_output_names=list(PRE_OUTPUTS),
            ).exec()
            if pre.has_error():
                raise ValueError(pre.error().message())
            inputs = [pb_utils.get_output_tensor_by_name(pre, name) for name in PRE_OUTPUTS]
            inputs += [
                pb_utils.Tensor(to, given[name].as_numpy()) for name, to in PASSED_TO_ENGINE.items() if name in given
            ]
            stream = "stream" in given and bool(given["stream"].as_numpy().reshape(-1)[0])
            call = pb_utils.InferenceRequest(
                model_name=self.engine, inputs=inputs, requested_output_names=["output_ids", "sequence_length"]
            )
            tokens, sent = [], ""
            # a decoupled engine streams responses; a non-decoupled one answers once
            for response in call.exec(decoupled=True) if self.engine_decoupled else [call.exec()]:
                if response.has_error():
                    raise RuntimeError(response.error().message())
                ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
                if ids is None:  # the final flag alone
                    continue
                length = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
                tokens += ids.as_numpy().reshape(-1)[:length].tolist()  # beam 0: new tokens (streaming) or all
                if stream:
                    delta, sent = stream_delta(self.tokenizer.decode(tokens, skip_special_tokens=True), sent, False)
                    if delta:
                        sender.send(pb_utils.InferenceResponse(output_tensors=[text_tensor(delta)]))
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if stream:
                delta, sent = stream_delta(text, sent, True)
                if delta:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[text_tensor(delta)]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(
                    pb_utils.InferenceResponse(output_tensors=[text_tensor(text)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
        except Exception as exc:  # a bad request fails alone, with its reason
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    def finalize(self):
        self.workers.shutdown(wait=True)
