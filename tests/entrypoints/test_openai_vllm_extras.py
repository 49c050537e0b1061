"""vLLM's smaller OpenAI-server behaviours, on a tiny random Llama served in this process:
``prompt_logprobs: 0`` is on (each prompt token's own logprob), ``stream_options``'
``continuous_usage_stats`` puts the usage so far in every chunk, and
``--enable-tokenizer-info-endpoint`` serves ``GET /tokenizer_info`` (a 404 without it)."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from microvllm.cli.main import build_parser
from microvllm.engine.async_llm import AsyncLLM
from microvllm.entrypoints.openai.api_server import build_app
from microvllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from microvllm.models.tiny import make_tiny_model
from tests.support import ThreadServer

SETTINGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
PROMPT = "the quick brown fox"
CHAT = [{"role": "user", "content": "the quick brown fox"}]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("extras") / "llama", "llama", seed=7)
    engine = AsyncLLM(str(folder), **SETTINGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def http(engine):
    server = ThreadServer(build_app(engine, "tiny", enable_tokenizer_info_endpoint=True))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
    server.stop()


def events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text[:300]
    data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


# ------------------------------------------------------- prompt_logprobs: 0
def test_prompt_logprobs_zero_reaches_the_sampling_params():
    assert CompletionRequest(prompt="hi", prompt_logprobs=0).to_sampling_params().prompt_logprobs == 0
    assert ChatCompletionRequest(messages=CHAT, prompt_logprobs=0).to_sampling_params().prompt_logprobs == 0


def test_prompt_logprobs_zero_returns_each_prompt_tokens_own_logprob(http):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    zero = http.post("/v1/completions", json={**body, "prompt_logprobs": 0}).json()
    three = http.post("/v1/completions", json={**body, "prompt_logprobs": 3}).json()
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    rows = zero["choices"][0]["prompt_logprobs"]
    assert rows is not None and len(rows) == len(prompt_ids) == zero["usage"]["prompt_tokens"]
    assert rows[0] is None   # nothing predicts the first prompt token (vLLM's None too)
    for token_id, row, wider in zip(prompt_ids[1:], rows[1:], three["choices"][0]["prompt_logprobs"][1:]):
        assert list(row) == [str(token_id)], "0: the prompt token alone, no alternatives"
        assert row[str(token_id)]["logprob"] == pytest.approx(wider[str(token_id)]["logprob"], abs=1e-5)
        assert len(wider) >= 3
    off = http.post("/v1/completions", json=body).json()
    assert off["choices"][0]["prompt_logprobs"] is None


def test_chat_prompt_logprobs_zero_is_on(http):
    reply = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}).json()
    rows = reply["prompt_logprobs"]
    assert len(rows) == reply["usage"]["prompt_tokens"] and rows[0] is None
    assert all(len(row) == 1 for row in rows[1:])
    assert "prompt_logprobs" not in http.post("/v1/chat/completions",
                                              json={"messages": CHAT, "max_tokens": 2}).json()


# ------------------------------------------- stream_options.continuous_usage_stats
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def check_running_usage(chunks: list[dict], prompt_tokens: int, max_tokens: int, first_completion: int) -> None:
    """Every chunk but the last carries the usage so far; the last is the usage chunk."""
    *streamed, final = chunks
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": max_tokens, "total_tokens": prompt_tokens + max_tokens}
    counts = []
    for chunk in streamed:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        counts.append(usage["completion_tokens"])
    assert counts[0] == first_completion and counts == sorted(counts) and counts[-1] == max_tokens


def test_completion_stream_sends_usage_in_every_chunk(http):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = events(http.post("/v1/completions", json={**body, "stream_options": CONTINUOUS}))
    prompt_tokens = len(http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    check_running_usage(chunks, prompt_tokens, 6, first_completion=1)
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == http.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]["text"]
    # include_usage alone: only the last chunk; continuous_usage_stats alone: none (as vLLM)
    plain = events(http.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}}))
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 6
    alone = events(http.post("/v1/completions", json={**body, "stream_options": {"continuous_usage_stats": True}}))
    assert all(c.get("usage") is None for c in alone)


def test_chat_stream_sends_usage_in_every_chunk(http):
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = events(http.post("/v1/chat/completions", json={**body, "stream_options": CONTINUOUS}))
    prompt_tokens = http.post("/v1/chat/completions", json={**body, "stream": False}).json()["usage"]["prompt_tokens"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    check_running_usage(chunks, prompt_tokens, 5, first_completion=0)   # the role chunk: nothing generated yet
    plain = events(http.post("/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}))
    assert all(c.get("usage") is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 5


# ------------------------------------------------------------ /tokenizer_info
def test_tokenizer_info_is_served_when_enabled(http, engine):
    response = http.get("/tokenizer_info")
    assert response.status_code == 200, response.text
    info = response.json()
    hf = engine.tokenizer.hf_tokenizer
    assert info["tokenizer_class"] == type(hf).__name__
    assert info["eos_token"] == hf.eos_token   # special tokens as their text
    assert not {"vocab_file", "merges_file", "name_or_path"} & set(info), "no paths of the server"


def test_tokenizer_info_is_a_404_unless_enabled(engine):
    off = TestClient(build_app(engine, "tiny")).get("/tokenizer_info")   # no lifespan: the engine stays up
    assert off.status_code == 404 and off.json()["error"]["code"] == 404
    on = TestClient(build_app(engine, "tiny", chat_template=TEMPLATE, enable_tokenizer_info_endpoint=True))
    assert on.get("/tokenizer_info").json()["chat_template"] == TEMPLATE   # the server's --chat-template


def test_serve_takes_the_tokenizer_info_flag():
    parser = build_parser()
    assert parser.parse_args(["serve"]).enable_tokenizer_info_endpoint is False
    assert parser.parse_args(["serve", "--enable-tokenizer-info-endpoint"]).enable_tokenizer_info_endpoint is True


# ------------------------------------------------------- /reset_prefix_cache (VLLM_SERVER_DEV_MODE)
def test_reset_prefix_cache_is_a_development_endpoint_only(engine, monkeypatch):
    """Off by default (any client could empty every user's cache: a 404); with
    VLLM_SERVER_DEV_MODE=1 a test that shares a server can start cold: the next identical
    prompt has no prefix hit."""
    # (no lifespan: its end would shut down the module's engine)
    assert TestClient(build_app(engine, "tiny")).post("/reset_prefix_cache").status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    client = TestClient(build_app(engine, "tiny"))
    body = {"prompt": PROMPT * 8, "max_tokens": 1, "temperature": 0}
    assert client.post("/v1/completions", json=body).status_code == 200
    hits = engine.engine.prefix_cache_hits
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.engine.prefix_cache_hits > hits                   # cached: a hit
    assert client.post("/reset_prefix_cache").status_code == 200
    hits = engine.engine.prefix_cache_hits
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.engine.prefix_cache_hits == hits                  # forgotten: no hit
