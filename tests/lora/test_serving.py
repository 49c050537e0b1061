"""LoRA adapters served as vLLM serves them: ``serve --enable-lora --lora-modules name=path``,
each chosen by a request's ``model``, listed by ``/v1/models`` with its parent, loaded and
unloaded at run time (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) while requests run.
Every answer is checked against transformers + peft's greedy tokens."""

from __future__ import annotations

import argparse
import threading

import httpx
import openai
import pytest

from microvllm.engine.async_llm import AsyncLLM
from microvllm.entrypoints.openai.api_server import build_app, run_server
from microvllm.entrypoints.openai.serving_models import LoRAModulePath, parse_lora_modules
from microvllm.tokenizer import Tokenizer
from tests.lora.conftest import hf_peft_greedy
from tests.support import LLM_SETTINGS, ThreadServer, free_port

PROMPT = "The capital of France is"
MAX_TOKENS = 6
LONG = 96   # a stream still running while adapters are loaded and unloaded


@pytest.fixture(scope="module")
def served(lora_models, monkeypatch_module):
    monkeypatch_module.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    folder, loras = lora_models["llama"]
    engine = AsyncLLM(str(folder), enable_lora=True, max_loras=2, max_lora_rank=8, **LLM_SETTINGS)
    server = ThreadServer(build_app(engine, "tiny", lora_modules=[
        LoRAModulePath("sql", loras["sql"].lora_path), LoRAModulePath("poem", loras["poem"].lora_path)]))
    yield server, folder, loras
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    patch = pytest.MonkeyPatch()
    yield patch
    patch.undo()


def expected(folder, adapter_path: str | None, max_tokens: int = MAX_TOKENS) -> str:
    tokenizer = Tokenizer.from_pretrained(folder)
    ids = tuple(tokenizer.encode(PROMPT, add_special_tokens=False))
    return tokenizer.decode(list(hf_peft_greedy(str(folder), adapter_path, ids, max_tokens)))


def complete(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_each_adapter_answers_by_its_name(served):
    server, folder, loras = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    cards = {card.id: card for card in client.models.list().data}
    assert {"tiny", "sql", "poem"} <= set(cards)
    assert cards["sql"].model_extra["parent"] == "tiny" and cards["sql"].root == loras["sql"].lora_path
    assert cards["tiny"].model_extra["parent"] is None
    answers = {name: complete(server.url, name) for name in ("tiny", "sql", "poem")}
    assert answers == {"tiny": expected(folder, None), "sql": expected(folder, loras["sql"].lora_path),
                       "poem": expected(folder, loras["poem"].lora_path)}
    assert len(set(answers.values())) == 3, "the adapters should change the answer"
    missing = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
    assert missing.status_code == 404 and "`sql`" in missing.text


def test_load_and_unload_at_run_time_under_traffic(served):
    server, folder, loras = served
    url = server.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    # A long stream on sql is open while math is loaded and sql unloaded: it finishes with sql.
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "math",
                                                             "lora_path": loras["math"].lora_path}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    unloaded = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    others = [threading.Thread(target=lambda: results.append(complete(url, "math"))) for _ in range(3)]
    results: list[str] = []
    for thread in others:
        thread.start()
    text += "".join(chunk.choices[0].text for chunk in chunks)
    for thread in others:
        thread.join(60)
    assert text == expected(folder, loras["sql"].lora_path, LONG)
    assert results == [expected(folder, loras["math"].lora_path)] * 3
    gone = httpx.post(url + "/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 1})
    assert gone.status_code == 404
    assert "sql" not in {card["id"] for card in httpx.get(url + "/v1/models").json()["data"]}
    # Loaded again under the same name: a new id for the folder (an id always means one folder).
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": loras["sql"].lora_path})
    assert again.status_code == 200 and complete(url, "sql") == expected(folder, loras["sql"].lora_path)


def test_bad_loads_are_refused_with_what_to_change(served, tmp_path):
    server, _, loras = served
    taken = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "poem",
                                                                   "lora_path": loras["poem"].lora_path})
    assert taken.status_code == 400 and "already served" in taken.text
    not_peft = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert not_peft.status_code == 400 and not_peft.json()["error"]["param"] == "lora_path"
    assert "x" not in {card["id"] for card in httpx.get(server.url + "/v1/models").json()["data"]}
    unknown = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "never"})
    assert unknown.status_code == 404


def test_without_the_switch_there_is_no_loading(lora_models, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    folder, _ = lora_models["llama"]
    engine = AsyncLLM(str(folder), enable_lora=True, max_lora_rank=8, **LLM_SETTINGS)
    server = ThreadServer(build_app(engine, "tiny"))
    try:
        response = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
    finally:
        server.stop()
    assert response.status_code == 404


def test_the_flags():
    assert parse_lora_modules(["sql=/a/sql", '{"name": "poem", "path": "/a/poem", "base_model_name": "m"}']) == [
        LoRAModulePath("sql", "/a/sql"), LoRAModulePath("poem", "/a/poem", "m")]
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["sql"])
    from microvllm.cli.serve import add_serve_args

    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["m", "--port", str(free_port()), "--lora-modules", "sql=/a/sql"])
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        run_server(args)   # refused before the model loads
