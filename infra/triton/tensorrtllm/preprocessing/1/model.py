"""Preprocessing of a tensorrtllm candidate: the chat template and the tokenizer, in front of the engine."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

# model_text.py is tasks/serving/model_text.py, copied next to this file when the model is rendered
from model_text import chat_history, encode_prompt, input_value


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer_dir"])
        self.chat = params.get("apply_chat_template", "true") == "true"
        self.default_max_tokens = int(params.get("default_max_tokens", "128"))
        self.end_id = self.tokenizer.eos_token_id
        if self.end_id is None:  # end_id would be np.array([[None]]): no answer could ever stop
            raise ValueError(
                f"tokenizer {params['tokenizer_dir']}: no EOS token; set eos_token in its tokenizer_config.json"
            )
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.end_id

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                text = input_value(request, "text_input", None)
                if text is None:
                    raise ValueError("text_input is required")
                max_tokens = int(input_value(request, "max_tokens", self.default_max_tokens))
                if max_tokens < 1:
                    raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
                ids = encode_prompt(
                    self.tokenizer, text, chat_history(input_value(request, "chat_history", "")), self.chat
                )
                outputs = [
                    pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32)),
                    pb_utils.Tensor("input_lengths", np.array([[len(ids)]], dtype=np.int32)),
                    pb_utils.Tensor("request_output_len", np.array([[max_tokens]], dtype=np.int32)),
                    pb_utils.Tensor("end_id", np.array([[self.end_id]], dtype=np.int32)),
                    pb_utils.Tensor("pad_id", np.array([[self.pad_id]], dtype=np.int32)),
                ]
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
            except Exception as exc:  # a bad request fails alone, with its reason
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses
