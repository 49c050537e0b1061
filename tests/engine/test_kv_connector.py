"""The KV connector seam through the real engine, with the tiny model: the
``OffloadingConnector`` second tier turns prefixes the pool could not keep into prefix
hits, and greedy tokens stay exactly those of the engine without it."""

from __future__ import annotations

import argparse
import random

import pytest

from microvllm import LLM, SamplingParams
from microvllm.config.kv_transfer import KVTransferConfig
from microvllm.engine.arg_utils import EngineArgs
from microvllm.models.tiny import make_tiny_model

TIER = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kv_connector") / "llama", "llama", seed=3)


def shared_prefix_prompts(num_prompts: int, num_prefixes: int = 4, prefix_len: int = 48) -> list[dict]:
    """Prompts that return, round robin, to a few long shared prefixes (system prompts)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 200) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [{"prompt_token_ids": prefixes[i % num_prefixes] + [rng.randrange(3, 200) for _ in range(5)]}
            for i in range(num_prompts)]


def run_one_at_a_time(model, prompts, kv_transfer_config=None, **kwargs):
    """Each prompt arrives after the previous one finished; returns (tokens, hit tokens, engine)."""
    llm = LLM(str(model), block_size=8, num_kv_blocks=20, max_num_seqs=2, kv_transfer_config=kv_transfer_config,
              debug_invariants=True, **kwargs)
    tokens = [out.outputs[0].token_ids for p in prompts for out in llm.generate([p], GREEDY, use_tqdm=False)]
    engine = llm.llm_engine
    return tokens, engine.prefix_cache_hits, engine


def test_the_tier_turns_prefixes_the_pool_cannot_keep_into_hits_with_identical_tokens(model):
    """Four 48-token prefixes (24 blocks of 8) and a pool of 19 usable blocks: by the time
    a prefix comes back, LRU has evicted it. The tier, with its defaults (twice the pool's
    blocks), keeps it and loads it back. (A tier smaller than the cycle would thrash just
    as the pool does: LRU over a loop.)"""
    prompts = shared_prefix_prompts(12)
    tokens, hits, _ = run_one_at_a_time(model, prompts)
    tier_tokens, tier_hits, engine = run_one_at_a_time(model, prompts, TIER)
    assert tier_tokens == tokens
    assert hits == 0
    assert tier_hits == 8 * 48                    # every prompt after the first round: its whole prefix
    connector = engine.scheduler.connector
    assert connector.num_blocks_loaded == 8 * 6 and connector.num_blocks_saved > 0
    assert not engine.scheduler.kv_sending and not engine.scheduler.kv_pinned


def test_many_requests_at_once_with_a_small_mmapped_tier_keep_their_tokens(model, tmp_path):
    """All prompts in one batch (loads, pins and delayed frees interleave with running
    requests), the store a memory-mapped file."""
    prompts = shared_prefix_prompts(10, num_prefixes=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    config = {**TIER, "kv_connector_extra_config": {"num_cpu_blocks": 40, "path": str(tmp_path / "tier.bin")}}
    outputs = {}
    for name, transfer in (("plain", None), ("tier", config)):
        llm = LLM(str(model), block_size=8, num_kv_blocks=22, max_num_seqs=3, max_num_batched_tokens=64,
                  kv_transfer_config=transfer, debug_invariants=True)
        llm.generate(prompts[:3], params, use_tqdm=False)           # fills the tier
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["tier"] == outputs["plain"]
    assert llm.llm_engine.scheduler.connector.num_blocks_loaded > 0


def test_kv_transfer_config_is_checked_and_says_what_to_change(model):
    with pytest.raises(ValueError, match="kv_role=None: set it to one of"):
        KVTransferConfig.from_dict({"kv_connector": "OffloadingConnector"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['kv_conector'\]"):
        KVTransferConfig.from_dict({"kv_conector": "OffloadingConnector", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.from_dict("{kv_connector: 1}")
    config = KVTransferConfig.from_dict('{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}')
    assert config.is_kv_producer and config.is_kv_consumer and config.engine_id
    with pytest.raises(ValueError, match="'NoSuchConnector' is not a connector: choose one of .*OffloadingConnector"):
        LLM(str(model), num_kv_blocks=8, kv_transfer_config={"kv_connector": "NoSuchConnector", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="set enable_prefix_caching=True"):
        LLM(str(model), num_kv_blocks=8, enable_prefix_caching=False, kv_transfer_config=TIER)


def test_the_cli_flag_parses_json():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}'])
    assert EngineArgs.from_cli_args(args).kv_transfer_config == TIER


@pytest.mark.multiprocess
def test_the_tier_with_two_tensor_parallel_ranks_keeps_tokens_and_hits(model):
    """Each rank's worker keeps its own KV heads in its own store; rank 0 reports."""
    prompts = shared_prefix_prompts(8)
    tokens, hits, engine = run_one_at_a_time(model, prompts, tensor_parallel_size=2)
    engine.shutdown()
    tier_tokens, tier_hits, engine = run_one_at_a_time(model, prompts, TIER, tensor_parallel_size=2)
    engine.shutdown()
    assert tier_tokens == tokens and hits == 0 and tier_hits == 4 * 48


class _FaultyConnector:
    """The tier, but its scheduler side raises for prompts that start with token 13 (a
    connector tripping over one client's kv_transfer_params)."""

    @staticmethod
    def load() -> type:
        from microvllm.distributed.kv_transfer.kv_connector.offloading_connector import OffloadingConnector

        class FaultyConnector(OffloadingConnector):
            def get_num_new_matched_tokens(self, request, num_computed_tokens):
                if request.prompt_token_ids[0] == 13:
                    raise RuntimeError("a connector bug, for this request only")
                return super().get_num_new_matched_tokens(request, num_computed_tokens)
        return FaultyConnector


def test_a_connector_error_fails_that_request_and_never_the_engine(model):
    """Three requests, max_num_seqs 2: the faulty one is asked both on arrival and, queued,
    after a step (inside update_from_output). It alone ends with an error; the others get
    the tokens of an engine without the fault; the pool's accounting holds throughout."""
    from microvllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("FaultyConnector", _FaultyConnector.load)
    except ValueError:
        pass   # registered by an earlier run in this process
    prompts = shared_prefix_prompts(3)
    for order in ([0, 1, 2], [2, 0, 1]):       # the faulty one queued last, then first
        faulty = {**prompts[2], "prompt_token_ids": [13] + prompts[2]["prompt_token_ids"]}
        batch = [prompts[0], prompts[1], faulty]
        llm = LLM(str(model), block_size=8, num_kv_blocks=20, max_num_seqs=2, debug_invariants=True,
                  kv_transfer_config={"kv_connector": "FaultyConnector", "kv_role": "kv_both"})
        engine = llm.llm_engine
        for index in order:
            engine.add_request(str(index), batch[index], GREEDY)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert finished["2"].error is not None and "a connector bug" in finished["2"].error
        want = LLM(str(model), block_size=8, num_kv_blocks=20).generate(batch[:2], GREEDY, use_tqdm=False)
        assert [finished[str(i)].outputs[0].token_ids for i in (0, 1)] == [w.outputs[0].token_ids for w in want]
        assert engine.kv_cache_manager.usage == 0.0
