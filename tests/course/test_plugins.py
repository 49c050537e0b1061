"""Each solution notebook's code, plugged into the real engine, generates exactly the
greedy tokens of Hugging Face ``generate`` on a tiny Llama."""

from __future__ import annotations

import re

import pytest

from microvllm import LLM, SamplingParams
from tests.course.conftest import ROOT, load_solution_module
from tests.engine.conftest import hf_greedy, varied_prompts

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _components(name, module):
    """(components, extra LLM settings, a check that the engine really uses them)."""
    if name == "01_detokenizer":
        return ({"detokenizer": module.IncrementalDetokenizer}, {},
                lambda llm: llm.engine.output_processor.detokenizer_class is module.IncrementalDetokenizer)
    if name == "03_block_pool":
        return ({"block_pool": module.BlockPool}, dict(num_kv_blocks=8, max_num_batched_tokens=32),
                lambda llm: type(llm.engine.kv_cache_manager.block_pool) is module.BlockPool
                and type(llm.engine.kv_cache_manager.block_pool.free_block_queue) is module.FreeKVCacheBlockQueue)
    if name == "04_prefix_cache":
        return ({"kv_cache_manager": module.KVCacheManager}, {},
                lambda llm: type(llm.engine.kv_cache_manager) is module.KVCacheManager)
    if name == "05_scheduler":
        return ({"scheduler": module.Scheduler}, dict(num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=3),
                lambda llm: type(llm.engine.scheduler) is module.Scheduler)
    if name == "06_decode_kernel":
        from microvllm.attention import register_backend
        from microvllm.attention.triton_backend import TritonAttentionBackend

        @register_backend("test-solution-decode")
        class SolutionDecode(TritonAttentionBackend):
            def __init__(self):
                super().__init__(use_decode_kernel=True)
                self._decode_attention = module.decode_attention

        def uses_it(llm):
            backend = llm.engine.executor.worker.backend
            return isinstance(backend, SolutionDecode) and backend._decode_attention is module.decode_attention
        return {}, dict(attention_backend="test-solution-decode"), uses_it
    if name == "07_sampler":
        return ({"sampler": module.Sampler}, {},
                lambda llm: type(llm.engine.executor.worker.model_runner.sampler) is module.Sampler)
    if name == "07_model_runner":
        return ({"block_table": module.BlockTable, "model_runner": module.ModelRunner},
                dict(max_num_batched_tokens=32),
                lambda llm: type(llm.engine.executor.worker.model_runner) is module.ModelRunner
                and type(llm.engine.executor.worker.model_runner.block_tables[0]) is module.BlockTable)
    if name == "14_rejection_sampler":   # speculative decoding on: every step's drafts are checked by it
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        return ({"rejection_sampler": module.RejectionSampler}, dict(speculative_config=spec),
                lambda llm: type(llm.engine.executor.worker.model_runner.rejection_sampler) is module.RejectionSampler)
    if name == "15_token_mask":   # the trie is built at the first structured request
        return ({"token_trie": module.TokenTrie}, dict(structured_outputs_backend="course"),
                lambda llm: type(llm.engine.structured_output_manager._backends["course"].vocabulary.trie)
                is module.TokenTrie)
    raise AssertionError(f"no plug-in test for {name}: add one")


PATTERN = r"(ab|[0-9]{2})-[xyz]{1,3}( [a-c]{2}){0,2}"


def hf_greedy_with_the_mask(folder: str, llm, prompt_ids: list[int], pattern: str, max_tokens: int) -> list[int]:
    """Hugging Face's greedy search, each step's logits masked by the package's own course
    backend (its TokenTrie, not the learner's) following HF's tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from microvllm.sampling_params import StructuredOutputsParams
    from microvllm.structured_output import StructuredOutputManager
    from microvllm.structured_output.bitmask import unpack

    manager = StructuredOutputManager(llm.engine.prompts.tokenizer, llm.engine.prompts.vocab_size, "course")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=pattern))
    manager.add("hf", manager.compile(params, 1)[0])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids, tokens = list(prompt_ids), []
    eos = set(llm.engine.prompts.eos_token_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            allowed = unpack(manager.grammar_bitmask(["hf"]), logits.shape[-1])[0]
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            tokens.append(token)
            if token in eos:
                break
            assert manager.accept_tokens("hf", [token])
            ids.append(token)
    return tokens


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb")))
def test_solution_plugs_into_the_engine_with_hf_identical_tokens(name, tiny_llama, tmp_path):
    module = load_solution_module(ROOT / "solutions" / f"{name}.ipynb", tmp_path)
    if name == "16_q4_1_blocks":   # a GGUF of the tiny Llama, enforce_eager=True: every Linear calls it
        _gguf_with_the_solution_dequantization(tiny_llama, tmp_path, module.dequantize_q4_1)
        return
    if name == "17_moe_align":   # a tiny Qwen3-MoE whose sorted experts call it at every step
        _qwen3_moe_with_the_solution_alignment(tmp_path, module.moe_align_block_size)
        return
    if name == "18_gated_delta_step":   # a tiny Qwen3.5 whose decode steps call it in every Gated DeltaNet layer
        from microvllm.checks.gated_delta import run_gated_deltanet_with

        result = run_gated_deltanet_with(module.gated_delta_step, quiet=True)
        calls = re.search(r"\((\d+) calls", result.message)
        assert result.same and calls and int(calls.group(1)) > 0, result.message
        return
    if name == "19_kv_connector":   # the tiny Llama with the in-process tier: the solution plans loads and frees
        from microvllm.checks.kv_connector import run_kv_tier_with

        result = run_kv_tier_with(module.plan_kv_load, module.release_finished_sends, quiet=True)
        assert result.same and "(12 calls to your plan_kv_load" in result.message, result.message
        return
    if name == "20_prefix_router":   # two replicas behind the Router, the solution choosing for each request
        _router_with_the_solution_choice(tiny_llama, module.choose_prefix_replica)
        return
    if name == "21_hermes_parser":   # a server streams the tiny model's forced tool calls through the solution's parser
        from microvllm.checks.hermes_parser import run_hermes_parser_with

        result = run_hermes_parser_with(module.Hermes2ProToolParser, quiet=True)
        calls = re.search(r"\((\d+) calls to yours\)", result.message)
        assert result.same and calls and int(calls.group(1)) > 0, result.message
        return
    if name == "22_lora_batch":   # a tiny Llama, two adapters and the base model in one batch, on the solution's ops
        from microvllm.checks.lora_batch import run_lora_with

        result = run_lora_with(module.bgmv_shrink, module.bgmv_expand_slice, quiet=True)
        mixed = re.search(r"(\d+) of them on a step with both adapters", result.message)
        assert result.same and mixed and int(mixed.group(1)) > 0, result.message
        return
    components, settings, uses_it = _components(name, module)
    prompts = varied_prompts(512, count=6, seed=3, max_len=40)
    if name == "06_decode_kernel":  # Triton's interpreter is slow: fewer, shorter prompts
        prompts = prompts[:3]
    llm = LLM(str(tiny_llama), components=components or None, max_model_len=128, debug_invariants=True,
              trace=True, **settings)
    if name == "15_token_mask":   # structured outputs: HF's greedy search under the same mask
        from microvllm.sampling_params import StructuredOutputsParams

        params = SamplingParams(temperature=0.0, max_tokens=40,
                                structured_outputs=StructuredOutputsParams(regex=PATTERN))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)
        assert uses_it(llm), "the engine did not build the solution's class"
        for prompt, out in zip(prompts[:3], outs):
            reference = hf_greedy_with_the_mask(str(tiny_llama), llm, prompt, PATTERN, 40)
            assert list(out.outputs[0].token_ids) == reference
        return
    assert uses_it(llm), "the engine did not build the solution's class"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert tuple(out.outputs[0].token_ids) == hf_greedy(str(tiny_llama), tuple(prompt), MAX_TOKENS)
    if name in ("03_block_pool", "05_scheduler"):
        assert llm.trace.preemption_steps(), "the settings were meant to force preemption"


def _gguf_with_the_solution_dequantization(tiny_llama, tmp_path, dequantize_q4_1):
    """The tiny Llama as a Q4_1 GGUF file: the same greedy tokens with the solution's
    dequantization as with the package's, and the solution's is the one called."""
    import microvllm.layers.quantization.gguf as gguf_format
    from microvllm.models.tiny_gguf import write_gguf

    llm = LLM(str(write_gguf(tiny_llama, tmp_path / "tiny.gguf")), enforce_eager=True, max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in varied_prompts(512, count=6, seed=3, max_len=40)]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    calls = []
    package = gguf_format.DEQUANTIZE["Q4_1"]
    gguf_format.DEQUANTIZE["Q4_1"] = lambda *args: calls.append(1) or dequantize_q4_1(*args)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        gguf_format.DEQUANTIZE["Q4_1"] = package
    assert calls, "the engine did not call the solution's dequantize_q4_1"
    assert [o.outputs[0].token_ids for o in outs] == reference


def _qwen3_moe_with_the_solution_alignment(tmp_path, moe_align_block_size):
    """A tiny Qwen3-MoE, "sorted" experts at 4 rows per block (so every run is padded), with the
    solution's moe_align_block_size: Hugging Face's greedy tokens, and the solution's is called."""
    import functools

    import microvllm.layers.fused_moe.layer as moe_layer
    import microvllm.layers.fused_moe.moe_sorted as moe_sorted
    from microvllm.models.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=17)
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MICROVLLM_MOE_IMPL", "sorted")
        patch.setitem(moe_layer.EXPERT_FUNCTIONS, "sorted",
                      functools.partial(moe_sorted.fused_moe_sorted, block_size=4))
        patch.setattr(moe_sorted, "moe_align_block_size",
                      lambda *args: calls.append(1) or moe_align_block_size(*args))
        llm = LLM(str(folder), enforce_eager=True, max_model_len=128)
        prompts = varied_prompts(512, count=6, seed=3, max_len=40)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert calls, "the engine did not call the solution's moe_align_block_size"
    for prompt, out in zip(prompts, outs):
        assert tuple(out.outputs[0].token_ids) == hf_greedy(str(folder), tuple(prompt), MAX_TOKENS)


def test_text_through_the_solution_detokenizer_matches(tiny_llama, tmp_path):
    module = load_solution_module(ROOT / "solutions" / "01_detokenizer.ipynb", tmp_path)
    prompts = ["Héllo wörld 🙂, the capital of France is", "The scheduler decides"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = LLM(str(tiny_llama), max_model_len=128).generate(prompts, params, use_tqdm=False)
    ours = LLM(str(tiny_llama), max_model_len=128, components={"detokenizer": module.IncrementalDetokenizer}
               ).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in ours] == [o.outputs[0].text for o in ref]


def test_unknown_component_names_the_valid_ones(tiny_llama):
    with pytest.raises(ValueError, match="unknown name 'blockpool'.*block_pool, kv_cache_manager, scheduler"):
        LLM(str(tiny_llama), components={"blockpool": object})
    with pytest.raises(TypeError, match="must be a class"):
        LLM(str(tiny_llama), components={"scheduler": "mine"})


def _router_with_the_solution_choice(tiny_llama, choose_prefix_replica):
    """Two replicas of the tiny Llama behind the Router, the prefix-aware policy calling the
    solution's choose_prefix_replica: Hugging Face's greedy tokens, both replicas used."""
    from microvllm.router import PrefixAwarePolicy, Router

    calls = []
    policy = PrefixAwarePolicy(choose=lambda *args, **kwargs: calls.append(1) or choose_prefix_replica(*args, **kwargs))
    replicas = [LLM(str(tiny_llama), block_size=4, max_model_len=128) for _ in range(2)]
    prompts = varied_prompts(512, count=6, seed=3, max_len=40)
    prompts = prompts + [p[:12] + [7, 8] for p in prompts[:2]]   # two that share a cached prefix
    report = Router(replicas, policy).route([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out in zip(prompts, report.outputs):
        assert tuple(out.outputs[0].token_ids) == hf_greedy(str(tiny_llama), tuple(prompt), MAX_TOKENS)
    assert len(calls) == len(prompts), "the router did not call the solution's choose_prefix_replica"
    assert {d.replica for d in report.decisions} == {0, 1}
