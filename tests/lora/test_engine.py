"""LoRA through the engine: ``LLM(enable_lora=True).generate(..., lora_request=...)`` gives
exactly the greedy tokens of transformers + peft, for one adapter and for a mixed batch of
three adapters and the base model in one call (steps that hold tokens of several
adapters, asserted from the trace)."""

from __future__ import annotations

import pytest

from microvllm import LLM, SamplingParams
from microvllm.lora.request import LoRARequest
from tests.engine.conftest import varied_prompts
from tests.lora.conftest import hf_peft_greedy

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(folder, **settings) -> LLM:
    settings = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "max_model_len": 256,
                "trace": True, "debug_invariants": True, **settings}
    return LLM(str(folder), **settings)


def check(folder, prompts, loras, outs) -> None:
    for prompt, lora, out in zip(prompts, loras, outs):
        want = hf_peft_greedy(str(folder), lora.lora_path if lora else None, tuple(prompt), MAX_TOKENS)
        assert tuple(out.outputs[0].token_ids) == want, f"adapter {lora and lora.lora_name} diverged"


def adapters_per_step(llm: LLM, loras_of: dict[str, LoRARequest | None]) -> list[set]:
    """Per step of the trace, the adapters (names; None: the base model) of the tokens it computed."""
    return [{(loras_of[s.request_id] or None) and loras_of[s.request_id].lora_name for s in step.scheduled}
            for step in llm.trace]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_one_adapter_equals_peft(lora_models, arch):
    folder, requests = lora_models[arch]
    prompts = varied_prompts(512, count=4, seed=21)
    llm = make_llm(folder)
    sql = requests["sql"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=sql)
    check(folder, prompts, [sql] * len(prompts), outs)
    base = [hf_peft_greedy(str(folder), None, tuple(p), MAX_TOKENS) for p in prompts]
    assert [tuple(o.outputs[0].token_ids) for o in outs] != base, "the adapter should change the output"


# Each regime asserted from the trace; max_loras=2 runs three adapters two at a time.
REGIMES = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=32),
    "preemption": dict(num_kv_blocks=14, max_num_batched_tokens=64),
    "max_loras_2": dict(max_loras=2),
    "async_scheduling": dict(async_scheduling=True, trace=False),   # two plans in flight: no trace
}


@pytest.mark.parametrize("arch, regime", [("llama", r) for r in REGIMES] + [("qwen3", "default")])
def test_mixed_batch_of_three_adapters_and_base(lora_models, arch, regime):
    folder, requests = lora_models[arch]
    prompts = varied_prompts(512, count=12, seed=22)
    choices = [requests["sql"], None, requests["poem"], requests["math"]]
    loras = [choices[i % 4] for i in range(len(prompts))]
    loras[-1] = loras[1]   # the repeated prompt (varied_prompts' last) under the same adapter: a full hit
    llm = make_llm(folder, **REGIMES[regime])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
    check(folder, prompts, loras, outs)
    if llm.trace is None:
        return
    steps = adapters_per_step(llm, {o.request_id: lora for o, lora in zip(outs, loras)})
    most = 2 if regime == "max_loras_2" else 3
    assert all(len(step - {None}) <= most for step in steps)
    assert any(len(step - {None}) >= 2 and None in step for step in steps), \
        "some step should hold tokens of several adapters and of the base model"
    trace = llm.trace
    if regime == "chunked":
        assert any(s.kind == "prefill" and s.num_scheduled_tokens < s.num_prompt_tokens
                   for step in trace for s in step.scheduled), "no prompt was chunked"
    if regime == "preemption":
        assert trace.preemption_steps(), "the pool was meant to be small enough to preempt"
    if regime == "default":
        assert any(s.prefix_hit_tokens for step in trace for s in step.scheduled), "no prefix hit"
        assert any(len(step - {None}) == 3 for step in steps), "max_loras=3 should let three adapters run at once"
    # every adapter changes its requests' output (same prompt, base vs adapter)
    for name in ("sql", "poem", "math"):
        p = prompts[loras.index(requests[name])]
        assert hf_peft_greedy(str(folder), None, tuple(p), MAX_TOKENS) != \
            hf_peft_greedy(str(folder), requests[name].lora_path, tuple(p), MAX_TOKENS), name


def test_lora_off_changes_nothing(lora_models):
    """Without enable_lora: no wrapper, and a lora_request is refused saying what to change."""
    folder, requests = lora_models["llama"]
    llm = LLM(str(folder), max_model_len=256)
    runner = llm.engine.executor.worker.model_runner
    assert runner.lora_manager is None
    assert "WithLoRA" not in repr(runner.model)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("hello", GREEDY, use_tqdm=False, lora_request=requests["sql"])


def test_refusals_before_running(lora_models, tmp_path):
    folder, requests = lora_models["llama"]
    llm = make_llm(folder, max_lora_rank=8)
    with pytest.raises(ValueError, match="not a peft adapter folder"):
        llm.generate("hello", GREEDY, use_tqdm=False, lora_request=LoRARequest("nothing", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_request entries"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=[requests["sql"]])
    with pytest.raises(TypeError, match="LoRARequest"):
        llm.generate("hello", GREEDY, use_tqdm=False, lora_request="sql")
    # an adapter trained on another base model (other sizes): refused by the front end
    from microvllm.models.tiny import make_tiny_model
    from tests.lora.conftest import make_adapter

    other = make_tiny_model(tmp_path / "other", "llama", seed=1, hidden_size=32, tokenizer=False)
    stranger = LoRARequest("stranger", 9, str(make_adapter(other, tmp_path / "stranger", seed=1, r=4, lora_alpha=8,
                                                           target_modules=["q_proj"])))
    with pytest.raises(ValueError, match="trained on another base model"):
        llm.generate("hello", GREEDY, use_tqdm=False, lora_request=stranger)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="without enable_lora"):
        LLM(str(folder), max_loras=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(folder), enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_prefix_cache_is_per_adapter(lora_models):
    """The same prompt under sql, then poem, then the base model: no prefix hit (the
    adapter is in every block hash); sql again: a hit. Each answer is still peft's."""
    folder, requests = lora_models["llama"]
    prompt = varied_prompts(512, count=2, seed=23)[0] + list(range(3, 40))   # > 2 blocks
    llm = make_llm(folder)
    hits = {}
    for label, lora in (("sql", requests["sql"]), ("poem", requests["poem"]), ("base", None),
                        ("sql again", requests["sql"])):
        start = len(llm.trace)
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=lora)[0]
        check(folder, [prompt], [lora], [out])
        hits[label] = [s.prefix_hit_tokens for step in list(llm.trace)[start:] for s in step.scheduled if s.is_new]
    assert hits["sql"] == hits["poem"] == hits["base"] == [0]
    assert hits["sql again"][0] >= 32, hits


def test_quantized_gguf_base_with_lora(lora_models, tmp_path):
    """A GGUF base (Q8_0 weights, run in their format) with an adapter: the LoRA update is
    added to the quantized layer's output, so the tokens are transformers + peft's on the
    file's float expansion (which the base alone matches exactly: tests/quantization)."""
    from microvllm.models.default_model import convert_gguf
    from microvllm.models.tiny_gguf import write_gguf
    from tests.lora.conftest import ADAPTER_CONFIGS, make_adapter

    folder, _ = lora_models["llama"]
    file = write_gguf(folder, tmp_path / "tiny-Q8_0.gguf", weight_type="Q8_0")
    expanded = tmp_path / "expanded"
    convert_gguf(file, expanded)
    adapter = make_adapter(expanded, tmp_path / "adapter", seed=5, **ADAPTER_CONFIGS["sql"])
    lora = LoRARequest("sql", 1, str(adapter))
    prompts = varied_prompts(512, count=4, seed=24)[:4]
    llm = make_llm(file)
    assert llm.engine.executor.worker.model.layers[0].self_attn.qkv_proj.base_layer.quant_method is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[lora, None, lora, None])
    check(expanded, prompts, [lora, None, lora, None], outs)
    assert tuple(outs[0].outputs[0].token_ids) != hf_peft_greedy(str(expanded), None, tuple(prompts[0]), MAX_TOKENS)


@pytest.mark.multiprocess
def test_tp2_mixed_batch_equals_peft(lora_models):
    """tensor_parallel_size=2: each rank holds its part of A and B (column layers: B's rows
    of its heads / its slice of gate and up; row layers: A's columns), and the update of
    a row layer joins its partial sum before the all-reduce: the same tokens as peft."""
    folder, requests = lora_models["llama"]
    prompts = varied_prompts(512, count=8, seed=25)
    loras = [[requests["sql"], None, requests["poem"], requests["math"]][i % 4] for i in range(len(prompts))]
    llm = make_llm(folder, tensor_parallel_size=2, max_num_batched_tokens=32)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
        check(folder, prompts, loras, outs)
    finally:
        llm.shutdown()


@pytest.mark.multiprocess
def test_async_llm_with_the_core_in_its_own_process(lora_models):
    """AsyncLLM.generate(..., lora_request=...) with the engine core in a process of its
    own (serve's default): the adapter crosses the socket with the request."""
    import asyncio

    from microvllm.engine.async_llm import AsyncLLM

    folder, requests = lora_models["llama"]
    prompts = varied_prompts(512, count=4, seed=26)[:4]
    loras = [requests["sql"], None, requests["poem"], requests["math"]]
    llm = AsyncLLM(str(folder), multiprocess=True, enable_lora=True, max_loras=3, max_lora_rank=8,
                   max_model_len=256)

    async def one(prompt, lora):
        async for out in llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=lora):
            last = out
        return last

    async def all_of_them():
        return await asyncio.gather(*(one(p, lora) for p, lora in zip(prompts, loras)))

    try:
        outs = asyncio.run(all_of_them())
    finally:
        llm.shutdown()
    check(folder, prompts, loras, outs)


def test_chat_with_an_adapter(lora_models):
    folder, requests = lora_models["llama"]
    llm = make_llm(folder)
    messages = [{"role": "user", "content": "tell me about the cache"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=requests["poem"])[0]
    check(folder, [out.prompt_token_ids], [requests["poem"]], [out])
    base = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert base.outputs[0].token_ids != out.outputs[0].token_ids
