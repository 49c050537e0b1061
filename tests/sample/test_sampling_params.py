"""SamplingParams: vLLM's defaults, and a clear error for every invalid value."""

import math

import numpy as np
import pytest

from microvllm.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.ignore_eos, p.logprobs, p.skip_special_tokens, p.include_stop_str_in_output) == \
        (False, None, True, False)
    assert not p.greedy


def test_conveniences():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's older "off"
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(seed=np.int64(3), temperature=np.float32(0.5)).seed == 3
    assert SamplingParams(temperature=0.5) == SamplingParams(temperature=0.5)
    assert SamplingParams(temperature=0.5) != SamplingParams(temperature=0.6)
    assert repr(SamplingParams(temperature=0.5, stop="x")).startswith(
        "SamplingParams(n=1, temperature=0.5, top_p=1.0, top_k=0")
    assert "stop=['x']" in repr(SamplingParams(stop="x"))


@pytest.mark.parametrize("kwargs, error, words", [
    ({"max_tokens": 0}, ValueError, ["max_tokens", "0"]),
    ({"max_tokens": -5}, ValueError, ["max_tokens", "-5"]),
    ({"max_tokens": 2.5}, TypeError, ["max_tokens", "2.5"]),
    ({"temperature": -0.1}, ValueError, ["temperature", "-0.1", "greedy"]),
    ({"temperature": math.nan}, ValueError, ["temperature", "nan"]),
    ({"temperature": math.inf}, ValueError, ["temperature", "inf"]),
    ({"temperature": "hot"}, TypeError, ["temperature", "'hot'"]),
    ({"top_p": 0.0}, ValueError, ["top_p", "0.0", "(0, 1]"]),
    ({"top_p": 1.5}, ValueError, ["top_p", "1.5"]),
    ({"top_p": math.nan}, ValueError, ["top_p", "nan"]),
    ({"top_k": -2}, ValueError, ["top_k", "-2"]),
    ({"top_k": 2.0}, TypeError, ["top_k", "2.0"]),
    ({"min_p": -0.1}, ValueError, ["min_p", "-0.1"]),
    ({"min_p": 1.1}, ValueError, ["min_p", "1.1"]),
    ({"n": 0}, ValueError, ["n must be", "0"]),
    ({"min_tokens": 20, "max_tokens": 10}, ValueError, ["min_tokens=20", "max_tokens=10"]),
    ({"min_tokens": -1}, ValueError, ["min_tokens", "-1"]),
    ({"seed": True}, TypeError, ["seed", "True", "bool"]),
    ({"seed": 1.0}, TypeError, ["seed", "1.0"]),
    ({"seed": "42"}, TypeError, ["seed", "'42'"]),
    ({"seed": 2**70}, ValueError, ["seed", "64 bits"]),
    ({"stop": ""}, ValueError, ["stop", "empty string"]),
    ({"stop": ["ok", ""]}, ValueError, ["stop", "empty string"]),
    ({"stop": ["ok", 3]}, TypeError, ["stop", "3"]),
    ({"stop": 3}, TypeError, ["stop", "3"]),
    ({"stop_token_ids": [5, -1]}, ValueError, ["stop_token_ids", "-1"]),
    ({"stop_token_ids": [5, "x"]}, TypeError, ["stop_token_ids", "'x'"]),
    ({"logprobs": -1}, ValueError, ["logprobs", "-1"]),
    ({"logprobs": True}, TypeError, ["logprobs", "True"]),
])
def test_invalid_values(kwargs, error, words):
    with pytest.raises(error) as info:
        SamplingParams(**kwargs)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_unknown_argument_suggests_the_right_one():
    with pytest.raises(TypeError) as info:
        SamplingParams(temprature=0.5)
    message = str(info.value)
    assert "'temprature'" in message and "did you mean 'temperature'" in message
    assert "max_tokens" in message  # lists the valid ones


def test_unsupported_vllm_option_is_named():
    with pytest.raises(TypeError, match="'logits_processors'.*vLLM option.*not implement"):
        SamplingParams(logits_processors=[print])


@pytest.mark.parametrize("kwargs, words", [
    ({"presence_penalty": 2.5}, ["presence_penalty", "[-2, 2]", "2.5"]),
    ({"frequency_penalty": -3}, ["frequency_penalty", "[-2, 2]"]),
    ({"frequency_penalty": math.nan}, ["frequency_penalty", "nan"]),
    ({"repetition_penalty": 0.0}, ["repetition_penalty", "> 0", "1.0 to turn it off"]),
    ({"repetition_penalty": math.inf}, ["repetition_penalty", "finite"]),
    ({"prompt_logprobs": -1}, ["prompt_logprobs", ">= 0"]),
])
def test_penalty_and_prompt_logprobs_ranges(kwargs, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_penalties_are_vllm_fields():
    p = SamplingParams(presence_penalty=0.2, frequency_penalty=-0.1, repetition_penalty=1.3,
                       prompt_logprobs=2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.prompt_logprobs) == \
        (0.2, -0.1, 1.3, 2)
    assert p.has_penalties and not SamplingParams().has_penalties
    assert p.clone(n=2).repetition_penalty == 1.3


def test_only_n_may_be_positional():
    assert SamplingParams(3).n == 3  # as in vLLM scripts: SamplingParams(n, temperature=...)
    with pytest.raises(TypeError):
        SamplingParams(1, 0.5)


def test_slots_catch_typos_after_construction():
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temprature = 0.5
