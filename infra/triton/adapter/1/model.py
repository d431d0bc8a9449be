"""Triton Python-backend model of one served version under serve.lora adapter: forwards each request (BLS,
streaming) to the service's base engine with this version's adapter named, so the base model answers as base +
adapter. The weights stay in the base engine (infra/triton/vllm with enable_lora); this model holds none.

As the router does, `execute` hands each request to a worker thread and returns at once, so concurrent requests
reach the engine together and it batches them (vLLM batches requests of different adapters too).
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

# model_text.py is tasks/serving/model_text.py, copied next to this file when the model is rendered
from model_text import Forwarder

ADAPTER_INPUTS = ("lora_name", "lora_path", "lora_release")  # set here only, never taken from a client


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.base_model = params["base_model"]
        adapter_dir = os.path.join(args["model_repository"], args["model_version"], params["adapter_dir"])
        if not os.path.isfile(os.path.join(adapter_dir, "adapter_config.json")):
            raise pb_utils.TritonModelException(f"adapter: no adapter_config.json in {adapter_dir}")
        self.adapter = [
            pb_utils.Tensor("lora_name", np.array([[args["model_name"].encode()]], dtype=np.object_)),
            pb_utils.Tensor("lora_path", np.array([[os.path.abspath(adapter_dir).encode()]], dtype=np.object_)),
        ]
        self.forwarder = Forwarder(pb_utils, int(params["max_in_flight"]), "adapter")

    def route(self, request):
        inputs = [tensor for tensor in request.inputs() if tensor.name() not in ADAPTER_INPUTS]
        return self.base_model, inputs + self.adapter

    def execute(self, requests):
        self.forwarder.execute(requests, self.route)
        return None

    def finalize(self):
        self.forwarder.shutdown()
