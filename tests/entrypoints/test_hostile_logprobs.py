"""Logprobs and grammars against a real server on loopback (issue 38, items 3 and 4).

Item 3: with logprobs on, every sampling option (each grammar kind, bad_words,
logit_bias, allowed_token_ids, top-k/p, min-p, temperature, n, prompt_logprobs, echo;
streamed and not) answers 200 with bodies that a strict JSON parser reads (no NaN,
no Infinity); and a grammar's logprobs are the model's raw ones, as every other
constraint's are: equal to the same request's without the grammar wherever the
context is the same.

Item 4: a grammar that can never match is a 400 at the door on both backends; one
that dead-ends later (or whose every allowed token the request's other rules forbid)
fails its request with the reason (a 400, or a stream's last event), never with a
token the grammar forbids, and the server goes on.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from microvllm.engine.async_llm import AsyncLLM
from microvllm.engine.outputs import CompletionOutput, Logprob
from microvllm.entrypoints.openai.api_server import build_app
from microvllm.entrypoints.openai.serving import LOGPROB_FLOOR, _chat_logprobs, _completion_logprobs, sse
from microvllm.models.tiny import make_tiny_model
from tests.support import ThreadServer, assert_400, healthy_and_serving

pytest.importorskip("xgrammar")

SETTINGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
BACKENDS = ("xgrammar", "course")
PROMPT = "the quick brown"
CHAT = [{"role": "user", "content": "the quick brown"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
GRAMMARS = {   # every kind, each allowing few tokens at each step (so the top 5 hold masked ids)
    "regex": {"regex": "[ab]{2,4}"},
    "choice": {"choice": ["yes", "no"]},
    "json": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "grammar": {"grammar": 'root ::= "x" | "y" root'},
}
# Every sampling option that changes what is drawn, with logprobs on.
OPTIONS = {
    "greedy": {"temperature": 0},
    "random": {"temperature": 1.3, "seed": 2},
    "bad_words": {"bad_words": ["a", "the"], "temperature": 0},
    "logit_bias": {"logit_bias": {"5": -100, "6": 100}, "temperature": 0},
    "allowed_token_ids": {"allowed_token_ids": [5, 6, 7], "temperature": 0},
    "top_k": {"top_k": 3, "temperature": 1.0, "seed": 1},
    "top_p": {"top_p": 0.5, "temperature": 1.0, "seed": 1},
    "min_p": {"min_p": 0.3, "temperature": 1.0, "seed": 1},
    "n": {"n": 2, "temperature": 1.0, "seed": 3},
    "prompt_logprobs": {"prompt_logprobs": 3, "temperature": 0},
    **{f"grammar {kind}": {"structured_outputs": spec, "temperature": 0} for kind, spec in GRAMMARS.items()},
    "grammar random n": {"structured_outputs": GRAMMARS["regex"], "temperature": 1.0, "seed": 4, "n": 2},
    "grammar prompt_logprobs": {"structured_outputs": GRAMMARS["choice"], "prompt_logprobs": 2},
    "grammar bad_words": {"structured_outputs": GRAMMARS["regex"], "bad_words": ["a"]},
}
# A regex no text matches (an empty character class); "a" + it: "a" may start, then nothing.
NEVER = {"xgrammar": r"[^\s\S]", "course": "[^\\0-\U0010ffff]"}
DEAD_END = "a[^\\0-\U0010ffff]"


def strict_loads(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity (Python's accepts them)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def strict_body(response: httpx.Response) -> list:
    """Every JSON document of a response: the body, or each SSE event's data."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return [strict_loads(response.text)]
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text[-300:]
    return [strict_loads(event) for event in events[:-1]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("logprobs") / "llama", "llama", seed=7))


@pytest.fixture(scope="module")
def servers(folder):
    """One server per structured-outputs backend, over the same tiny random Llama."""
    engines = {b: AsyncLLM(folder, structured_outputs_backend=b, **SETTINGS) for b in BACKENDS}
    running = {b: ThreadServer(build_app(engine, "tiny")) for b, engine in engines.items()}
    yield running
    for backend in BACKENDS:
        running[backend].stop()
        engines[backend].shutdown()


@pytest.fixture(scope="module")
def http(servers):
    with httpx.Client(base_url=servers["xgrammar"].url, timeout=60) as client:
        yield client


def completion(**fields) -> dict:
    return {"prompt": PROMPT, "max_tokens": 6, "logprobs": 5, **fields}


def chat(**fields) -> dict:
    fields.pop("echo", None)
    return {"messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 5, **fields}


# ------------------------------------------------------------------ item 3
def test_every_sampling_option_with_logprobs_answers_strict_json(http):
    failures = []
    requests = [(f"/v1/completions {name}", "/v1/completions", completion(**option))
                for name, option in OPTIONS.items()]
    requests += [("/v1/completions echo", "/v1/completions", completion(echo=True, temperature=0)),
                 ("/v1/completions grammar echo", "/v1/completions",
                  completion(echo=True, structured_outputs=GRAMMARS["choice"]))]
    requests += [(f"/v1/chat/completions {name}", "/v1/chat/completions", chat(**option))
                 for name, option in OPTIONS.items()]
    requests.append(("/v1/chat/completions response_format", "/v1/chat/completions",
                     chat(response_format={"type": "json_object"})))
    for name, path, body in requests:
        for stream in (False, True):
            response = http.post(path, json={**body, "stream": stream})
            try:
                assert response.status_code == 200, (response.status_code, response.text[:300])
                documents = strict_body(response)
                assert all("error" not in doc for doc in documents), documents
            except (AssertionError, ValueError) as error:
                failures.append(f"{name} stream={stream}: {error}")
    assert not failures, "\n".join(failures)


def first_top(http, path: str, body: dict) -> tuple[list[str], list[dict[str, float]]]:
    """(sampled tokens, top logprobs per position) of a greedy request's first choice."""
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text[:300]
    choice = strict_loads(response.text)["choices"][0]
    if path == "/v1/completions":
        return choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]
    content = choice["logprobs"]["content"]
    return ([c["token"] for c in content],
            [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content])


def assert_same_raw_logprobs(plain, constrained) -> int:
    """Top logprobs equal at each position whose context is the same in both: up to and
    including the first position where the sampled tokens differ. Returns how many.
    ``plain`` is greedy, so its sampled token is among its top ones; the completions
    form also lists the sampled token, which the grammar may change: one more entry."""
    (plain_tokens, plain_top), (tokens, top) = plain, constrained
    compared = 0
    for position in range(min(len(plain_top), len(top))):
        assert plain_top[position].keys() <= top[position].keys(), (position, plain_top[position], top[position])
        for token, logprob in plain_top[position].items():
            assert math.isclose(logprob, top[position][token], abs_tol=1e-4), (position, token)
        compared += 1
        if plain_tokens[position] != tokens[position]:
            break
    return compared


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_a_grammar_returns_the_models_raw_logprobs(http, path, kind):
    make = completion if path == "/v1/completions" else chat
    plain = first_top(http, path, make(temperature=0))
    constrained = first_top(http, path, make(temperature=0, structured_outputs=GRAMMARS[kind]))
    assert assert_same_raw_logprobs(plain, constrained) >= 1


def test_a_grammar_that_follows_the_greedy_text_keeps_every_logprob(http):
    """A choice of the unconstrained greedy text itself (its whole-character tokens): greedy
    takes the same tokens under the grammar, so each of them has the same context, the
    same raw logprobs."""
    plain = first_top(http, "/v1/completions", completion(temperature=0))
    # The tokens before the first that is not whole text (a piece of a character).
    clean = next((i for i, token in enumerate(plain[0]) if "\ufffd" in token), len(plain[0]))
    assert clean >= 2, plain[0]
    constrained = first_top(http, "/v1/completions", completion(
        temperature=0, structured_outputs={"choice": ["".join(plain[0][:clean]), "zzz"]}))
    assert constrained[0][:clean] == plain[0][:clean]
    assert assert_same_raw_logprobs(plain, constrained) >= clean


def test_a_non_finite_logprob_is_written_as_vllms_floor_and_never_as_nan():
    """Raw logprobs are finite for finite logits; a model that gives -inf or NaN still
    gets JSON: -9999.0 (vLLM's floor). And any other non-finite float raises rather
    than being written as NaN or Infinity."""
    row = {5: Logprob(float("-inf"), 2, "a"), 6: Logprob(float("nan"), 1, "b")}
    c = CompletionOutput(0, text="a", token_ids=[5], logprobs=[row])
    chat_form = json.loads(json.dumps(_chat_logprobs(c, 0, 2), allow_nan=False))
    assert [e["logprob"] for e in chat_form["content"][0]["top_logprobs"]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
    completion_form = _completion_logprobs(c, 0)
    assert completion_form["token_logprobs"] == [LOGPROB_FLOOR]
    assert set(completion_form["top_logprobs"][0].values()) == {LOGPROB_FLOOR}
    with pytest.raises(ValueError):
        sse({"value": float("inf")})


# ------------------------------------------------------------------ item 4
@pytest.mark.parametrize("backend, pattern", [("xgrammar", NEVER["xgrammar"]), ("course", NEVER["course"])])
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_can_never_match_is_a_400(servers, backend, pattern, stream):
    with httpx.Client(base_url=servers[backend].url, timeout=60) as client:
        for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", chat())):
            response = client.post(path, json={**body, "stream": stream, "structured_outputs": {"regex": pattern}})
            assert_400(response, "structured_outputs", "can never be matched")
        healthy_and_serving(client)


# xgrammar allows the dead end's "a", then nothing. A course backend whose DFA knows which
# states can still reach a match refuses the "a" too: a 400 at the door, also fine.
DEAD_END_REASONS = ("allows no token after 1 generated token,", "can never be matched")


@pytest.mark.parametrize("backend, fields, reasons", [
    *[(backend, {"structured_outputs": {"regex": DEAD_END}}, DEAD_END_REASONS) for backend in BACKENDS],
    *[(backend, {"structured_outputs": {"regex": "a+"}, "allowed_token_ids": [68]},   # 68: "b"
       ("forbidden by the request's other rules",)) for backend in BACKENDS]])
def test_a_grammar_that_dead_ends_later_is_a_400_with_the_reason(servers, backend, fields, reasons):
    with httpx.Client(base_url=servers[backend].url, timeout=60) as client:
        body = completion(**fields, temperature=0)
        # The request's own fault, found midway: a 400 (vLLM: finish_reason "error", a 500).
        response = client.post("/v1/completions", json=body)
        assert_400(response, "structured_outputs")
        assert any(reason in response.json()["error"]["message"] for reason in reasons), response.text
        # Streamed: a 400 as well when it fails before its first token, else the stream
        # ends with an error event that says so.
        streamed = client.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code in (200, 400), streamed.text
        documents = strict_body(streamed)
        error = documents[-1]["error"]
        assert error["code"] == 400 and any(reason in error["message"] for reason in reasons), documents
        text = "".join(c["text"] for doc in documents[:-1] for c in doc["choices"])
        assert text in ("", "a"), text   # never a token the grammar forbids
        healthy_and_serving(client)
