"""The GPU path's first fifteen minutes on one CUDA GPU: `make gpu-smoke`. Prints a table, writes one JSON.

Runs the project's own stage code, without the orchestrator (no Prefect, MLflow or store), on a machine whose image
has CUDA PyTorch, transformers, peft and accelerate; what else it needs is carried as wheels
(infra/gpu/smoke-wheels.txt, `make gpu-smoke-wheels`). cpu-tiny's data and settings with infra/gpu/smoke.yaml's
changes (a Qwen2-shaped base of about 290M parameters, bf16):

0. memory    the CUDA context of a process that does what the Triton stub does around LLM() (torch asks for the
             device's properties and count) and of a worker-like one (context and cuBLAS workspace after a bf16
             GEMM), read through NVML, against what the canary's memory plan reserves for each
             (tasks/serving/memory_plan.py: CUDA_CONTEXT_GIB, RUNTIME_RESERVE_GIB); fails when one exceeds it. Also
             this machine's NVIDIA driver against each pinned image's (infra/images/images.yaml): the images whose
             CUDA needs a newer one (they then need the CUDA forward-compatibility package)
1. base      the tiny-qwen2 base made and pretrained on the GPU (tasks/base_model.py)
2. lora      LlamaFactory LoRA SFT through the train stage's own config and launcher (tasks/train.py): tokens/s,
             peak GPU memory of the trainer process (NVML)
3. qlora     the same with train.quantization_bit=4 (bitsandbytes on CUDA)
4. nodes     the LoRA run as two "nodes" of one process each on this machine, through LlamaFactory's own multi-node
             launch (FORCE_TORCHRUN, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT; llamafactory/launcher.py:61-68,
             117), the same global batch: its loss against the one-process run's
5. evaluate  base and each adapter on the eval split in bf16 on the GPU (tasks/quality/scoring.py): exact match,
             answer loss
6. merge     the LoRA adapter folded in bf16 (tasks/merge.py), |dlogits| against base + adapter
7. quantize  ModelOpt FP8 of the merged model (fake-quantized in torch: it also runs on the CPU where ModelOpt is) (tasks/runners/modelopt_quantize.py: the presets, calibration on the
             train split as the quantize stage encodes it, export, the export check); exact match of the quantized
             model against the merged one: the accuracy drop
8. serve     the Python-backend Triton model (infra/triton/llm, rendered as a canary renders it) driven without
             Triton on the GPU: its answers against evaluate's, tokens/s at batch 1 and batch 32

A step that fails is recorded with its error and the steps that need it are skipped; the exit status is 1 when a
step failed. Without a CUDA GPU it says so and exits 2; `--allow-cpu` runs the same steps with cpu-tiny's
own settings on the CPU (what CI tests: tests/unit/test_gpu_smoke.py).

    python3 benchmarks/gpu_smoke.py [--out gpu_smoke.json] [--work DIR] [--skip STEP ...] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from tasks.platform.config import Profile, load_profile  # noqa: E402

SETTINGS = ROOT / "infra" / "gpu" / "smoke.yaml"
STEPS = ("memory", "base", "lora", "qlora", "nodes", "evaluate", "merge", "quantize", "serve")
NEEDS = {
    "lora": ("base",),
    "qlora": ("base",),
    "nodes": ("base", "lora"),
    "evaluate": ("base", "lora"),
    "merge": ("base", "lora"),
    "quantize": ("merge",),
    "serve": ("merge", "evaluate"),
}
SERVE_TOKENS = 128  # forced answer length of the throughput runs (min_length = max_tokens)
SERVE_BATCH = 32


@dataclass
class Step:
    name: str
    status: str = "skipped"  # ok | failed | skipped
    seconds: float = 0.0
    numbers: dict[str, Any] = field(default_factory=dict)
    note: str = ""


class Smoke:
    """Runs the steps in order; a failed step's dependants are skipped, not attempted. The JSON is rewritten after
    each step, so a run stopped by a time limit still leaves the numbers of the steps it finished."""

    def __init__(
        self,
        skip: set[str],
        env: dict[str, Any],
        out: Path,
        steps: tuple[str, ...] = STEPS,
        needs: dict[str, tuple[str, ...]] = NEEDS,
        label: str = "gpu-smoke",
    ):
        self.steps = {name: Step(name) for name in steps}
        self.skip, self.env, self.out, self.needs, self.label = skip, env, out, needs, label

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(
            json.dumps({"environment": self.env, "steps": [asdict(s) for s in self.steps.values()]}, indent=1)
        )

    def run(self, name: str, work: Callable[[Step], None]) -> None:
        step = self.steps[name]
        if name in self.skip:
            step.note = "--skip"
            return
        missing = [need for need in self.needs.get(name, ()) if self.steps[need].status != "ok"]
        if missing:
            step.note = f"needs {', '.join(missing)}"
            return
        print(f"{self.label}: {name} ...", flush=True)
        started = time.perf_counter()
        try:
            work(step)
        except Exception as exc:
            step.status = "failed"
            step.note = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:300]
            traceback.print_exc()
        else:
            if step.status == "skipped" and not step.note:
                step.status = "ok"
        step.seconds = round(time.perf_counter() - started, 1)
        print(f"{self.label}: {name} {step.status} in {step.seconds} s {step.note}".rstrip(), flush=True)
        self.save()


def smoke_profile(on_gpu: bool, overrides: list[str]) -> Profile:
    settings = yaml.safe_load(SETTINGS.read_text()) if on_gpu else {}
    # the antonyms' one-word answers, scored as the release decides for them (no eval split is read to decide here)
    decided = ["evaluate.metric=exact_match", "evaluate.max_new_tokens=8"]
    return load_profile("cpu-tiny", [*decided, *(f"{k}={json.dumps(v)}" for k, v in settings.items()), *overrides])


def environment(device: str) -> dict[str, Any]:
    import importlib.metadata as metadata

    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for package in ("transformers", "peft", "accelerate", "llamafactory", "bitsandbytes", "nvidia-modelopt"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    if device == "cuda":
        import pynvml

        pynvml.nvmlInit()
        found["driver"] = pynvml.nvmlSystemGetDriverVersion()
        found["gpu"] = torch.cuda.get_device_name(0)
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        found["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        found["kernel_launch_us"] = kernel_launch_us()
    return found


def kernel_launch_us(launches: int = 5000) -> float:
    """Wall time per launch of a tiny kernel, queued back to back: what bounds a small model's step on the GPU
    (a 24-layer decoder step is several hundred launches)."""
    import torch

    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    torch.cuda.synchronize()
    return round((time.perf_counter() - started) / launches * 1e6, 1)


# Processes whose GPU memory the memory step reads (each holds still once it prints "ready"): what the Triton stub
# does with torch around LLM() (BaseLlmArgs.validate_dtype: get_device_properties; validate_gpus_per_node:
# device_count), and a worker's floor: its context and cuBLAS's workspace once a bf16 GEMM ran, the cache emptied.
CONTEXT_PROBES = {
    "stub_context_gib": "import torch; torch.cuda.get_device_properties(0); torch.cuda.device_count()",
    "worker_context_gib": (
        "import torch; a = torch.ones(4096, 4096, device='cuda', dtype=torch.bfloat16); (a @ a).sum().item(); "
        "del a; torch.cuda.synchronize(); torch.cuda.empty_cache()"
    ),
}


def process_gpu_memory(code: str) -> int:
    """Bytes of GPU 0 that a fresh Python process running `code` holds (NVML's per-process count: its context)."""
    import pynvml

    process = subprocess.Popen(
        [sys.executable, "-c", f"{code}; print('ready', flush=True); import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stdin is not None
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the probe exited with {process.wait()} before it was ready: {code}")
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        used = 0
        for _ in range(5):
            time.sleep(0.2)
            running = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            used = max([used, *(p.usedGpuMemory or 0 for p in running if p.pid == process.pid)])
        process.stdin.close()
        return used
    finally:
        process.kill()
        process.wait()


def images_needing_a_newer_driver(driver: str) -> str:
    """The pinned images (infra/images/images.yaml) whose CUDA needs a newer NVIDIA driver than `driver`."""
    images = yaml.safe_load((ROOT / "infra" / "images" / "images.yaml").read_text())

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("."))

    older = [
        f"{name} ({image['driver']})" for name, image in images.items() if version(driver) < version(image["driver"])
    ]
    return ", ".join(older)


class GpuMemoryPeak:
    """Peak GPU memory of a process tree, sampled through NVML (nvidia-ml-py) every 0.2 s: a trainer's whole use,
    its CUDA context included, which torch's own counters in the parent cannot see. `host_peak` is the tree's
    resident memory (psutil), sampled alike; with gpu=False only that is read (a run on the CPU)."""

    def __init__(self, root_pids: list[int], gpu: bool = True):
        self.root_pids, self.gpu, self.peak, self.host_peak = root_pids, gpu, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> GpuMemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _tree(self) -> list:
        import psutil

        processes = []
        for pid in self.root_pids:
            try:
                root = psutil.Process(pid)
                processes += [root, *root.children(recursive=True)]
            except psutil.Error:
                pass
        return processes

    def _sample(self) -> None:
        import psutil

        handle = None
        if self.gpu:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        while not self._stop.wait(0.2):
            processes, resident = self._tree(), 0
            for process in processes:
                try:
                    resident += process.memory_info().rss
                except psutil.Error:
                    pass
            self.host_peak = max(self.host_peak, resident)
            if handle is not None:
                pids = {process.pid for process in processes}
                used = sum(
                    p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid in pids
                )
                self.peak = max(self.peak, used)


class Run:
    """The smoke's state: the profile, where things are written, what earlier steps left."""

    def __init__(self, profile: Profile, work: Path, device: str):
        self.profile, self.work, self.device = profile, work, device
        self.data_dir, self.base_dir, self.merged_dir = work / "data", work / "base", work / "merged"
        self.adapters: dict[str, Path] = {}
        self.merged_answers: list[str] = []

    @property
    def compute(self):
        from tasks.quality.models import Compute

        return Compute(self.device, self.profile.hardware.compute_dtype)

    def eval_split(self):
        from tasks.data.splits import load_split

        return load_split(self.data_dir, "eval")[: self.profile.evaluate.max_samples]

    def memory(self, step: Step) -> None:
        """The CUDA contexts the canary's memory plan reserves for, measured on this GPU."""
        if self.device != "cuda":
            step.note = "needs a CUDA GPU"
            return
        from tasks.serving import memory_plan

        planned = {
            "stub_context_gib": memory_plan.CUDA_CONTEXT_GIB,
            "worker_context_gib": memory_plan.RUNTIME_RESERVE_GIB,
        }
        measured = {name: round(process_gpu_memory(code) / 2**30, 2) for name, code in CONTEXT_PROBES.items()}
        step.numbers = {**measured, **{f"planned_{name}": value for name, value in planned.items()}}
        step.numbers["images_needing_a_newer_driver"] = images_needing_a_newer_driver(self.driver()) or "none"
        over = [f"{name} {measured[name]} > {planned[name]}" for name in planned if measured[name] > planned[name]]
        if over:
            raise RuntimeError(
                f"above the canary memory plan's reserve (tasks/serving/memory_plan.py): {'; '.join(over)}"
            )

    @staticmethod
    def driver() -> str:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())

    def base(self, step: Step) -> None:
        from tasks.base_model import build_tiny_qwen2, corpus
        from tasks.data.records import read_data
        from tasks.data.splits import load_split, write_dataset

        self.data_dir.mkdir(parents=True)
        data = read_data(self.profile.data)
        write_dataset(data, self.data_dir)
        built = build_tiny_qwen2(
            corpus(load_split(self.data_dir, "train")), self.profile.base_model.tiny, self.base_dir, self.device
        )
        step.numbers = {
            "parameters_m": round((built.parameters or 0) / 1e6, 1),
            "vocab": built.vocab_size,
            "pretrain_loss": f"{built.pretrain_loss_first:.2f} -> {built.pretrain_loss_last:.2f}",
            "train_records": len(data.train),
            "eval_records": len(data.eval),
        }

    def train(self, step: Step, quantization_bit: int | None) -> None:
        name = "qlora" if quantization_bit else "lora"
        cfg = self.profile.train.model_copy(update={"quantization_bit": quantization_bit})
        self.launch(step, name, cfg, [{}])
        self.adapters[name] = self.work / name

    def nodes(self, step: Step) -> None:
        """Two launches of one process each, as two nodes would start them; gloo, since NCCL refuses two ranks on
        one GPU. Half the per-device batch: the same global batch as the one-process run."""
        import socket

        train = self.profile.train
        cfg = train.model_copy(
            update={
                "per_device_train_batch_size": max(1, train.per_device_train_batch_size // 2),
                "extra_args": {**train.extra_args, "ddp_backend": "gloo"},
            }
        )
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        # Both on GPU 0: tasks/training/launch.py's LocalNodes gives each node GPUs of its own, which one GPU has not.
        node = {"FORCE_TORCHRUN": "1", "NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1"}
        self.launch(step, "nodes", cfg, [{**node, "NODE_RANK": str(rank), "MASTER_PORT": str(port)} for rank in (0, 1)])
        single = json.loads((self.work / "lora" / "train_results.json").read_text())["train_loss"]
        step.numbers["one_process_loss"] = round(single, 4)

    def launch(self, step: Step, name: str, cfg, node_envs: list[dict[str, str]]) -> None:
        """LlamaFactory through the train stage's config and launcher, one process per entry of `node_envs`
        (environment added to the launcher's base_env); the numbers come from what rank 0 writes."""
        from tasks.train import llamafactory_config
        from tasks.training.launch import base_env, launch_command

        output_dir = self.work / name
        config = llamafactory_config(cfg, self.base_dir, self.data_dir, output_dir, None)
        config_path = self.work / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        processes, logs = [], []
        for rank, extra in enumerate(node_envs):
            log_path = self.work / (f"{name}.log" if rank == 0 else f"{name}-{rank}.log")
            logs.append(log_path)
            with open(log_path, "wb") as log:
                processes.append(
                    subprocess.Popen(
                        launch_command(config_path),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=self.work,
                        env={**base_env(), **extra},
                    )  # fmt: skip
                )
        if self.device == "cuda":
            with GpuMemoryPeak([p.pid for p in processes]) as memory:
                for process in processes:
                    process.wait()
            step.numbers["peak_gpu_memory_gib"] = round(memory.peak / 2**30, 2)
        else:
            for process in processes:
                process.wait()
        for process, log_path in zip(processes, logs, strict=True):
            if process.returncode != 0:
                lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
                raise RuntimeError(f"LlamaFactory exited with {process.returncode}: {(lines or ['?'])[-1][:200]}")
        results = json.loads((output_dir / "train_results.json").read_text())
        step.numbers |= {
            "steps": json.loads((output_dir / "trainer_state.json").read_text())["global_step"],
            "final_loss": round(results["train_loss"], 4),
            "train_runtime_s": round(results["train_runtime"], 1),
            "tokens_per_s": round(results.get("num_input_tokens_seen", 0) / max(results["train_runtime"], 1e-9)),
        }

    def evaluate(self, step: Step) -> None:
        from tasks.quality.metrics import exact_match, mean
        from tasks.quality.models import load_model, load_tokenizer
        from tasks.quality.scoring import answer_losses, generate_answers, references

        conversations, cfg = self.eval_split(), self.profile.evaluate
        tokenizer = load_tokenizer(self.base_dir)
        gold = references(conversations)
        for name, adapter in (("base", None), *self.adapters.items()):
            model = load_model(self.base_dir, adapter, self.compute)
            started = time.perf_counter()
            answers = generate_answers(model, tokenizer, conversations, cfg.answer_tokens)
            seconds = time.perf_counter() - started
            step.numbers[f"{name}_exact_match"] = round(
                mean([exact_match(a, g) for a, g in zip(answers, gold, strict=True)]), 3
            )
            step.numbers[f"{name}_answer_loss"] = round(mean(answer_losses(model, tokenizer, conversations)), 3)
            step.numbers[f"{name}_generate_s"] = round(seconds, 2)
            del model
            self._free()
        step.numbers["samples"] = len(conversations)

    def merge(self, step: Step) -> None:
        from tasks.merge import merge_adapter
        from tasks.quality.metrics import exact_match, mean
        from tasks.quality.models import load_model, load_tokenizer
        from tasks.quality.scoring import generate_answers, references

        probe = self.eval_split()[: self.profile.merge.probe_samples]
        diff = merge_adapter(self.base_dir, self.adapters["lora"], self.merged_dir, probe, self.compute)
        conversations = self.eval_split()
        model = load_model(self.merged_dir, compute=self.compute)
        tokenizer = load_tokenizer(self.merged_dir)
        self.merged_answers = generate_answers(model, tokenizer, conversations, self.profile.evaluate.answer_tokens)
        del model
        self._free()
        step.numbers = {
            "max_abs_dlogits": float(f"{diff:.3g}"),
            "tolerance": self.profile.merge.tolerance,
            "merged_exact_match": round(
                mean([exact_match(a, g) for a, g in zip(self.merged_answers, references(conversations), strict=True)]),
                3,
            ),
        }
        if diff > self.profile.merge.tolerance:
            raise RuntimeError(
                f"merge: max |dlogits| {diff:.3g} exceeds merge.tolerance {self.profile.merge.tolerance}"
            )

    def quantize(self, step: Step) -> None:
        import importlib.util

        import torch

        if importlib.util.find_spec("modelopt") is None:
            step.note = "nvidia-modelopt is not installed"
            return
        if self.device == "cuda" and torch.cuda.get_device_capability(0) < (8, 9):
            step.note = "no FP8 on this GPU (compute capability < 8.9)"
            return
        from transformers import AutoModelForCausalLM

        from tasks.data.splits import load_split
        from tasks.quality.metrics import exact_match, mean
        from tasks.quality.models import load_tokenizer
        from tasks.quality.scoring import generate_answers, references
        from tasks.quantize import calibration_ids
        from tasks.runners.modelopt_quantize import check_export, export_checkpoint, quantize_model

        cfg = self.profile.quantize.modelopt
        tokenizer = load_tokenizer(self.merged_dir)
        calibration = calibration_ids(
            tokenizer, load_split(self.data_dir, "train")[: cfg.calib_size], cfg.calib_max_seq_length
        )
        dtype = getattr(torch, self.profile.hardware.compute_dtype)
        model = AutoModelForCausalLM.from_pretrained(self.merged_dir, dtype=dtype).to(self.device).eval()
        started = time.perf_counter()
        quantize_model(model, calibration, "fp8", kv_cache_fp8=False, awq_block_size=cfg.awq_block_size)
        step.numbers["calibrate_s"] = round(time.perf_counter() - started, 1)
        conversations = self.eval_split()
        answers = generate_answers(model, tokenizer, conversations, self.profile.evaluate.answer_tokens)
        merged = mean([exact_match(a, g) for a, g in zip(self.merged_answers, references(conversations), strict=True)])
        quantized = mean([exact_match(a, g) for a, g in zip(answers, references(conversations), strict=True)])
        out_dir = self.work / "fp8"
        export_checkpoint(model, out_dir)
        quantization = check_export(out_dir, "fp8", False)
        step.numbers |= {
            "quant_algo": quantization["quant_algo"],
            "exact_match": round(quantized, 3),
            "accuracy_drop": round(merged - quantized, 3),
            "max_accuracy_drop": self.profile.quantize.max_accuracy_drop,
            "same_answers": round(mean([float(a == b) for a, b in zip(answers, self.merged_answers, strict=True)]), 3),
            "checkpoint_mib": round(sum(p.stat().st_size for p in out_dir.glob("*.safetensors")) / 2**20, 1),
            "merged_mib": round(sum(p.stat().st_size for p in self.merged_dir.glob("*.safetensors")) / 2**20, 1),
        }
        del model
        self._free()

    def serve(self, step: Step) -> None:
        from tasks.serving.model_config import serving_model
        from tasks.serving.repository import FIELDS, stage_model_files

        # The model's files and the parameters its rendering sets, without the config.pbtxt: rendering it needs
        # protobuf and tritonclient's ModelConfig, which the GPU image of the smoke does not carry.
        template, values = serving_model(self.profile, self.merged_dir, "0" * 64)
        folder = self.work / "repository" / "smoke-v1"
        stage_model_files(template, folder)
        parameters = {key: str(value) for key, value in values.items() if key not in FIELDS}
        served = load_python_backend_model(folder, parameters)
        conversations = self.eval_split()
        prompts = [c[-2]["content"] for c in conversations]
        history = [c[:-2] for c in conversations]
        answers = served.answer(prompts, history, max_tokens=self.profile.evaluate.answer_tokens)
        same = [a.strip() == b for a, b in zip(answers, self.merged_answers, strict=True)]
        step.numbers["answers_equal_evaluate"] = f"{sum(same)}/{len(same)}"
        for batch in (1, SERVE_BATCH):
            served.answer(prompts[:batch], history[:batch], max_tokens=8)  # warm-up of this batch shape
            started = time.perf_counter()
            served.answer(prompts[:batch], history[:batch], max_tokens=SERVE_TOKENS, min_length=SERVE_TOKENS)
            seconds = time.perf_counter() - started
            step.numbers[f"tokens_per_s_batch_{batch}"] = round(batch * SERVE_TOKENS / seconds)
        step.numbers["dtype"] = values.get("dtype")
        served.finalize()
        # Greedy answers of a batch padded otherwise can part at a near-tie in bf16; in fp32 they must not.
        if sum(same) < (len(same) if values.get("dtype") == "float32" else 0.9 * len(same)):
            raise RuntimeError(
                f"served answers differ from evaluate's on {len(same) - sum(same)} of {len(same)} prompts"
            )

    def _free(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()


class ServedModel:
    """A rendered Python-backend model.py run as Triton's stub runs it (initialize, execute with a batch of
    requests, responses through each request's sender), with `triton_python_backend_utils` stood in for."""

    def __init__(self, module: types.ModuleType, folder: Path, parameters: dict[str, str]):
        config = {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}
        self.model = module.TritonPythonModel()
        self.model.initialize(
            {"model_config": json.dumps(config), "model_repository": str(folder), "model_version": "1"}
        )

    def answer(self, prompts: list[str], histories: list[list], max_tokens: int, min_length: int = 0) -> list[str]:
        import numpy as np

        requests = []
        for prompt, history in zip(prompts, histories, strict=True):
            inputs = {
                "text_input": np.array([[prompt.encode()]], dtype=np.object_),
                "chat_history": np.array([[json.dumps(history).encode()]], dtype=np.object_),
                "max_tokens": np.array([[max_tokens]], dtype=np.int32),
                "min_length": np.array([[min_length]], dtype=np.int32),
                "exclude_input_in_output": np.array([[True]]),
            }
            requests.append(StubRequest(inputs))
        self.model.execute(requests)
        answers = []
        for request in requests:
            (response, flags), *_ = request.sender.sent
            if response.error is not None:
                raise RuntimeError(f"served model: {response.error}")
            answers.append(response.output_tensors[0].as_numpy().reshape(-1)[0].decode())
        return answers

    def finalize(self) -> None:
        getattr(self.model, "finalize", lambda: None)()


class StubTensor:
    def __init__(self, name: str, array):
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self):
        return self._array


class StubSender:
    def __init__(self):
        self.sent: list = []

    def send(self, response, flags=0) -> None:
        self.sent.append((response, flags))


class StubRequest:
    def __init__(self, inputs: dict):
        self._inputs = [StubTensor(name, array) for name, array in inputs.items()]
        self.sender = StubSender()

    def inputs(self):
        return self._inputs

    def get_response_sender(self) -> StubSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return False


def load_python_backend_model(folder: Path, parameters: dict[str, str]) -> ServedModel:
    """Import a rendered model's 1/model.py as the stub does: its version folder on sys.path (model_text.py)."""
    import importlib.util

    pb_utils = types.SimpleNamespace(
        Tensor=StubTensor,
        InferenceResponse=lambda output_tensors=(), error=None: types.SimpleNamespace(
            output_tensors=list(output_tensors), error=error
        ),
        TritonError=str,
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
    )
    sys.modules["triton_python_backend_utils"] = pb_utils  # type: ignore[assignment]
    sys.path.insert(0, str(folder / "1"))
    sys.modules.pop("model_text", None)
    spec = importlib.util.spec_from_file_location("served_model", folder / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return ServedModel(module, folder, parameters)


def table(env: dict[str, Any], steps: list[Step], label: str = "gpu-smoke") -> str:
    lines = ["", f"{label}: " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None), ""]
    lines.append(f"{'step':<9} {'status':<8} {'s':>7}  numbers")
    for step in steps:
        numbers = ", ".join(f"{k} {v}" for k, v in step.numbers.items())
        detail = "; ".join(filter(None, [numbers, step.note]))
        lines.append(f"{step.name:<9} {step.status:<8} {step.seconds:>7.1f}  {detail}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_smoke.json"), help="the JSON of numbers")
    parser.add_argument("--work", type=Path, help="where models and logs go (default: a temporary folder)")
    parser.add_argument("--skip", action="append", default=[], choices=STEPS, help="a step not to run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="a profile override k=v")
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU, run cpu-tiny's settings on the CPU")
    return parser.parse_args(argv)


def visible_gpu(label: str, allow_cpu: bool, on_cpu: str) -> bool | None:
    """Whether torch sees a CUDA GPU; None, after saying so, where it sees none and the CPU was not allowed."""
    import torch

    if torch.cuda.is_available():
        return True
    if allow_cpu:
        return False
    print(
        f"{label}: no CUDA GPU visible to torch {torch.__version__} (CUDA {torch.version.cuda}): nothing measured. "
        f"Run it on a GPU machine; --allow-cpu {on_cpu}.",
        file=sys.stderr,
    )
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = visible_gpu("gpu-smoke", args.allow_cpu, "runs the same steps on the CPU with cpu-tiny's settings")
    if on_gpu is None:
        return 2
    device = "cuda" if on_gpu else "cpu"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    profile = smoke_profile(on_gpu, args.overrides)
    env = environment(device)
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        run, smoke = Run(profile, work, device), Smoke(set(args.skip), env, args.out)
        smoke.run("memory", run.memory)
        smoke.run("base", run.base)
        smoke.run("lora", lambda step: run.train(step, None))
        smoke.run("qlora", lambda step: run.train(step, 4))
        smoke.run("nodes", run.nodes)
        smoke.run("evaluate", run.evaluate)
        smoke.run("merge", run.merge)
        smoke.run("quantize", run.quantize)
        smoke.run("serve", run.serve)
    steps = list(smoke.steps.values())
    smoke.save()
    print(table(env, steps))
    print(f"\ngpu-smoke: numbers in {args.out}")
    return 1 if any(s.status == "failed" for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
