# quantize (ModelOpt), the engine check and serving: NGC's Triton + TensorRT-LLM image as it ships
# (TensorRT-LLM 1.2.1 with its ModelOpt, transformers and torch; Python 3.12.3 in /opt/venv-tritonserver,
# first on PATH); this project and the orchestrator's light packages go on top without replacing any of
# the image's packages.
#   docker build -f infra/images/trtllm.Dockerfile -t ghcr.io/example/llmops-trtllm:26.07 .
FROM nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3

# The TensorRT-LLM this image ships (server docs/introduction/compatibility.md at r26.07, the trtllm table):
# the `gpu` extra pins the same release, and the build fails when the image holds another.
ARG TENSORRT_LLM_VERSION=1.2.1

WORKDIR /opt/llmops
COPY . /opt/llmops
# Everything the image has is pinned to what it has: pip can add packages, never swap one. The pins are
# name==version (`pip list --format=freeze`): `pip freeze` writes `name @ file://...` for wheels installed
# from files (TensorRT's, here) and `-e` lines, which a constraints file refuses.
# The build then proves what a job will run: the image's TensorRT-LLM and ModelOpt import, and Prefect's
# `flow-run execute` (every stage job's command) starts under the image's fastapi and starlette.
RUN python3 -m pip list --format=freeze > /tmp/image-constraints.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-constraints.txt '.[gpu]' \
 && python3 -c "import tensorrt_llm, modelopt, transformers; print('tensorrt_llm', tensorrt_llm.__version__, 'modelopt', modelopt.__version__, 'transformers', transformers.__version__); assert tensorrt_llm.__version__ == '${TENSORRT_LLM_VERSION}', 'not TensorRT-LLM ${TENSORRT_LLM_VERSION}'" \
 && prefect flow-run execute --help > /dev/null
ENV LLMOPS_HOME=/var/lib/llmops \
    LLMOPS_TRITONSERVER=/opt/tritonserver/bin/tritonserver
# Kubernetes starts ENTRYPOINT + the job's args (Prefect's `prefect flow-run execute`, infra/work-pools/
# kubernetes-gpu.json): the entrypoint must run its arguments. NGC's own does (its /opt/nvidia/entrypoint.d
# checks, then `exec "$@"`); it is restated here so that the image says so.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"]
