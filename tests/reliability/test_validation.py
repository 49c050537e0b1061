"""Validation at the door: every bad input a learner can type fails at once, before
any work is done, with a standard exception whose message names the parameter, the
value, and what to do instead. Afterwards the same ``LLM`` serves the next valid call
with every block free (or, for a construction error, a fresh ``LLM`` works).

The walk follows the issue's list: prompts, SamplingParams, engine settings, model
folders, engine calls (duplicate ids, unknown aborts, corrupt traces).
"""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import microvllm.llm
from microvllm import LLM, SamplingParams
from microvllm.attention import triton_kernels
from microvllm.core import PoolTooSmallError
from microvllm.trace import Trace

VOCAB = 512  # the tiny models' vocabulary
GOOD_PROMPT = {"prompt_token_ids": list(range(10, 30))}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# A small pool: 8 usable blocks of 4 tokens = 32 tokens, while max_model_len is 64,
# so "longer than max_model_len" and "more than the whole cache" are different errors.
SMALL = dict(max_model_len=64, block_size=4, num_kv_blocks=9, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(str(tiny_llama), debug_invariants=True, **SMALL)
    llm.expected = llm.generate(GOOD_PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    return llm


def assert_serves(llm):
    """Nothing left over from the failed call, and the next valid call works."""
    engine = llm.engine
    manager = engine.kv_cache_manager
    assert not engine.has_unfinished_requests(), engine.scheduler.requests
    assert engine.get_num_unfinished_requests() == 0
    assert manager.block_pool.get_num_free_blocks() == manager.num_usable_blocks, "a block is still held"
    engine.check_invariants()
    out = llm.generate(GOOD_PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.finished and out.outputs[0].token_ids == llm.expected
    assert manager.block_pool.get_num_free_blocks() == manager.num_usable_blocks


def assert_names(error, *words):
    """The message names the parameter, the value, and what to do (case-insensitive)."""
    message = str(error.value).lower()
    missing = [w for w in words if w.lower() not in message]
    assert not missing, f"message does not mention {missing}: {error.value}"


# ----------------------------------------------------------------------------- prompts
PROMPT_CASES = {
    # name: (prompt, exception, words the message must contain)
    "empty string": ("", ValueError, ["prompt", "empty string", "at least one"]),
    "empty token list": ({"prompt_token_ids": []}, ValueError, ["prompt_token_ids", "empty", "at least one"]),
    "negative token id": ({"prompt_token_ids": [5, -1]}, ValueError,
                          ["prompt_token_ids", "-1", "0 <= id < vocab_size"]),
    "token id = vocab size": ({"prompt_token_ids": [5, VOCAB]}, ValueError,
                              ["prompt_token_ids", str(VOCAB), "vocab_size"]),
    "float token ids": ({"prompt_token_ids": [1.0, 2.0]}, TypeError, ["prompt_token_ids", "1.0", "list of ints"]),
    "a tensor of ids": ({"prompt_token_ids": torch.tensor([1, 2])}, TypeError, ["prompt_token_ids", "list of ints"]),
    "dict without prompt keys": ({"text": "hi"}, ValueError, ["'text'", "prompt_token_ids", "'prompt'"]),
    "a bare token id list": ([1, 2, 3], TypeError, ["prompt must be", "got list", "prompt_token_ids"]),
    "bytes": (b"hi", TypeError, ["prompt must be", "got bytes", "str"]),
    "an int": (7, TypeError, ["prompt must be", "got int", "7"]),
    "longer than max_model_len": ({"prompt_token_ids": [5] * 64}, ValueError,
                                  ["prompts[1]", "64 tokens", "max_model_len is 64", "shorten the prompt"]),
    "more KV than the whole cache": ({"prompt_token_ids": [5] * 40}, PoolTooSmallError,
                                     ["prompts[1]", "41 tokens", "8 usable blocks", "num_kv_blocks"]),
}


@pytest.mark.parametrize("case", list(PROMPT_CASES))
def test_bad_prompt_through_generate(llm, case):
    prompt, error_type, words = PROMPT_CASES[case]
    steps = llm.engine.num_steps
    with pytest.raises(error_type) as error:
        # A good prompt first: it must not be run, nor left behind, either.
        llm.generate([GOOD_PROMPT, prompt], GREEDY, use_tqdm=False)
    assert_names(error, *words)
    assert llm.engine.num_steps == steps, "work was done before the bad prompt was found"
    assert_serves(llm)


@pytest.mark.parametrize("case", list(PROMPT_CASES))
def test_bad_prompt_through_add_request(llm, case):
    prompt, error_type, words = PROMPT_CASES[case]
    with pytest.raises(error_type) as error:
        llm.engine.add_request("bad", prompt, GREEDY)
    assert_names(error, *[w.replace("prompts[1]", "'bad'") for w in words])
    assert_serves(llm)


@pytest.mark.parametrize("prompts", [42, None, 3.5], ids=["int", "None", "float"])
def test_prompts_that_are_not_prompts(llm, prompts):
    with pytest.raises(TypeError) as error:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_names(error, "prompts must be", str(prompts), "prompt_token_ids")
    assert_serves(llm)


def test_token_ids_passed_as_the_prompts_list(llm):
    """``generate([1, 2, 3])`` is a list of three prompts, each an int: the message
    shows how token ids are passed."""
    with pytest.raises(TypeError) as error:
        llm.generate([1, 2, 3], GREEDY, use_tqdm=False)
    assert_names(error, "prompt must be", "got int", "{'prompt_token_ids': [1, 2, 3]}")
    assert_serves(llm)


def test_text_prompt_too_long_for_max_model_len(llm):
    with pytest.raises(ValueError) as error:
        llm.generate("word " * 200, GREEDY, use_tqdm=False)
    assert_names(error, "prompts[0]", "max_model_len is 64", "shorten the prompt")
    assert_serves(llm)


# ---------------------------------------------------------------------- SamplingParams
PARAM_CASES = {
    # name: (kwargs, exception, words: the parameter, the value, what to do)
    "max_tokens=0": (dict(max_tokens=0), ValueError, ["max_tokens", "0", "1 or more"]),
    "max_tokens<0": (dict(max_tokens=-3), ValueError, ["max_tokens", "-3", "1 or more"]),
    "max_tokens float": (dict(max_tokens=2.5), TypeError, ["max_tokens", "2.5", "integer"]),
    "temperature<0": (dict(temperature=-0.5), ValueError, ["temperature", "-0.5", "0 for greedy"]),
    "temperature NaN": (dict(temperature=math.nan), ValueError, ["temperature", "nan", "0 for greedy"]),
    "temperature inf": (dict(temperature=math.inf), ValueError, ["temperature", "inf", "finite"]),
    "temperature str": (dict(temperature="0.7"), TypeError, ["temperature", "'0.7'", "number"]),
    "top_p=0": (dict(top_p=0.0), ValueError, ["top_p", "0.0", "(0, 1]"]),
    "top_p>1": (dict(top_p=1.5), ValueError, ["top_p", "1.5", "use 1.0"]),
    "top_p NaN": (dict(top_p=math.nan), ValueError, ["top_p", "nan", "(0, 1]"]),
    "top_k<-1": (dict(top_k=-2), ValueError, ["top_k", "-2", "positive count"]),
    "top_k float": (dict(top_k=5.0), TypeError, ["top_k", "5.0", "integer"]),
    "min_p<0": (dict(min_p=-0.1), ValueError, ["min_p", "-0.1", "[0, 1]"]),
    "min_p>1": (dict(min_p=1.5), ValueError, ["min_p", "1.5", "use 0 to turn it off"]),
    "n=0": (dict(n=0), ValueError, ["n must be", "0", "1 or more"]),
    "min_tokens>max_tokens": (dict(min_tokens=8, max_tokens=4), ValueError,
                              ["min_tokens=8", "max_tokens=4", "lower min_tokens"]),
    "min_tokens<0": (dict(min_tokens=-1), ValueError, ["min_tokens", "-1", ">= 0"]),
    "seed float": (dict(seed=1.5), TypeError, ["seed", "1.5", "integer"]),
    "seed str": (dict(seed="42"), TypeError, ["seed", "'42'", "integer"]),
    "seed bool": (dict(seed=True), TypeError, ["seed", "true", "integer"]),
    "empty stop string": (dict(stop=""), ValueError, ["stop", "empty string", "remove it"]),
    "empty stop string in a list": (dict(stop=["ok", ""]), ValueError, ["stop", "empty string", "remove it"]),
    "stop not a string": (dict(stop=[3]), TypeError, ["stop", "3", "list of strings"]),
    "negative stop token id": (dict(stop_token_ids=[-2]), ValueError, ["stop_token_ids", "-2", ">= 0"]),
    "logprobs<0": (dict(logprobs=-1), ValueError, ["logprobs", "-1", "none for no logprobs"]),
    "unknown keyword (typo)": (dict(temprature=0.5), TypeError, ["'temprature'", "did you mean 'temperature'"]),
    "unknown keyword (vLLM only)": (dict(best_of=2), TypeError, ["'best_of'", "does not implement", "remove it"]),
}


@pytest.mark.parametrize("case", list(PARAM_CASES))
def test_bad_sampling_params(llm, case):
    kwargs, error_type, words = PARAM_CASES[case]
    with pytest.raises(error_type) as error:
        SamplingParams(**kwargs)
    assert_names(error, *words)
    assert_serves(llm)


@pytest.mark.parametrize("field, value, error_type", [
    ("max_tokens", 0, ValueError), ("temperature", -1.0, ValueError), ("top_p", 2.0, ValueError),
    ("n", 0, ValueError), ("seed", "x", TypeError)])
def test_params_changed_after_construction_are_checked_at_the_door(llm, field, value, error_type):
    params = SamplingParams(temperature=0, max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(error_type) as error:
        llm.generate(GOOD_PROMPT, params, use_tqdm=False)
    assert_names(error, field, str(value))
    steps = llm.engine.num_steps
    with pytest.raises(error_type):  # the bad one second: nothing is run
        llm.generate([GOOD_PROMPT, GOOD_PROMPT], [GREEDY, params], use_tqdm=False)
    assert llm.engine.num_steps == steps
    with pytest.raises(error_type):
        llm.engine.add_request("late", GOOD_PROMPT, params)
    assert_serves(llm)


@pytest.mark.parametrize("sampling_params, words", [
    ({"temperature": 0}, ["sampling_params", "dict", "SamplingParams("]),
    ([{"temperature": 0}], ["sampling_params", "dict", "SamplingParams("]),
    ([GREEDY, GREEDY], ["1 prompts", "2 sampling_params", "one per prompt"]),
])
def test_sampling_params_of_the_wrong_kind(llm, sampling_params, words):
    with pytest.raises((TypeError, ValueError)) as error:
        llm.generate(GOOD_PROMPT, sampling_params, use_tqdm=False)
    assert_names(error, *words)
    assert_serves(llm)


def test_top_k_zero_and_minus_one_mean_disabled(llm):
    """Like current vLLM (and unlike the issue's first draft, which called top_k=0 an
    error), top_k=0 means "no top-k filter"; -1, vLLM's older spelling, is stored as 0.
    The sampler agrees (metadata drops a top_k column that is all 0): seeded samples
    with top_k 0, -1 and the vocabulary size (keep everything) are identical."""
    assert SamplingParams(top_k=-1).top_k == 0
    outputs = []
    for top_k in (0, -1, VOCAB):
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=3, max_tokens=8, ignore_eos=True)
        outputs.append(llm.generate(GOOD_PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1] == outputs[2]
    assert_serves(llm)


# --------------------------------------------------------------------- engine settings
SETTING_CASES = {
    # name: (LLM kwargs, exception, words, raised before the model is loaded?)
    "block_size=3": (dict(block_size=3), ValueError, ["block_size=3", "power of two"], True),
    "block_size=0": (dict(block_size=0), ValueError, ["block_size=0", "at least 1"], True),
    "block_size=-4": (dict(block_size=-4), ValueError, ["block_size=-4", "at least 1"], True),
    "block_size float": (dict(block_size=16.0), TypeError, ["block_size=16.0", "must be an int"], True),
    "num_kv_blocks=0": (dict(num_kv_blocks=0), ValueError, ["num_kv_blocks=0", "at least 1"], True),
    "num_kv_blocks=1": (dict(num_kv_blocks=1), ValueError, ["num_kv_blocks=1", "at least 2", "null block"], True),
    "max_num_seqs=0": (dict(max_num_seqs=0), ValueError, ["max_num_seqs=0", "at least 1"], True),
    "budget under one block": (dict(block_size=16, max_num_batched_tokens=8), ValueError,
                               ["max_num_batched_tokens=8", "block_size=16", "raise it to at least 16"], True),
    "no chunking, small budget": (dict(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=64),
                                  ValueError, ["enable_chunked_prefill=False", "32 < 64", "enable chunked prefill"],
                                  True),
    # max_model_len comes from the model's config here, so only known after loading it.
    "no chunking, model's max_model_len": (dict(enable_chunked_prefill=False, max_num_batched_tokens=32),
                                           ValueError, ["enable_chunked_prefill=False", "32 < 1024",
                                                        "raise max_num_batched_tokens"], False),
    "max_model_len over the model's": (dict(max_model_len=4096), ValueError,
                                       ["max_model_len=4096", "max_position_embeddings=1024", "lower max_model_len"],
                                       False),
    "unknown dtype": (dict(dtype="fp8"), ValueError, ["dtype='fp8'", "float32"], True),
    "dtype as torch.dtype": (dict(dtype=torch.float32), ValueError, ["dtype=torch.float32", "'float32'"], True),
    "unknown attention_backend": (dict(attention_backend="flash"), ValueError,
                                  ["attention_backend='flash'", "'torch'"], True),
    "attention_backend None": (dict(attention_backend=None), TypeError, ["attention_backend=none", "'torch'"], True),
    "seed float": (dict(seed=0.5), TypeError, ["seed=0.5", "int"], True),
    "vLLM-only option": (dict(kv_cache_dtype="fp8"), TypeError,
                         ["'kv_cache_dtype'", "vllm option that microvllm does not implement", "remove it",
                          "num_kv_blocks"], True),
    "unknown quantization": (dict(quantization="awq"), ValueError,
                             ["quantization='awq'", "choose one of ['gguf', 'int8']"], True),
    "gpu_memory_utilization out of range": (dict(gpu_memory_utilization=1.5), ValueError,
                                            ["gpu_memory_utilization=1.5", "(0, 1]"], True),
    "trust_remote_code": (dict(trust_remote_code=True), ValueError,
                          ["trust_remote_code=true", "never runs code", "remove trust_remote_code"], True),
    "tensor parallel size 0": (dict(tensor_parallel_size=0), ValueError,
                               ["tensor_parallel_size=0", "at least 1"], True),
    "separate tokenizer": (dict(tokenizer="gpt2"), ValueError, ["tokenizer='gpt2'", "remove tokenizer="], True),
    "option typo": (dict(num_kv_block=8), TypeError, ["'num_kv_block'", "did you mean 'num_kv_blocks'"], True),
    "several unknown at once": (dict(config_format="hf", num_kv_block=8, flux_capacitor=1), TypeError,
                                ["3 unknown arguments", "'config_format' (a vllm option that microvllm does not "
                                 "implement)", "did you mean 'num_kv_blocks'", "'flux_capacitor' (not a vllm"], True),
}


@pytest.mark.parametrize("case", list(SETTING_CASES))
def test_bad_engine_setting(tiny_llama, monkeypatch, case):
    kwargs, error_type, words, before_loading = SETTING_CASES[case]
    if before_loading:  # then the Engine (tokenizer, weights, KV cache) is never even built
        monkeypatch.setattr(microvllm.llm, "Engine", _engine_must_not_be_built)
    with pytest.raises(error_type) as error:
        LLM(str(tiny_llama), **kwargs)
    assert_names(error, *words)


def _engine_must_not_be_built(config):
    raise AssertionError(f"the engine was built although the settings are invalid: {config}")


@pytest.mark.parametrize("why", ["not installed", "imported before the interpreter"])
def test_triton_backend_where_it_cannot_run(tiny_llama, monkeypatch, why):
    """Simulated: no CUDA here, and Triton either missing or already imported without
    TRITON_INTERPRET=1. The error says to choose attention_backend='torch'."""
    monkeypatch.setattr(triton_kernels.torch.cuda, "is_available", lambda: False)
    if why == "not installed":
        monkeypatch.setattr(triton_kernels, "_triton_installed", lambda: False)
    else:
        monkeypatch.setattr(triton_kernels, "_interpreter_on", lambda: False)
        monkeypatch.setattr(triton_kernels, "_triton_imported", lambda: True)
    with pytest.raises(RuntimeError) as error:
        LLM(str(tiny_llama), attention_backend="triton", max_model_len=64)
    assert_names(error, "triton", "attention_backend='torch'")


def test_a_fresh_llm_works_after_setting_errors(tiny_llama, llm):
    fresh = LLM(str(tiny_llama), **SMALL)
    assert fresh.generate(GOOD_PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == llm.expected


# ------------------------------------------------------------------------ model folders
def copy_model(good, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(good, folder)
    return folder


def rewrite_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def break_folder(folder, how):
    """Damage a copy of a good model folder; return (exception, words in the message)."""
    config = folder / "config.json"
    weights = folder / "model.safetensors"
    if how == "missing folder":
        shutil.rmtree(folder)
        return FileNotFoundError, ["model=", str(folder), "model=none"]
    if how == "a file, not a folder":
        shutil.rmtree(folder)
        folder.write_text("not a model")
        return FileNotFoundError, ["model=", "is not a folder", "hugging face model folder"]
    if how == "missing config.json":
        config.unlink()
        return FileNotFoundError, ["config.json", "is missing", "*.safetensors"]
    if how == "config.json not JSON":
        config.write_text("{ not json")
        return (ValueError, OSError), ["config.json"]
    if how == "unsupported architecture":
        data = json.loads(config.read_text())
        data["architectures"] = ["GPT2LMHeadModel"]
        config.write_text(json.dumps(data))
        return ValueError, ["architectures=['gpt2lmheadmodel']", "not supported", "llamaforcausallm"]
    if how == "no safetensors, only a pickle":
        weights.rename(folder / "pytorch_model.bin")
        return FileNotFoundError, ["no *.safetensors", "pytorch_model.bin", "convert them to safetensors"]
    if how == "missing tensor":
        rewrite_tensors(folder, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
        return ValueError, ["missing tensors", "gate_up_proj", "config.json"]
    if how == "extra tensor":
        rewrite_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.rogue.weight": torch.zeros(2)}))
        return ValueError, ["model.safetensors", "unexpected tensor", "rogue"]
    if how == "wrong shape":
        rewrite_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64)}))
        return ValueError, ["model.safetensors", "k_proj.weight", "(3, 64)"]
    if how == "truncated safetensors":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        return ValueError, ["model.safetensors", "not a readable safetensors file", "re-download"]
    if how == "corrupt safetensors header":
        data = bytearray(weights.read_bytes())
        data[:8] = b"\xff" * 8  # the header length
        weights.write_bytes(bytes(data))
        return ValueError, ["model.safetensors", "not a readable safetensors file", "re-download"]
    if how == "garbage safetensors":
        weights.write_bytes(b"\x00" * 64)
        return ValueError, ["model.safetensors", "safetensors", "re-download"]
    raise AssertionError(how)


MODEL_CASES = ["missing folder", "a file, not a folder", "missing config.json", "config.json not JSON",
               "unsupported architecture", "no safetensors, only a pickle", "missing tensor", "extra tensor",
               "wrong shape", "truncated safetensors", "corrupt safetensors header", "garbage safetensors"]


@pytest.mark.parametrize("how", MODEL_CASES)
def test_bad_model_folder(tiny_llama, tmp_path, how):
    folder = copy_model(tiny_llama, tmp_path)
    error_type, words = break_folder(folder, how)
    with pytest.raises(error_type) as error:
        LLM(str(folder), **SMALL)
    assert_names(error, *words)


def test_a_fresh_llm_works_after_model_errors(tiny_llama, llm):
    test_a_fresh_llm_works_after_setting_errors(tiny_llama, llm)


# ------------------------------------------------------------------------- engine calls
def test_duplicate_request_id(llm):
    engine = llm.engine
    engine.add_request("dup", GOOD_PROMPT, GREEDY)
    with pytest.raises(ValueError) as error:
        engine.add_request("dup", {"prompt_token_ids": [7, 8, 9]}, GREEDY)
    assert_names(error, "request_id='dup'", "already in use", "unique id")
    engine.check_invariants()
    outputs = drain(engine)
    assert list(outputs) == ["dup"] and outputs["dup"].outputs[0].token_ids == llm.expected
    # Finished: the id is free again.
    engine.add_request("dup", GOOD_PROMPT, GREEDY)
    assert drain(engine)["dup"].outputs[0].token_ids == llm.expected
    assert_serves(llm)


def test_request_id_clashing_with_a_sample_of_an_n_request(llm):
    """``n=2`` request "7" runs as samples "0_7" and "1_7": those ids are taken too."""
    engine = llm.engine
    engine.add_request("7", GOOD_PROMPT, SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True))
    with pytest.raises(ValueError) as error:
        engine.add_request("0_7", GOOD_PROMPT, GREEDY)
    assert_names(error, "request_id='0_7'", "already in use")
    with pytest.raises(ValueError):  # its samples would be "0_1_7" and "1_1_7"... and "1_7" itself
        engine.add_request("1_7", GOOD_PROMPT, GREEDY)
    engine.check_invariants()
    outputs = drain(engine)
    assert [c.token_ids for c in outputs["7"].outputs] == [llm.expected] * 2
    assert_serves(llm)


@pytest.mark.parametrize("request_id", [7, None, ""])
def test_request_id_not_a_string(llm, request_id):
    with pytest.raises(TypeError) as error:
        llm.engine.add_request(request_id, GOOD_PROMPT, GREEDY)
    assert_names(error, f"request_id={request_id!r}", "non-empty string")
    assert_serves(llm)


def test_add_request_with_a_dict_for_params(llm):
    with pytest.raises(TypeError) as error:
        llm.engine.add_request("x", GOOD_PROMPT, {"temperature": 0})
    assert_names(error, "sampling_params", "dict")
    assert_serves(llm)


def test_abort_unknown_or_finished_id_is_a_no_op(llm):
    engine = llm.engine
    assert engine.abort_request("never-added") is False
    engine.add_request("done", GOOD_PROMPT, GREEDY)
    drain(engine)
    assert engine.abort_request("done") is False  # it just finished: nothing to do
    engine.add_request("live", GOOD_PROMPT, GREEDY)
    engine.step()
    assert engine.abort_request("live") is True
    assert engine.abort_request("live") is False  # twice: the second is a no-op
    assert_serves(llm)


@pytest.fixture(scope="module")
def recorded_trace(tiny_llama):
    traced = LLM(str(tiny_llama), trace=True, **SMALL)
    traced.generate([GOOD_PROMPT, {"prompt_token_ids": [3, 4, 5]}], GREEDY, use_tqdm=False)
    return traced.trace.to_dict()


def corrupt(trace: dict, how: str):
    """Return (JSON text, words the error must contain)."""
    data = json.loads(json.dumps(trace))
    if how == "cut short":
        text = json.dumps(data)
        return text[: len(text) // 2], ["not valid json", "cut short"]
    if how == "empty file":
        return "", ["not valid json"]
    if how == "a list":
        return "[1, 2]", ["expected a json object", "list"]
    if how == "wrong format":
        data["format"] = "something-else"
        return json.dumps(data), ["'format'", "something-else", "microvllm-trace"]
    if how == "future version":
        data["version"] = 99
        return json.dumps(data), ["version 99", "not supported"]
    if how == "missing field":
        del data["steps"][0]["token_budget"]
        return json.dumps(data), ["trace.steps[0]", "token_budget"]
    if how == "wrong type":
        data["block_size"] = "16"
        return json.dumps(data), ["trace.block_size", "expected int", "'16'"]
    if how == "bool for an int":
        data["num_blocks"] = True
        return json.dumps(data), ["trace.num_blocks", "expected int"]
    if how == "unknown field":
        data["steps"][0]["surprise"] = 1
        return json.dumps(data), ["trace.steps[0]", "unknown field", "surprise"]
    if how == "block id out of range":
        step = next(s for s in data["steps"] if s["block_tables"])
        rid = next(iter(step["block_tables"]))
        step["block_tables"][rid][0][0] = 999
        return json.dumps(data), ["block ids [999]", "outside"]
    if how == "short ref_cnts":
        data["steps"][0]["ref_cnts"] = data["steps"][0]["ref_cnts"][:-1]
        return json.dumps(data), ["ref_cnts", "expected num_blocks"]
    if how == "bad kind":
        data["steps"][0]["scheduled"][0]["kind"] = "verify"
        return json.dumps(data), ["kind 'verify'", "prefill"]
    if how == "steps out of order":
        data["steps"][1]["step"] = data["steps"][0]["step"]
        return json.dumps(data), ["step numbers must increase"]
    raise AssertionError(how)


TRACE_CASES = ["cut short", "empty file", "a list", "wrong format", "future version", "missing field",
               "wrong type", "bool for an int", "unknown field", "block id out of range", "short ref_cnts",
               "bad kind", "steps out of order"]


@pytest.mark.parametrize("how", TRACE_CASES)
def test_corrupt_trace_json(recorded_trace, llm, how):
    assert Trace.from_json(json.dumps(recorded_trace)).to_dict() == recorded_trace  # the intact one loads
    text, words = corrupt(recorded_trace, how)
    with pytest.raises(ValueError) as error:
        Trace.from_json(text)
    assert_names(error, "trace", *words)
    assert_serves(llm)


def drain(engine, max_steps=500):
    """Step until the engine is idle; the final output of every request, by id."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError(f"engine still busy after {max_steps} steps: {engine.scheduler.requests}")
