"""The client-facing endpoint of `llmops serve`: an OpenAI-compatible API and Triton's generate API for
the service's stable name, in front of the Triton the service runs.

It adds what Triton 2.51's HTTP server lacks (tritonserver --help; measured here):
- API keys per client (`Authorization: Bearer KEY`): Triton's `--http-restricted-api` takes one key per
  API group, so clients could not have keys of their own nor lose them one at a time;
- TLS where certificate paths are configured: Triton has TLS for gRPC only;
- a cap on the request size, and JSON only: Triton has no size option, and a form-encoded body of about
  4 MiB crashes it with SIGSEGV on any path, before any key check (triton-inference-server#5840);
- `max_tokens` bounded by the model's context, and errors in each API's own shape: OpenAI's
  `{"error": {"message", "type", "param", "code"}}` on /v1, Triton's `{"error": "..."}` on /v2.

Why our own small gateway (Starlette + httpx + uvicorn, all already in the environment) rather than
Triton's OpenAI-compatible frontend: that frontend runs Triton in-process through the `tritonserver`
Python bindings, which the nvidia-pytriton binary this project serves with does not ship; nginx would
give TLS and a size cap but neither the OpenAI translation nor per-client keys.

Requests go to the router model (the service name), so the canary's weights apply to every client.

The package follows vLLM's entrypoints/openai: protocol (the wire formats, pydantic), auth (API keys),
upstream (Triton's generate API over httpx), stops and serving (the OpenAI translation and its events),
app (the routes and the Gateway that `flows/serve.py` runs under uvicorn).
"""

from tasks.runtime.gateway.app import Gateway, GatewayConfig
from tasks.runtime.gateway.auth import API_KEYS_ENV, API_KEYS_FILE_ENV, KeyRing, read_api_keys

__all__ = ["API_KEYS_ENV", "API_KEYS_FILE_ENV", "Gateway", "GatewayConfig", "KeyRing", "read_api_keys"]
