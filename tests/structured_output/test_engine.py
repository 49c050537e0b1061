"""Structured outputs in the engine, on random-weight tiny models (the harshest case:
nothing but the mask keeps them on track): every output matches its regex, is one of
its choices, or parses as JSON that validates against its schema; greedy output equals
Hugging Face's greedy search with the same bitmask applied to its logits; chunked
prefill, preemption and n > 1 keep it so."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from microvllm import LLM, SamplingParams
from microvllm.models.tiny import make_tiny_model
from microvllm.sampling_params import StructuredOutputsParams
from microvllm.structured_output import StructuredOutputManager
from microvllm.structured_output.bitmask import unpack

pytest.importorskip("xgrammar")

ARCHS = ("llama", "mistral", "qwen3")
SETTINGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
# Chunked prefill in 8-token steps and 12 usable blocks of 4: preemption when several decode.
TIGHT = dict(max_model_len=128, block_size=4, num_kv_blocks=13, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    return {arch: str(make_tiny_model(root / arch, arch, seed=7)) for arch in ARCHS}


@pytest.fixture(scope="module")
def engines(folders):
    return {(arch, backend): LLM(folders[arch], structured_outputs_backend=backend, **SETTINGS)
            for arch in ARCHS for backend in ("course", "xgrammar")}


# Bounded patterns (no * or +): a random model must end them, since once the pattern is
# complete only EOS is allowed; max_tokens leaves room for one character per token.
@st.composite
def bounded_regexes(draw, depth=0):
    kind = draw(st.sampled_from(["lit", "set"] + (["cat", "alt", "rep"] if depth < 3 else [])))
    if kind == "lit":
        return re.escape(draw(st.sampled_from("abcxyz019 -")))
    if kind == "set":
        return draw(st.sampled_from(["[a-c]", "[0-9]", "[xyz ]", "\\d"]))
    if kind == "cat":
        return draw(bounded_regexes(depth + 1)) + draw(bounded_regexes(depth + 1))
    if kind == "alt":
        return "(" + draw(bounded_regexes(depth + 1)) + "|" + draw(bounded_regexes(depth + 1)) + ")"
    low = draw(st.integers(0, 2))
    return "(" + draw(bounded_regexes(depth + 1)) + "){" + f"{low},{low + draw(st.integers(0, 2))}" + "}"


def regex_params(pattern: str, **sampling) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured_outputs=StructuredOutputsParams(regex=pattern), **sampling)


@pytest.mark.parametrize("backend", ["course", "xgrammar"])
@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(patterns=st.lists(bounded_regexes(), min_size=4, max_size=8))
def test_every_output_matches_its_regex(engines, arch, backend, patterns):
    llm = engines[(arch, backend)]
    params = [regex_params(p, temperature=[0.0, 1.0, 1.5][i % 3], seed=i) for i, p in enumerate(patterns)]
    outs = llm.generate(["the"] * len(patterns), params, use_tqdm=False)
    for pattern, out in zip(patterns, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (pattern, completion)
        assert re.fullmatch(pattern, completion.text), (pattern, completion.text)


@pytest.mark.parametrize("backend", ["course", "xgrammar"])
def test_choice_with_n_samples(engines, backend):
    choices = ["red", "green", "blue", "dark blue"]
    out = engines[("llama", backend)].generate(["x"], SamplingParams(
        n=6, temperature=1.5, seed=3, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices)),
        use_tqdm=False)[0]
    assert len(out.outputs) == 6 and all(c.text in choices for c in out.outputs)


@st.composite
def json_schemas(draw, depth=0):
    kind = draw(st.sampled_from(["enum", "int", "bool", "string"] + (["object", "array"] if depth < 2 else [])))
    if kind == "enum":
        return {"type": "string", "enum": draw(st.lists(st.sampled_from(["a", "bb", "c d", "e\\"]), min_size=1,
                                                        max_size=3, unique=True))}
    if kind == "int":
        low = draw(st.integers(-50, 50))
        return {"type": "integer", "minimum": low, "maximum": low + draw(st.integers(0, 100))}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": draw(st.integers(0, 4))}
    if kind == "array":
        return {"type": "array", "items": draw(json_schemas(depth + 1)), "maxItems": draw(st.integers(0, 2))}
    names = draw(st.lists(st.sampled_from(["id", "name", "ok", "tags"]), min_size=1, max_size=3, unique=True))
    return {"type": "object", "properties": {n: draw(json_schemas(depth + 1)) for n in names},
            "required": names, "additionalProperties": False}


# derandomize: the same examples every run. A random search found the case pinned in
# test_xgrammar_takes_a_surrogates_three_bytes_as_one_character (a limitation of xgrammar's,
# not a flake); a suite that fails at random on a known limitation hides new failures.
@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(json_schemas(), min_size=3, max_size=6))
def test_every_output_is_json_that_validates_against_its_schema(engines, arch, schemas):
    llm = engines[(arch, "xgrammar")]
    params = [SamplingParams(temperature=[0.0, 1.0][i % 2], seed=i, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
              for i, s in enumerate(schemas)]
    outs = llm.generate(["{"] * len(schemas), params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.xfail(strict=True, reason="xgrammar decodes UTF-8 leniently: it takes ED BF AF (U+DFEF, a UTF-16 "
                   "surrogate, invalid in UTF-8) as one character of a string, and the tokenizer's decode "
                   "gives three U+FFFD for it, so a maxLength 1 string comes out 3 characters long")
def test_xgrammar_takes_a_surrogates_three_bytes_as_one_character(folders):
    """Found by the property test above (qwen3's byte-level tokens 'í', '¿', '¯' are the bytes
    ED, BF, AF). Strict xfail: when xgrammar (or a mask of ours) refuses surrogates, this
    passes and must become a plain test."""
    schema = {"type": "object", "properties": {"id": {"type": "string", "maxLength": 2},
                                               "ok": {"type": "string", "enum": ["a", "bb"]},
                                               "name": {"type": "string", "maxLength": 1}},
              "required": ["id", "ok", "name"], "additionalProperties": False}
    # enforce_eager: the sampler's plain draw, which drew the surrogate from this seed.
    llm = LLM(folders["qwen3"], structured_outputs_backend="xgrammar", enforce_eager=True, **SETTINGS)
    out = llm.generate(["{"], SamplingParams(
        temperature=1.0, seed=1, max_tokens=200,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True)), use_tqdm=False)
    jsonschema.validate(json.loads(out[0].outputs[0].text), schema)


def test_json_object_is_an_object(engines):
    out = engines[("llama", "xgrammar")].generate(["x"], SamplingParams(
        temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json_object=True,
                                                                                  disable_any_whitespace=True)),
        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict)
    assert out.text.startswith("{")


@pytest.mark.parametrize("backend", ["course", "xgrammar"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hugging_face_with_the_same_mask(folders, arch, backend):
    """The reference: HF's greedy search, each step's logits masked with a bitmask from a
    matcher of our own that follows HF's tokens."""
    from transformers import AutoModelForCausalLM

    pattern = r"(ab|[0-9]{2})-[xyz]{1,3}( [a-c]{2}){0,2}"
    folder = folders[arch]
    llm = LLM(folder, structured_outputs_backend=backend, **SETTINGS)
    prompt_ids = [5, 17, 42, 9]
    ours = llm.generate([{"prompt_token_ids": prompt_ids}], regex_params(pattern, temperature=0), use_tqdm=False)
    ours = ours[0].outputs[0].token_ids
    manager = StructuredOutputManager(llm.engine.prompts.tokenizer, llm.engine.prompts.vocab_size, backend)
    grammar = manager.compile(regex_params(pattern), 1)[0]
    manager.add("hf", grammar)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids, theirs = list(prompt_ids), []
    eos = set(llm.engine.prompts.eos_token_ids)
    with torch.no_grad():
        for _ in range(60):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            allowed = unpack(manager.grammar_bitmask(["hf"]), logits.shape[-1])[0]
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            theirs.append(token)
            if token in eos:
                break
            assert manager.accept_tokens("hf", [token])
            ids.append(token)
    assert ours == theirs
    assert re.fullmatch(pattern, llm.get_tokenizer().decode(ours, skip_special_tokens=True))


@pytest.mark.parametrize("backend", ["course", "xgrammar"])
def test_chunked_prefill_and_preemption_keep_outputs_and_grammars(folders, backend):
    folder = folders["llama"]
    patterns = [r"[a-c]{3,6}", r"\d{2}-\d{2}", r"(yes|no) (x|y){2}", r"[xyz ]{4,8}", r"[0-9]{5}"]
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 17, 30, 9, 24)]
    roomy = LLM(folder, structured_outputs_backend=backend, **SETTINGS)
    tight = LLM(folder, structured_outputs_backend=backend, debug_invariants=True, **TIGHT)
    params = [regex_params(p, temperature=0) for p in patterns]
    alone = [roomy.generate([prompt], [p], use_tqdm=False)[0].outputs[0].token_ids
             for prompt, p in zip(prompts, params)]
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.kv_cache_manager.block_pool is not None
    assert [o.outputs[0].token_ids for o in outs] == alone
    for pattern, out in zip(patterns, outs):
        assert re.fullmatch(pattern, out.outputs[0].text)
    assert not tight.engine.structured_output_manager.grammars   # every matcher forgotten


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(engines):
    out = engines[("llama", "course")].generate(["x"], regex_params("abc", temperature=0, ignore_eos=True),
                                                use_tqdm=False)[0].outputs[0]
    assert out.text == "abc" and out.finish_reason == "stop"


def test_max_tokens_cuts_a_structured_output_with_length(engines):
    out = engines[("llama", "course")].generate(["x"], SamplingParams(
        max_tokens=2, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-c]{10}")),
        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2


@pytest.mark.parametrize("spec, words", [
    (dict(regex="a(b"), ["structured_outputs.regex"]),
    (dict(json={"type": "object", "properties": 3}), ["structured_outputs.json"]),
    (dict(grammar="root ::= "), ["structured_outputs.grammar"]),
])
def test_a_spec_that_does_not_compile_is_a_clear_error_and_the_llm_goes_on(engines, spec, words):
    llm = engines[("llama", "xgrammar")]
    with pytest.raises(ValueError) as error:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    assert all(w in str(error.value) for w in words), error.value
    assert llm.generate(["x"], SamplingParams(max_tokens=3), use_tqdm=False)[0].finished


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(TypeError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_the_trace_records_what_each_mask_allowed(folders):
    llm = LLM(folders["llama"], structured_outputs_backend="course", trace=True, **SETTINGS)
    out = llm.generate(["x", "y"], [regex_params("[a-c]{2}x", temperature=0), SamplingParams(max_tokens=3)],
                       use_tqdm=False)
    steps = [s for s in llm.trace.steps if s.allowed_fraction]
    assert len(steps) == len(out[0].outputs[0].token_ids)   # one mask per sampled token
    assert all(set(s.allowed_fraction) == {"0"} and 0 < s.allowed_fraction["0"] < 0.5 for s in steps)
    from microvllm.viz.summary import describe_step
    assert any("may sample" in line for line in describe_step(llm.trace, llm.trace.steps.index(steps[0])))
    manager = llm.engine.structured_output_manager
    assert manager.num_mask_steps == len(steps) and manager.mask_seconds_total > 0
