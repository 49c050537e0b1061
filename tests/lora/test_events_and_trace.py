"""The adapter in what the engine tells the outside: KV events (``BlockStored.lora_id`` and
``lora_name``, vLLM's fields, so a cache-aware router can tell adapters' blocks apart) and
the step trace (``RequestStep.lora_name``, drawn by the step explorer)."""

from __future__ import annotations

from microvllm.core.block_pool import BlockStored
from microvllm.core.kv_cache_manager import KVCacheManager
from microvllm.core.kv_cache_spec import FullAttentionSpec
from microvllm.distributed.kv_events import to_wire
from tests.lora.test_engine import GREEDY, make_llm
from tests.lora.test_scheduler_and_cache import A_, B, request


def test_block_stored_events_carry_the_adapter():
    kv = KVCacheManager([FullAttentionSpec(B)], 64, B, True, enable_kv_cache_events=True)
    for rid, lora in (("a", A_), ("base", None)):
        r = request(rid, list(range(1, 9)), lora)
        kv.allocate_slots(r, r.num_tokens)
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert [(e.lora_id, e.lora_name) for e in stored] == [(A_.lora_int_id, "sql"), (None, None)]
    wire = to_wire(stored[0])
    assert (wire.lora_id, wire.lora_name) == (A_.lora_int_id, "sql")


def test_the_trace_names_each_requests_adapter(lora_models):
    folder, loras = lora_models["llama"]
    llm = make_llm(folder)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}] * 3
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[loras["sql"], None, loras["poem"]])
    names = {s.request_id: s.lora_name for step in llm.trace.steps for s in step.scheduled}
    assert [names[o.request_id] for o in outs] == ["sql", None, "poem"]
    again = type(llm.trace).from_json(llm.trace.to_json())   # what the step explorer loads
    assert {s.request_id: s.lora_name for step in again.steps for s in step.scheduled} == names
