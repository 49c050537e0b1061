"""Speculative decoding in the engine: greedy output with drafts is token-for-token the
output without them (and so Hugging Face's), for every method and architecture, under
chunked prefill, preemption and prefix-cache hits; every other feature still holds."""

import pytest

from microvllm import LLM, SamplingParams
from microvllm.models.tiny import make_tiny_model
from tests.engine.conftest import hf_greedy, varied_prompts

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

SETTINGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=32),
    "preemption": dict(num_kv_blocks=14, max_num_batched_tokens=64),
}


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    """A separate tiny model with the targets' vocabulary (512): the draft_model method's draft."""
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=3)


def spec_configs(draft_folder) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "layer_skip": {"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 3},
        "draft_model": {"method": "draft_model", "model": str(draft_folder), "num_speculative_tokens": 2},
    }


def self_repeating_prompts(seed: int) -> list[list[int]]:
    """Varied prompts whose tails repeat their heads, so that n-gram drafts exist."""
    return [p + p[:12] for p in varied_prompts(512, count=10, seed=seed)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft_model"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_identical_to_hugging_face(tiny_models, draft_folder, arch, method, setting):
    prompts = self_repeating_prompts(seed={"llama": 21, "mistral": 22, "qwen3": 23}[arch])
    llm = LLM(str(tiny_models[arch]), max_model_len=256, trace=True, debug_invariants=True,
              speculative_config=spec_configs(draft_folder)[method], **SETTINGS[setting])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].finish_reason == "length"
        assert tuple(out.outputs[0].token_ids) == hf_greedy(str(tiny_models[arch]), tuple(prompt), MAX_TOKENS), \
            f"{method} on {arch} ({setting}): a prompt of {len(prompt)} tokens diverged"
    manager = llm.engine.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == manager.num_usable_blocks   # every block back

    # The trace shows the regime really happened, with drafts checked and some rejected.
    steps = [s for step in llm.trace for s in step.scheduled]
    drafted = [s for s in steps if s.num_draft_tokens]
    assert drafted, "no step checked drafts"
    assert any(s.num_accepted_tokens < s.num_draft_tokens for s in drafted), "no draft was ever rejected"
    if method != "draft_model":   # a random draft model rarely agrees with a random target
        assert any(s.num_accepted_tokens for s in drafted), "no draft was ever accepted"
    if setting == "preemption":
        assert llm.trace.preemption_steps(), "the pool was meant to be small enough to preempt"
    if setting == "chunked":
        assert any(s.kind == "prefill" and s.num_scheduled_tokens < s.num_prompt_tokens for s in steps)
    if setting == "default":
        assert any(s.prefix_hit_tokens for s in steps), "prompts sharing a prefix should hit the cache"
    stats = llm.engine.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens == sum(s.num_draft_tokens for s in drafted)
    assert stats.num_accepted_tokens == sum(s.num_accepted_tokens for s in drafted)


def test_max_tokens_stop_and_n(tiny_models, draft_folder):
    """Never more tokens than asked; stop tokens and n > 1 samples as without drafts."""
    folder = str(tiny_models["llama"])
    prompts = [{"prompt_token_ids": p} for p in self_repeating_prompts(seed=5)[:4]]
    plain = LLM(folder, max_model_len=256)
    spec = LLM(folder, max_model_len=256, debug_invariants=True,
               speculative_config=spec_configs(draft_folder)["ngram"])
    for params in (SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=30, n=3, ignore_eos=True)):
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            assert all(len(c.token_ids) == params.max_tokens for c in g.outputs)
    # A stop token in the middle of accepted drafts: the tokens after it are dropped.
    reference = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                               use_tqdm=False)
    for prompt, ref in zip(prompts, reference):
        stop_id = ref.outputs[0].token_ids[10]
        params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id])
        got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
        # A stop string: the detokenizer finds it inside a step's several new tokens.
        text = ref.outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], ignore_eos=True)
        got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        assert want.finish_reason == "stop" and len(want.text) < len(text)
    assert spec.engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0


def test_sampling_rules_and_logprobs_follow_each_draft_position(tiny_models, draft_folder):
    """min_tokens, penalties, bad words and logprobs are applied at each draft position as
    if the tokens before it had been sampled one by one: greedy output and its logprobs
    are the plain engine's."""
    folder = str(tiny_models["qwen3"])
    prompts = [{"prompt_token_ids": p} for p in self_repeating_prompts(seed=6)[:4]]
    plain = LLM(folder, max_model_len=256)
    spec = LLM(folder, max_model_len=256, speculative_config=spec_configs(draft_folder)["layer_skip"])
    eos = plain.engine.prompts.eos_token_id
    for params in (SamplingParams(temperature=0.0, max_tokens=20, logprobs=3),
                   SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5,
                                  frequency_penalty=0.3, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=20, min_tokens=15,
                                  stop_token_ids=[eos] if eos is not None else None)):
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, params
            if params.logprobs:
                for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                    assert lw.keys() == lg.keys()
                    for token in lw:
                        assert lg[token].logprob == pytest.approx(lw[token].logprob, abs=1e-4)
                        assert lg[token].rank == lw[token].rank


def test_disable_by_batch_size(tiny_models, draft_folder):
    """No drafts in a step of at least disable_by_batch_size requests; drafts again when the
    batch shrinks below it (the outputs stay the plain engine's)."""
    folder = str(tiny_models["llama"])
    prompts = self_repeating_prompts(seed=12)[:6]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(6)]
    config = {**spec_configs(draft_folder)["ngram"], "disable_by_batch_size": 3}
    llm = LLM(folder, max_model_len=256, trace=True, speculative_config=config)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = LLM(folder, max_model_len=256).generate([{"prompt_token_ids": p} for p in prompts], params,
                                                    use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # Drafts are proposed after a step and checked in the next one: a step of 3 or more
    # requests proposes none, so the step after it checks none.
    steps = list(llm.trace)
    for before, after in zip(steps, steps[1:]):
        if len(before.scheduled) >= 3:
            assert not any(s.num_draft_tokens for s in after.scheduled)
    assert any(s.num_draft_tokens for step in steps for s in step.scheduled), "small batches should draft"


def test_seeded_random_sampling_is_reproducible(tiny_models, draft_folder):
    folder = str(tiny_models["llama"])
    prompts = [{"prompt_token_ids": p} for p in self_repeating_prompts(seed=7)[:4]]
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    runs = []
    for _ in range(2):
        llm = LLM(folder, max_model_len=256, speculative_config=spec_configs(draft_folder)["ngram"])
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
    assert llm.engine.scheduler.spec_decoding_stats.num_drafts > 0


def test_metrics(tiny_models, draft_folder):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, speculative_config=spec_configs(draft_folder)["ngram"])
    llm.generate([{"prompt_token_ids": p} for p in self_repeating_prompts(seed=8)[:3]], GREEDY, use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    stats = llm.engine.scheduler.spec_decoding_stats
    assert metrics["vllm:spec_decode_num_drafts"].value == stats.num_drafts > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == stats.num_draft_tokens
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == stats.num_accepted_tokens
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert sum(per_pos) == stats.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)


@pytest.mark.parametrize("options, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "vLLM method that microvllm does not implement"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 > prompt_lookup_max=2"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
    ({"method": "layer_skip", "num_speculative_tokens": 2, "num_draft_layers": 2}, "below the target's 2 layers"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown keys ['typo']"),
    ('{"method": ngram}', "not valid JSON"),
])
def test_config_errors(tiny_models, options, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LLM(str(tiny_models["llama"]), max_model_len=128, speculative_config=options)


def test_draft_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    other = make_tiny_model(tmp_path / "other", "llama", seed=1, tokenizer=False, vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens but the target's has 512"):
        LLM(str(tiny_models["llama"]), max_model_len=128,
            speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})


@pytest.mark.multiprocess
def test_ngram_with_tensor_parallelism(tiny_models, draft_folder):
    folder = str(tiny_models["llama"])
    prompts = self_repeating_prompts(seed=9)[:6]
    llm = LLM(folder, tensor_parallel_size=2, max_model_len=128, trace=True,
              speculative_config=spec_configs(draft_folder)["ngram"])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert tuple(out.outputs[0].token_ids) == hf_greedy(folder, tuple(prompt), MAX_TOKENS)
    assert any(s.num_accepted_tokens for step in llm.trace for s in step.scheduled if s.num_draft_tokens)
    llm.shutdown()


def test_draft_methods_refuse_tensor_parallelism(tiny_models):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not implemented"):
        LLM(str(tiny_models["llama"]), tensor_parallel_size=2, max_model_len=128,
            speculative_config={"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 2})


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "layer_skip"])
def test_default_model(default_model_folder, method):
    """The embedded model: greedy with drafts = Hugging Face, on prompts it can copy from."""
    prompts = [p + p for p in varied_prompts(49152, count=6, seed=11, max_len=30)]
    config = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
              if method == "ngram" else {"method": "layer_skip", "num_draft_layers": 12, "num_speculative_tokens": 3})
    llm = LLM(str(default_model_folder), max_model_len=256, trace=True, speculative_config=config)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert tuple(out.outputs[0].token_ids) == hf_greedy(str(default_model_folder), tuple(prompt), MAX_TOKENS)
    assert llm.engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0


def test_command_line_and_prometheus(monkeypatch):
    """``--speculative-config '<json>'`` on generate / serve; /metrics has the counters, and
    ``bench serve`` reads them back."""
    import argparse

    from microvllm.bench.serve import spec_decode_counters
    from microvllm.core.spec_decode_stats import SpecDecodingStats
    from microvllm.engine.arg_utils import EngineArgs
    from microvllm.engine.metrics import ServingMetrics

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert EngineArgs.from_cli_args(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 2}

    stats = SpecDecodingStats()
    stats.observe(3, 2)
    stats.observe(3, 0)
    metrics = ServingMetrics()
    metrics.set_spec_decoding(stats)
    text = metrics.render("m")
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1' in text

    class Reply:
        def __init__(self, text):
            self.text = text

    import httpx
    monkeypatch.setattr(httpx, "get", lambda url, timeout: Reply(text))
    assert spec_decode_counters("http://x") == (2, 6, 2)


def test_structured_requests_beside_speculative_ones(tiny_models, draft_folder):
    """A request under a grammar gets no drafts (they would need the grammar too) and is
    sampled as without speculative decoding; the others in the batch still draft."""
    import re

    from microvllm.sampling_params import StructuredOutputsParams

    folder = str(tiny_models["llama"])
    prompts = [{"prompt_token_ids": p} for p in self_repeating_prompts(seed=10)[:4]]
    constrained = SamplingParams(temperature=0.0, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(regex="[a-c]{3}-[0-9]{4}"))
    params = [constrained, GREEDY, constrained, GREEDY]
    plain = LLM(folder, max_model_len=256, structured_outputs_backend="course")
    spec = LLM(folder, max_model_len=256, structured_outputs_backend="course", trace=True,
               speculative_config=spec_configs(draft_folder)["ngram"])
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert re.fullmatch("[a-c]{3}-[0-9]{4}", got[0].outputs[0].text)
    drafted = {s.request_id for step in spec.trace for s in step.scheduled if s.num_draft_tokens}
    assert drafted and not drafted & {got[0].request_id, got[2].request_id}
