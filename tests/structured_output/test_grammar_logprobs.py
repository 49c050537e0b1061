"""A grammar's logprobs and its dead ends, in the engine (issue 38, items 3 and 4).

Logprobs are the model's raw ones, taken before the grammar mask, as before every
other rule: the sampler, its speculative-decoding path too. A grammar whose first mask
allows nothing is refused when the request is processed; one whose mask empties later
fails its request with ``finish_reason="error"`` and the reason, on both backends, and
the refused token is never output.
"""

from __future__ import annotations

import pytest
import torch

from microvllm import LLM, SamplingParams
from microvllm.models.tiny import make_tiny_model
from microvllm.sample.logprobs import compute_logprobs
from microvllm.sample.metadata import SamplingMetadata
from microvllm.sample.sampler import Sampler
from microvllm.sampling_params import StructuredOutputsParams
from microvllm.structured_output.bitmask import allows_nothing, pack

pytest.importorskip("xgrammar")

SETTINGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
BACKENDS = ("xgrammar", "course")
NEVER = "[^\\0-\U0010ffff]"            # an empty character class, in both backends' syntax
DEAD_END = "a[^\\0-\U0010ffff]"        # "a", then nothing (xgrammar allows the "a")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("grammar_logprobs") / "llama", "llama", seed=7))


def regex(pattern: str, **sampling) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(regex=pattern), **sampling)


def test_the_sampler_returns_raw_logprobs_and_draws_only_allowed_ids():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[:, [3, 40, 69]] = True
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=1.0, logprobs=5),
              SamplingParams(temperature=0, logprobs=5)]
    metadata = SamplingMetadata.from_params(params, grammar_bitmask=pack(allowed), grammar_rows=[0, 1])
    out = Sampler(seed=0)(logits, metadata)
    assert set(out.sampled_token_ids[:2].tolist()) <= {3, 40, 69}
    assert out.sampled_token_ids[2] == logits[2].argmax()   # row 2 has no grammar
    raw = compute_logprobs(logits)
    assert torch.equal(out.logprobs_tensors.logprobs[:, 1:], raw.topk(5, dim=-1).values)
    assert torch.isfinite(out.logprobs_tensors.logprobs).all()


def test_allows_nothing_ignores_the_bits_past_the_vocabulary():
    none = torch.zeros(70, dtype=torch.bool)
    one = none.clone()
    one[69] = True
    words = torch.cat([pack(none)[None], pack(one)[None]])
    words[0, -1] = -1 << 6   # bits for ids 70..95, which do not exist
    assert allows_nothing(words, 70).tolist() == [True, False]


def test_speculative_decoding_keeps_a_grammars_raw_logprobs(folder):
    """A structured request beside one with drafts goes through the rejection sampler's
    path: its logprobs there are raw too, equal to the same request's without grammar."""
    llm = LLM(folder, speculative_config={"method": "layer_skip", "num_speculative_tokens": 2,
                                          "num_draft_layers": 1}, **SETTINGS)
    runner = llm.engine.executor.worker.model_runner
    real, calls = runner._sample_with_drafts, []

    def spy(plan, *args):
        calls.append(plan.grammar_bitmask is not None)
        return real(plan, *args)

    runner._sample_with_drafts = spy
    drafted = SamplingParams(temperature=0, max_tokens=8)
    choice = StructuredOutputsParams(choice=["yes", "no"])
    plain, constrained = (llm.generate(["one two", "the quick"], [
        drafted, SamplingParams(temperature=0, max_tokens=3, logprobs=5, structured_outputs=structured)],
        use_tqdm=False)[1].outputs[0] for structured in (None, choice))
    assert any(calls), "no step sampled a structured request beside drafts"

    def top5(row) -> dict[int, float]:
        return {token_id: lp.logprob for token_id, lp in row.items() if lp.rank <= 5}

    assert top5(constrained.logprobs[0]) == pytest.approx(top5(plain.logprobs[0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grammar_that_allows_nothing_at_the_start_is_refused_at_the_door(folder, backend):
    llm = LLM(folder, structured_outputs_backend=backend, **SETTINGS)
    with pytest.raises(ValueError, match="structured_outputs.regex can never be matched"):
        llm.generate(["the"], regex(NEVER, max_tokens=4), use_tqdm=False)
    assert llm.generate(["the"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_grammar_that_dead_ends_fails_its_request_with_the_reason(folder, caplog):
    llm = LLM(folder, structured_outputs_backend="xgrammar", debug_invariants=True, **SETTINGS)
    out, other = llm.generate(["the", "the"], [regex(DEAD_END, temperature=0, max_tokens=8, n=2),
                                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)],
                              use_tqdm=False)
    assert out.error is not None and "allows no token after 1 generated token," in out.error, out.error
    assert out.bad_request   # the request's own fault: a server answers 400
    assert [c.finish_reason for c in out.outputs] == ["error", "error"]
    assert all(c.text in ("", "a") for c in out.outputs), [c.text for c in out.outputs]
    assert len(other.outputs[0].token_ids) == 8   # the other request went on
    assert "sampler ignored" not in caplog.text
    assert llm.engine.structured_output_manager.grammars == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grammar_whose_tokens_the_other_rules_all_forbid_fails_its_request(folder, backend):
    """Regex "a+" allows only a's; allowed_token_ids only "b" (id 68): every logit is -inf,
    whatever is drawn breaks the grammar, so the request fails instead of outputting it."""
    llm = LLM(folder, structured_outputs_backend=backend, debug_invariants=True, **SETTINGS)
    out = llm.generate(["the"], regex("a+", temperature=0, max_tokens=4, allowed_token_ids=[68]),
                       use_tqdm=False)[0]
    assert out.error is not None and "forbidden by the request's other rules" in out.error, out.error
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
