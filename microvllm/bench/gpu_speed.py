"""The speed half of ``python -m microvllm bench gpu``: a random-weight model of a real
shape (Llama-3.2-1B by default) built on the device, so that no weights travel; the
engine's tokens/s with CUDA graphs and eager, a batch-1 decode step each way, and
Hugging Face ``generate`` as a static batch on the same weights. Every function
takes the device: the tests run them on a CPU with a tiny shape."""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

from microvllm.bench.throughput import RunResult, Workload, microvllm_generate

# Llama-3.2-1B's shape (its rope scaling left out: the weights are random anyway).
LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    max_position_embeddings=2048)


def build_random_model(folder: Path, device: str, dtype: torch.dtype, **shape):
    """A Hugging Face Llama with random weights, built on ``device`` and saved as
    safetensors in ``folder`` (no tokenizer: prompts are token ids). Returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_3_2_1B, **shape}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder, safe_serialization=True)
    return model


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def batch1_decode_step_seconds(llm, prompt_len: int = 32, num_steps: int = 64) -> float:
    """Median seconds of one engine step decoding a single request (its prefill step left out)."""
    step_times: list[float] = []
    workload = Workload([[5 + i % 100 for i in range(prompt_len)]], [num_steps + 1])
    microvllm_generate(llm, workload, step_times=step_times)
    return statistics.median(step_times[1:])


@torch.inference_mode()
def hf_static_batch(model, workload: Workload, pad_id: int = 0) -> RunResult:
    """``model.generate`` on the whole workload as one left-padded batch, on the model's device."""
    width = max(len(p) for p in workload.prompts)
    ids = torch.full((len(workload.prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(workload.prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    synchronize(str(model.device))
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(workload.output_lens),
                         eos_token_id=None, pad_token_id=pad_id)
    synchronize(str(model.device))
    wall = time.perf_counter() - start
    outputs = [out[i, width:width + n].tolist() for i, n in enumerate(workload.output_lens)]
    return RunResult("HF generate, static batch", wall, workload.num_output_tokens,
                     workload.num_prompt_tokens + workload.num_output_tokens, outputs)


def engine_speed(folder: Path, device: str, dtype: str, workload: Workload, *, enforce_eager: bool,
                 max_model_len: int, **settings) -> tuple[RunResult, float]:
    """(the workload's run, a batch-1 decode step's seconds) for one engine, which is freed
    afterwards (each engine takes its share of the GPU's memory)."""
    from microvllm import LLM

    llm = LLM(str(folder), device=device, dtype=dtype, enforce_eager=enforce_eager,
              max_model_len=max_model_len, enable_prefix_caching=False, **settings)
    warm = Workload([p[:16] for p in workload.prompts], [4] * len(workload.prompts))
    microvllm_generate(llm, warm)   # compiles the kernels, captures the graphs of every size used
    step = batch1_decode_step_seconds(llm)
    result, _ = microvllm_generate(llm, workload, name=f"microvllm{' (enforce_eager)' if enforce_eager else ''}")
    del llm
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return result, step
