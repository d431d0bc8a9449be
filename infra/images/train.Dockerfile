# train, evaluate and merge: LlamaFactory's environment on NVIDIA's PyTorch image (CUDA torch, Python 3.12). 25.12 is
# the release TensorRT-LLM 1.2.1's Triton image takes its torch from (torch 2.10.0a0+b4e4ee81d3.nv25.12, CUDA 13.1:
# infra/images/images.yaml): one driver for every stage, and the merged model written and read by one torch.
#   docker build -f infra/images/train.Dockerfile -t ghcr.io/example/llmops-train:25.12 .
FROM nvcr.io/nvidia/pytorch:25.12-py3

WORKDIR /opt/llmops
COPY . /opt/llmops
# The image's torch family (CUDA builds) stays: pinned by name==version (`pip list --format=freeze`; `pip
# freeze` writes `name @ file://...` for wheels installed from files, which a constraints file refuses).
# LlamaFactory requires torchaudio, which this image may not have and PyPI's would drag in a PyPI torch:
# LlamaFactory goes in without dependencies, then its other requirements and the project's
# (requirements_without.py), then the project itself. The torch family must come out unchanged.
RUN python -m pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio)==' > /tmp/keep-torch.txt \
 && python -m pip install --no-cache-dir --no-deps -c /tmp/keep-torch.txt \
      "$(python infra/images/requirements_without.py --extra gpu-train --pin llamafactory)" \
 && python infra/images/requirements_without.py --extra gpu-train --without torchaudio > /tmp/requirements.txt \
 && python -m pip install --no-cache-dir -c /tmp/keep-torch.txt -r /tmp/requirements.txt \
 && python -m pip install --no-cache-dir --no-deps . \
 && python -m pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio)==' | diff /tmp/keep-torch.txt - \
 && { python -c 'import torchaudio' 2>/dev/null \
      || cp -r infra/images/torchaudio-placeholder/torchaudio "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"; } \
 && python -m tasks.runners.llamafactory_launch version
ENV LLMOPS_HOME=/var/lib/llmops
# Kubernetes starts ENTRYPOINT + the job's args (Prefect's `prefect flow-run execute`, infra/work-pools/
# kubernetes-gpu.json): the entrypoint must run its arguments. NGC's own does (its /opt/nvidia/entrypoint.d
# checks, then `exec "$@"`); it is restated here so that the image says so.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"]
