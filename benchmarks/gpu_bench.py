"""What a GPU profile's 7B/8B fine-tune costs on the lent GPU: `make gpu-bench`, after `make gpu-smoke`.

The smoke proves numerics on a 290M model that cannot load a GPU; this measures the shape users fine-tune. The base
has the architecture a GPU profile names (base_model.architecture: Qwen2.5-7B's by default, `--profile
llama3-8b-h100-fp8` for Llama-3-8B's), its weights initialised randomly on the device: a step's cost does not depend
on the values. The tokenizer is a byte-level BPE trained on the synthetic records (the vocabulary of the model is the
architecture's; token ids beyond the tokenizer's are simply never fed). Every record is longer than the cutoff, so
each sample is exactly `--cutoff` tokens and a step is `--batch` x `--cutoff` tokens.

1. base      the random base written as the train stage would read it (bf16 safetensors on the GPU)
2. lora      LoRA in bf16 through the train stage's own config and launcher (tasks/train.py llamafactory_config,
             tasks/training/launch.py): tokens/s per GPU over `--steps` optimizer steps, peak GPU memory (NVML)
3. bare      the same model, data, cutoff, batch, rank and steps through bare `llamafactory-cli train` with the
             keys of LlamaFactory's own example (examples/train_lora/llama3_lora_sft.yaml): what users run today;
             the pipeline's overhead is lora's time over this one's
4. qlora     lora with train.quantization_bit=4 (bitsandbytes NF4; CUDA only)
5. merge     the LoRA adapter folded into the base (tasks/merge.py merge_adapter): time, peak memory
6. quantize  ModelOpt FP8 of the merged model (tasks/runners/modelopt_quantize.py), `--calib` samples: time, memory
7. generate  transformers' generate on the merged model, greedy, batch 1 and 32, a fixed answer length: the floor
             any serving engine must beat

`--allow-cpu` runs the same steps where no GPU is (what CI runs, tests/unit/test_gpu_bench.py): one layer of the
architecture's shapes, the tokenizer's vocabulary, fp32, a short cutoff and one step. Its numbers say only that the
path works.

    python3 benchmarks/gpu_bench.py [--profile P] [--steps N] [--cutoff T] [--batch B] [--out gpu_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import yaml  # noqa: E402
from gpu_smoke import GpuMemoryPeak, Smoke, Step, environment, table, visible_gpu  # noqa: E402

from tasks.platform.config import Profile, load_profile  # noqa: E402
from tasks.platform.config.training import ModelArchitecture  # noqa: E402

STEPS = ("base", "lora", "bare", "qlora", "merge", "quantize", "generate")
NEEDS = {
    "lora": ("base",),
    "bare": ("base",),
    "qlora": ("base",),
    "merge": ("lora",),
    "quantize": ("merge",),
    "generate": ("merge",),
}
GENERATE_BATCHES = (1, 32)
GIB = 2**30


class Bench:
    """The bench's state: the shapes, the profile's train section, where things are written."""

    def __init__(self, profile: Profile, args: argparse.Namespace, work: Path, device: str):
        architecture = profile.base_model.architecture
        if architecture is None:
            raise SystemExit(f"gpu-bench: profile {args.profile} names no base_model.architecture to build")
        self.architecture: ModelArchitecture = architecture
        self.profile, self.args, self.work, self.device = profile, args, work, device
        self.on_gpu = device == "cuda"
        self.dtype = "bfloat16" if self.on_gpu else "float32"
        self.data_dir, self.base_dir, self.merged_dir = work / "data", work / "base", work / "merged"
        self.layers = args.layers or (architecture.num_hidden_layers if self.on_gpu else 1)

    def records(self) -> list[list[dict[str, str]]]:
        """Conversations whose prompt and answer each outrun the cutoff: every sample is cut to exactly it."""
        rng = random.Random(0)
        words = [
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(2000)
        ]
        count = max(self.args.steps * self.args.batch, self.args.calib, max(GENERATE_BATCHES))
        return [
            [
                {"role": "user", "content": " ".join(rng.choices(words, k=self.args.cutoff))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=self.args.cutoff))},
            ]
            for _ in range(count)
        ]

    def base(self, step: Step) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        from tasks.base_model import train_tokenizer
        from tasks.data.splits import dataset_info

        conversations = self.records()
        self.data_dir.mkdir(parents=True)
        for split in ("train", "eval"):
            rows = [{"messages": c} for c in conversations]
            (self.data_dir / f"{split}.json").write_text(json.dumps(rows))
        (self.data_dir / "dataset_info.json").write_text(json.dumps(dataset_info()))
        tokenizer = train_tokenizer([m["content"] for c in conversations[:200] for m in c], 4096)
        tokenizer.model_max_length = max(self.args.cutoff, 512)
        shape = self.architecture
        qwen = "qwen" in self.profile.base_model.source.lower()
        config = (Qwen2Config if qwen else LlamaConfig)(
            vocab_size=shape.vocab_size if self.on_gpu else len(tokenizer),
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=self.layers,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads,
            max_position_embeddings=max(self.args.cutoff, 4096),
            tie_word_embeddings=shape.tie_word_embeddings,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        started = time.perf_counter()
        torch.manual_seed(0)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, self.dtype))
        try:
            with torch.device(self.device):
                model = (Qwen2ForCausalLM if qwen else LlamaForCausalLM)(config)
        finally:
            torch.set_default_dtype(default_dtype)
        step.numbers["init_s"] = round(time.perf_counter() - started, 1)
        model.save_pretrained(self.base_dir)
        tokenizer.save_pretrained(self.base_dir)
        step.numbers |= {
            "architecture": "Qwen2" if qwen else "Llama",
            "layers": self.layers,
            "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
            "dtype": self.dtype,
            "checkpoint_gib": round(sum(p.stat().st_size for p in self.base_dir.glob("*.safetensors")) / GIB, 2),
        }
        del model
        self._free()

    def train_section(self, quantization_bit: int | None = None):
        """The profile's train section at the stated cutoff, batch and steps; the chatml template of the BPE."""
        return self.profile.train.model_copy(
            update={
                "template": "chatml",
                "cutoff_len": self.args.cutoff,
                "per_device_train_batch_size": self.args.batch,
                "gradient_accumulation_steps": 1,
                "max_steps": self.args.steps,
                "logging_steps": 1,
                "save_steps": 10 * self.args.steps,
                "bf16": self.on_gpu,
                "quantization_bit": quantization_bit,
            }
        )

    def lora(self, step: Step, quantization_bit: int | None = None) -> None:
        from tasks.train import llamafactory_config
        from tasks.training.launch import base_env, launch_command

        name = "qlora" if quantization_bit else "lora"
        if quantization_bit and not self.on_gpu:
            step.note = "bitsandbytes 4-bit needs CUDA"
            return
        config = llamafactory_config(
            self.train_section(quantization_bit), self.base_dir, self.data_dir, self.work / name, None
        )
        self.launch(step, name, config, launch_command(self.work / f"{name}.yaml"), base_env())

    def bare(self, step: Step) -> None:
        """LlamaFactory's example config with this bench's model, data and sizes, through its own CLI entry point."""
        cfg = self.train_section()
        config = {
            "model_name_or_path": str(self.base_dir),
            "trust_remote_code": True,
            "stage": "sft",
            "do_train": True,
            "finetuning_type": "lora",
            "lora_rank": cfg.lora_rank,
            "lora_target": cfg.lora_target,
            "lora_alpha": cfg.lora_alpha,
            "lora_dropout": cfg.lora_dropout,
            "dataset": "train",
            "dataset_dir": str(self.data_dir),
            "template": cfg.template,
            "cutoff_len": cfg.cutoff_len,
            "overwrite_cache": True,
            "output_dir": str(self.work / "bare"),
            "logging_steps": 1,
            "save_steps": cfg.save_steps,
            "plot_loss": True,
            "overwrite_output_dir": True,
            "report_to": "none",
            "per_device_train_batch_size": cfg.per_device_train_batch_size,
            "gradient_accumulation_steps": 1,
            "learning_rate": 1.0e-4,
            "max_steps": cfg.max_steps,
            "lr_scheduler_type": "cosine",
            "warmup_ratio": 0.1,
            "bf16": cfg.bf16,
            "ddp_timeout": 180000000,
            # what the profile asks of the computation (attention kernel, gradient checkpointing) is the same run's
            **cfg.extra_args,
        }
        env = dict(os.environ)
        if not self.on_gpu:  # no torchaudio loads beside the CPU torch (tasks/runners/llamafactory_launch.py)
            placeholder = str(ROOT / "infra" / "images" / "torchaudio-placeholder")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [placeholder, env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "llamafactory.cli", "train", str(self.work / "bare.yaml")]
        self.launch(step, "bare", config, command, env)
        lora = self.work / "lora" / "train_results.json"
        if lora.is_file():
            pipeline = json.loads(lora.read_text())["train_runtime"]
            step.numbers["pipeline_over_bare"] = round(pipeline / step.numbers["train_runtime_s"], 3)

    def launch(self, step: Step, name: str, config: dict, command: list[str], env: dict[str, str]) -> None:
        (self.work / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        log_path = self.work / f"{name}.log"
        started = time.perf_counter()
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.work, env=env)
            with GpuMemoryPeak([process.pid], gpu=self.on_gpu) as memory:
                process.wait()
        if process.returncode != 0:
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            raise RuntimeError(f"LlamaFactory exited with {process.returncode}: {(lines or ['?'])[-1][:200]}")
        results = json.loads((self.work / name / "train_results.json").read_text())
        runtime = results["train_runtime"]
        tokens = self.args.steps * self.args.batch * self.args.cutoff
        step.numbers |= {
            "steps": json.loads((self.work / name / "trainer_state.json").read_text())["global_step"],
            "tokens_per_step": self.args.batch * self.args.cutoff,
            "train_runtime_s": round(runtime, 1),
            "tokens_per_s_per_gpu": round(tokens / runtime),
            "wall_s": round(time.perf_counter() - started, 1),
            **self.peaks(memory),
        }
        if "num_input_tokens_seen" in results:
            step.numbers["tokens_seen"] = results["num_input_tokens_seen"]

    def merge(self, step: Step) -> None:
        from tasks.merge import merge_adapter
        from tasks.quality.models import Compute

        probe = [[{"role": "user", "content": "abc de"}, {"role": "assistant", "content": "fgh"}]]
        with GpuMemoryPeak([os.getpid()], gpu=self.on_gpu) as memory:
            diff = merge_adapter(
                self.base_dir, self.work / "lora", self.merged_dir, probe, Compute(self.device, self.dtype)
            )
        step.numbers |= {"max_abs_dlogits": float(f"{diff:.3g}"), **self.peaks(memory)}
        self._free()

    def quantize(self, step: Step) -> None:
        import importlib.util

        import torch

        if importlib.util.find_spec("modelopt") is None:
            step.note = "nvidia-modelopt is not installed"
            return
        if self.on_gpu and torch.cuda.get_device_capability(0) < (8, 9):
            step.note = "no FP8 on this GPU (compute capability < 8.9)"
            return
        from transformers import AutoModelForCausalLM

        from tasks.data.splits import load_split
        from tasks.quality.models import load_tokenizer
        from tasks.quantize import calibration_ids
        from tasks.runners.modelopt_quantize import check_export, export_checkpoint, quantize_model

        tokenizer = load_tokenizer(self.merged_dir)
        samples = calibration_ids(tokenizer, load_split(self.data_dir, "train")[: self.args.calib], self.args.cutoff)
        with GpuMemoryPeak([os.getpid()], gpu=self.on_gpu) as memory:
            dtype = getattr(torch, self.dtype)
            model = AutoModelForCausalLM.from_pretrained(self.merged_dir, dtype=dtype).to(self.device).eval()
            started = time.perf_counter()
            quantize_model(model, samples, "fp8", kv_cache_fp8=False, awq_block_size=128)
            calibrate_s = time.perf_counter() - started
            export_checkpoint(model, self.work / "fp8")
        step.numbers |= {
            "calibration_samples": len(samples),
            "calibrate_s": round(calibrate_s, 1),
            "quant_algo": check_export(self.work / "fp8", "fp8", False)["quant_algo"],
            "checkpoint_gib": round(sum(p.stat().st_size for p in (self.work / "fp8").glob("*.safetensors")) / GIB, 2),
            **self.peaks(memory),
        }
        del model
        self._free()

    def generate(self, step: Step) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.merged_dir, dtype=getattr(torch, self.dtype))
        model = model.to(self.device).eval()
        tokens = self.args.answer_tokens
        generator = torch.Generator().manual_seed(0)
        for batch in GENERATE_BATCHES:
            shape = (batch, self.args.prompt_tokens)
            prompt = torch.randint(3, model.config.vocab_size, shape, generator=generator).to(self.device)
            mask = torch.ones_like(prompt)
            with torch.inference_mode():
                model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=4, do_sample=False)  # warm-up
                self._sync()
                started = time.perf_counter()
                out = model.generate(
                    input_ids=prompt, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
                )
                self._sync()
            seconds = time.perf_counter() - started
            assert out.shape[1] == self.args.prompt_tokens + tokens, out.shape
            step.numbers[f"tokens_per_s_batch_{batch}"] = round(batch * tokens / seconds, 1)
        step.numbers |= {"prompt_tokens": self.args.prompt_tokens, "answer_tokens": tokens}
        del model
        self._free()

    def peaks(self, memory: GpuMemoryPeak) -> dict[str, float]:
        found = {"peak_host_gib": round(memory.host_peak / GIB, 2)}
        if self.on_gpu:
            found["peak_gpu_gib"] = round(memory.peak / GIB, 2)
        return found

    def _sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()

    def _free(self) -> None:
        import gc

        gc.collect()
        if self.on_gpu:
            import torch

            torch.cuda.empty_cache()


def drop(folder: Path, keep: bool) -> None:
    """A checkpoint no later step reads, deleted as soon as it was measured (a 7B base, its merge and its FP8 export
    together are about 40 GB of the lent machine's 64 GiB disk); kept with --keep."""
    if not keep and folder.exists():
        shutil.rmtree(folder)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="qwen-7b-vllm-h100", help="a GPU profile naming base_model.architecture")
    parser.add_argument("--steps", type=int, help="optimizer steps of each training run (GPU 20, CPU 1)")
    parser.add_argument("--cutoff", type=int, help="tokens per sample (GPU 1024, CPU 32)")
    parser.add_argument("--batch", type=int, help="samples per step on the GPU (GPU 4, CPU 2)")
    parser.add_argument("--layers", type=int, help="decoder layers (GPU: the architecture's; CPU 1)")
    parser.add_argument("--calib", type=int, help="ModelOpt calibration samples (GPU 64, CPU 4)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length of the generation runs (GPU 128, CPU 16)")
    parser.add_argument("--answer-tokens", type=int, help="answer length of the generation runs (GPU 128, CPU 4)")
    parser.add_argument("--out", type=Path, default=Path("gpu_bench.json"), help="the JSON of numbers")
    parser.add_argument("--work", type=Path, help="where models and logs go (default: a temporary folder)")
    parser.add_argument("--skip", action="append", default=[], choices=STEPS, help="a step not to run")
    parser.add_argument(
        "--allow-cpu", action="store_true", help="without a GPU, run one layer of the shapes on the CPU"
    )
    parser.add_argument("--keep", action="store_true", help="keep each checkpoint (by default deleted once measured)")
    return parser.parse_args(argv)


def with_defaults(args: argparse.Namespace, on_gpu: bool) -> argparse.Namespace:
    defaults = {
        "steps": (20, 1),
        "cutoff": (1024, 32),
        "batch": (4, 2),
        "calib": (64, 4),
        "prompt_tokens": (128, 16),
        "answer_tokens": (128, 4),
    }
    for name, (gpu, cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, gpu if on_gpu else cpu)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = visible_gpu("gpu-bench", args.allow_cpu, "runs one layer of the same shapes on the CPU")
    if on_gpu is None:
        return 2
    args = with_defaults(args, on_gpu)
    device = "cuda" if on_gpu else "cpu"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    profile = load_profile(args.profile)
    env = environment(device) | {"profile": args.profile}
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        bench = Bench(profile, args, work, device)
        env |= {"steps": args.steps, "cutoff": args.cutoff, "batch": args.batch, "layers": bench.layers}
        run = Smoke(set(args.skip), env, args.out, STEPS, NEEDS, label="gpu-bench")
        run.run("base", bench.base)
        run.run("lora", bench.lora)
        run.run("bare", bench.bare)
        run.run("qlora", lambda step: bench.lora(step, quantization_bit=4))
        run.run("merge", bench.merge)
        drop(bench.base_dir, args.keep)  # every step that reads the base ran: its 15 GB go before the next ones write
        run.run("quantize", bench.quantize)
        drop(work / "fp8", args.keep)
        run.run("generate", bench.generate)
        drop(bench.merged_dir, args.keep)
    steps = list(run.steps.values())
    run.save()
    print(table(env, steps, label="gpu-bench"))
    print(f"\ngpu-bench: numbers in {args.out}")
    return 1 if any(s.status == "failed" for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
