# train, evaluate and merge: LlamaFactory's environment on NVIDIA's PyTorch image (CUDA torch, Python 3.12).
#   docker build -f infra/images/train.Dockerfile -t ghcr.io/example/llmops-train:25.06 .
FROM nvcr.io/nvidia/pytorch:25.06-py3

WORKDIR /opt/llmops
COPY . /opt/llmops
# The image's torch (a CUDA build) stays: pip may not replace it with a PyPI wheel.
RUN python -m pip freeze | grep -E '^(torch|torchvision|torchaudio)==' > /tmp/keep-torch.txt \
 && python -m pip install --no-cache-dir -c /tmp/keep-torch.txt '.[gpu-train]'
ENV LLMOPS_HOME=/var/lib/llmops
ENTRYPOINT ["llmops"]
