# quantize, build_engine, engine evaluation, and serving: NGC's Triton + TensorRT-LLM image as it ships
# (TensorRT-LLM 0.20.0, ModelOpt, transformers, torch, Python 3.12.3); this project and the orchestrator's
# light packages go on top without replacing any of the image's packages.
#   docker build -f infra/images/trtllm.Dockerfile -t ghcr.io/example/llmops-trtllm:25.06 .
FROM nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3

WORKDIR /opt/llmops
COPY . /opt/llmops
# Everything the image has is pinned to what it has: pip can add packages, never swap one.
RUN python3 -m pip freeze > /tmp/image-constraints.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-constraints.txt '.[gpu]' \
 && python3 -c "import tensorrt_llm, transformers; print('tensorrt_llm', tensorrt_llm.__version__, 'transformers', transformers.__version__)"
ENV LLMOPS_HOME=/var/lib/llmops \
    LLMOPS_TRITONSERVER=/opt/tritonserver/bin/tritonserver \
    TRTLLM_EXAMPLES_DIR=/app/tensorrt_llm/examples
ENTRYPOINT ["llmops"]
