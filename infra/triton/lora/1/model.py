"""Triton Python-backend model of one served version under serve.lora adapter: registers the version's adapter with
the base engine's adapter map when Triton loads it and retires it when Triton unloads it (adapter_registry.py). It
forwards nothing and answers nothing: requests for the version go to the base engine with `lora_name` (the gateway
of `llmops serve` adds it), so no model in Triton calls another.
"""

import json

import triton_python_backend_utils as pb_utils
from adapter_registry import RegistryError, register, registry_root, retire

# adapter_registry.py is tasks/serving/adapter_registry.py, copied next to this file when the model is rendered
from model_roots import served_folder


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.name, self.base_model = args["model_name"], params["base_model"]
        adapter_dir = served_folder(
            args, params["adapter_dir"], "adapter_dir"
        )  # its folder or the store's (model_roots.py)
        try:
            self.root = registry_root()
            register(self.root, self.base_model, self.name, adapter_dir)
        except (RegistryError, OSError) as exc:
            raise pb_utils.TritonModelException(f"lora: {exc}") from exc

    def execute(self, requests):
        refusal = pb_utils.TritonError(
            f"{self.name} is an adapter of {self.base_model}: ask {self.base_model} with lora_name {self.name}"
        )
        return [pb_utils.InferenceResponse(error=refusal) for _ in requests]

    def finalize(self):
        retire(self.root, self.base_model, self.name)
