"""``LLM(enforce_eager=True)`` runs the model exactly as the notebooks write it: every op's
``forward_native``, no compiled library in the process, no decode fast path, the torch
attention backend; and its greedy tokens are those of the default (fast) path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from microvllm import LLM, SamplingParams
from microvllm.layers.custom_op import CustomOp
from microvllm.models.llama import LlamaDecoderLayer
from microvllm.platforms.cpu import kernels
from tests.engine.conftest import varied_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def greedy(llm, prompts):
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)]


def ops_of(llm) -> dict[str, int]:
    worker = llm.engine.executor.worker
    counts: dict[str, int] = {}
    for module in (worker.model, worker.model_runner.sampler):
        for op in module.modules():
            if isinstance(op, CustomOp):
                counts[op.implementation] = counts.get(op.implementation, 0) + 1
    return counts


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])   # window; per-head norms
def test_eager_gives_the_default_paths_tokens_on_tiny_models(tiny_models, family):
    folder = tiny_models[family]
    prompts = varied_prompts(512, count=6, seed=11, max_len=40)
    settings = dict(max_model_len=128, max_num_batched_tokens=32, debug_invariants=True)
    fast, eager = LLM(str(folder), **settings), LLM(str(folder), enforce_eager=True, **settings)
    assert set(ops_of(eager)) == {"native"}
    assert eager.engine.executor.worker.model_runner.decode_step_runner is None
    assert eager.engine.config.device_config.attention_backend == "torch"
    if kernels.status("norm_rope") is None:   # the default path really is another path
        assert "rms_norm_forward" in ops_of(fast) and "PackedLinear" in ops_of(fast)
    assert greedy(eager, prompts) == greedy(fast, prompts)


def test_eager_steps_go_through_the_decoder_layers(tiny_models, monkeypatch):
    """A breakpoint in LlamaDecoderLayer.forward hits in every step, decodes included."""
    calls = []
    forward = LlamaDecoderLayer.forward
    monkeypatch.setattr(LlamaDecoderLayer, "forward",
                        lambda self, *args: calls.append(len(args[1])) or forward(self, *args))
    llm = LLM(str(tiny_models["llama"]), enforce_eager=True, max_model_len=64)
    num_layers = len(llm.engine.executor.worker.model.layers)
    greedy(llm, [[5, 6, 7]])
    assert calls.count(1) == 9 * num_layers   # 9 decode steps of one token, every layer


def test_eager_refuses_the_compiled_attention_backend(tiny_models):
    with pytest.raises(ValueError, match="enforce_eager=True turns off.*attention_backend='torch'"):
        LLM(str(tiny_models["llama"]), enforce_eager=True, attention_backend="cpu")


@pytest.mark.slow   # about 20 s: two processes load the embedded model
def test_eager_maps_no_compiled_library_and_matches_the_default_path(default_model_folder):
    """In a fresh interpreter: the embedded model with enforce_eager=True leaves no library
    of ours in /proc/self/maps; then the default path (which loads them) gives the same
    greedy tokens."""
    script = f"""
import re
from microvllm import LLM, SamplingParams
from microvllm.platforms.cpu import kernels

def ours():
    maps = open("/proc/self/maps").read()
    return sorted(set(re.findall(r"\\S*/cpu_kernels/\\S+\\.so", maps)))

params = SamplingParams(temperature=0.0, max_tokens=16)
prompts = ["The capital of France is", "Write a haiku about the sea."]
eager = LLM({str(default_model_folder)!r}, enforce_eager=True)
eager_ids = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
assert ours() == [], ours()
assert kernels.load.cache_info().currsize == 0
fast = LLM({str(default_model_folder)!r})
fast_ids = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
if kernels.status("norm_rope") is None:
    assert ours(), "the default path loaded none of the libraries: the check above proves nothing"
assert eager_ids == fast_ids, (eager_ids, fast_ids)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
