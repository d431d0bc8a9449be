# The two commands of the README, plus the benchmark. Each sets up .venv first (idempotent).
# Python keeps each module it compiles (__pycache__), as it does by default: the setup installs without byte-compiling
# (infra/local/setup.sh) on that promise. A machine that sets PYTHONDONTWRITEBYTECODE=1 (these do) makes every process
# compile every module it imports from source again, and the tests start hundreds (benchmarks/bytecode_cache.py: a
# Prefect server's imports 11.4 CPU-s from source, 5.3 with bytecode kept; a Triton Python model's 14.0 against 6.6).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup setup-vllm setup-compat setup-aiperf setup-lmeval environments test-tools run test test-unit lint format benchmark docs gpu-smoke gpu-bench gpu-check gpu-smoke-wheels

setup:
	bash infra/local/setup.sh

# The vLLM serving environment (.venv-vllm) for serve.backend=vllm; CPU build, about 2.5 GB
setup-vllm:
	bash infra/local/setup-vllm.sh

# NVIDIA AIPerf (.venv-aiperf) for bench.tool=aiperf: its pins collide with .venv's; about 1.2 GB, no torch
setup-aiperf:
	bash infra/local/setup-aiperf.sh

# lm-evaluation-harness (.venv-lmeval): scores a served model through its OpenAI API; about 690 MB, no torch
setup-lmeval:
	bash infra/local/setup-lmeval.sh

# The serving images' transformers 4.x without torch (.venv-compat), for tests/unit/test_serving_compat.py; about 260 MB
setup-compat:
	bash infra/local/setup-compat.sh

# Debian's chromium, postgresql and prometheus, which the integration tests start (installed when missing)
test-tools:
	bash infra/local/test-tools.sh

run: setup
	.venv/bin/llmops run

# The five environments side by side: they share nothing, and built one after another they leave a core idle
# (from a fresh clone on 2 cores: 95 s instead of 129 s for the first three). Each target's output stays together
# (--output-sync).
environments:
	$(MAKE) --no-print-directory -j5 --output-sync=target setup setup-vllm setup-compat setup-aiperf setup-lmeval

# Two worker processes, one test module at a time each (a module's servers and releases stay in one process), the
# slowest modules first (tests/conftest.py): the integration tests wait on servers and releases about half of the
# time, so on 2 cores two modules at once fill what one leaves idle. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: environments test-tools
	.venv/bin/python -m pytest --numprocesses=$(TEST_WORKERS) --dist=loadfile --no-loadscope-reorder tests

# ruff (lint and format check) and mypy, as configured in pyproject.toml; CI runs it before the tests.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

format: setup
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

test-unit: setup setup-compat
	.venv/bin/python -m pytest tests/unit

benchmark: setup setup-vllm setup-aiperf
	.venv/bin/python benchmarks/pipeline_overhead.py
	.venv/bin/python benchmarks/serving_batching.py
	.venv/bin/python benchmarks/service_latency.py
	.venv/bin/python benchmarks/shadow_overhead.py
	.venv/bin/python benchmarks/gateway_overhead.py
	.venv/bin/python benchmarks/python_instances.py
	.venv/bin/python benchmarks/bench_tools.py
	.venv/bin/python benchmarks/adapter_canary.py
	.venv/bin/python benchmarks/stack_idle.py
	.venv/bin/python benchmarks/bytecode_cache.py
	.venv/bin/python benchmarks/unused_imports.py
	.venv/bin/python benchmarks/vllm_engine_idle.py
	.venv/bin/python benchmarks/load_stall.py
	.venv/bin/python benchmarks/predict.py
	.venv/bin/python benchmarks/report_cost.py

# The documentation site (mkdocs.yml, docs/): strict, so a page missing from the nav or a broken link fails.
# NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, printed on every build
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d build/site

# The GPU path's first fifteen minutes (docs/gpu.md#the-gpu-smoke), on a machine with a CUDA GPU and an image that has
# CUDA PyTorch, transformers, peft and accelerate; no .venv is used. Run `make gpu-smoke-wheels` where pip reaches PyPI
# and bring .whl/ along (LlamaFactory, bitsandbytes, ModelOpt and what they need beyond the image: about 24 MB).
gpu-smoke:
	bash infra/gpu/smoke.sh $(GPU_SMOKE_ARGS)

# What the GPU profiles' 7B/8B fine-tune costs on that GPU, after the smoke (docs/gpu.md#the-gpu-bench), with the same
# wheels; GPU_BENCH_ARGS=--allow-cpu runs one layer of the shapes where no GPU is.
gpu-bench:
	GPU_SCRIPT=gpu_bench bash infra/gpu/smoke.sh $(GPU_BENCH_ARGS)

# What a lent GPU runs first (docs/gpu.md#make-gpu-check): the smoke, then the 7B/8B bench with what is left of one
# command's 540 s, each step's numbers kept as it finishes; GPU_CHECK_ARGS=--allow-cpu runs both CPU forms.
gpu-check:
	GPU_SCRIPT=gpu_check bash infra/gpu/smoke.sh $(GPU_CHECK_ARGS)

gpu-smoke-wheels:
	bash infra/gpu/smoke-wheels.sh
