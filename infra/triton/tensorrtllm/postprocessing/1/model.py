"""Postprocessing of a tensorrtllm candidate: new token ids (exclude_input_in_output) -> text."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        self.tokenizer = AutoTokenizer.from_pretrained(params["tokenizer_dir"])

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()  # [batch, beam, tokens]
            lengths = pb_utils.get_input_tensor_by_name(request, "sequence_length").as_numpy()  # [batch, beam]
            texts = [
                self.tokenizer.decode(ids[i, 0, : lengths[i, 0]], skip_special_tokens=True).encode()
                for i in range(ids.shape[0])
            ]
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("text_output", np.array(texts, dtype=object).reshape(-1, 1))]
                )
            )
        return responses
