"""Each solution notebook's code, plugged into the real engine, generates exactly the
greedy tokens of Hugging Face ``generate`` on a tiny Llama."""

from __future__ import annotations

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
    raise AssertionError(f"no plug-in test for {name}: add one")


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb")))
def test_solution_plugs_into_the_engine_with_hf_identical_tokens(name, tiny_llama, tmp_path):
    module = load_solution_module(ROOT / "solutions" / f"{name}.ipynb", tmp_path)
    components, settings, uses_it = _components(name, module)
    prompts = varied_prompts(512, count=6, seed=3, max_len=40)
    if name == "06_decode_kernel":  # Triton's interpreter is slow: fewer, shorter prompts
        prompts = prompts[:3]
    llm = LLM(str(tiny_llama), components=components or None, max_model_len=128, debug_invariants=True,
              trace=True, **settings)
    assert uses_it(llm), "the engine did not build the solution's class"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert tuple(out.outputs[0].token_ids) == hf_greedy(str(tiny_llama), tuple(prompt), MAX_TOKENS)
    if name in ("03_block_pool", "05_scheduler"):
        assert llm.trace.preemption_steps(), "the settings were meant to force preemption"


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
