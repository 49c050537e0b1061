"""The server under hostile and agent-style traffic (issue: no request can stop the
engine, nothing silently ignored). A real uvicorn server on 127.0.0.1 runs in this
process over a tiny random Llama, so that one request's sampling can be made to fail
(its temperature, 0.777, marks it); every shape a client may send gets a 4xx with a
message or is served, never a 5xx, and the engine keeps serving throughout.
"""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

from microvllm import LLM, SamplingParams
from microvllm.engine.async_llm import AsyncLLM
from microvllm.entrypoints.openai.api_server import build_app
from microvllm.executor.multiproc_executor import WorkerError
from microvllm.models.tiny import make_tiny_model
from tests.support import ThreadServer, assert_400, healthy_and_serving

SETTINGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
MARK = 0.777        # a request with this temperature fails in its first sampling step
LATE_MARK = 0.778   # ... with this one, in its third
API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("hostile") / "llama", "llama", seed=7))


@pytest.fixture(scope="module")
def engine(folder):
    llm = AsyncLLM(folder, **SETTINGS)
    sampler = llm.engine.executor.worker.model_runner.sampler
    real = sampler.forward

    late_calls = [0]

    def faulty(logits, metadata):   # the injected fault: one request's sampling raises
        if (metadata.temperature == MARK).any():
            raise RuntimeError("injected fault in sampling")
        if (metadata.temperature == LATE_MARK).any():
            late_calls[0] += 1
            if late_calls[0] % 3 == 0:
                raise RuntimeError("injected fault in sampling, midway")
        return real(logits, metadata)

    sampler.forward = faulty
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    srv = ThreadServer(build_app(engine, "tiny"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(engine, server):
    srv = ThreadServer(build_app(engine, "tiny", api_key=API_KEY))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trusting(engine, server):
    """The same engine served with --trust-request-chat-template: a request's template renders."""
    srv = ThreadServer(build_app(engine, "tiny", trust_request_chat_template=True))
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client
    srv.stop()


@pytest.fixture(scope="module")
def reference(folder):
    return LLM(folder, **SETTINGS)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


VOCAB = 512
CHAT = [{"role": "user", "content": "hi"}]

# ------------------------------------------------------------ item 1: the door
ENGINE_KILLERS = [
    ("/v1/completions", {"prompt": "hi", "logprobs": VOCAB + 5}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": VOCAB + 5}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 3, "stop_token_ids": [VOCAB + 10]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(VOCAB + 1): 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": [1, 2, VOCAB]}, "prompt_token_ids"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": VOCAB}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, "maximum context length"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 1000}, "maximum context length"),
]


@pytest.mark.parametrize("path, body, field", ENGINE_KILLERS)
def test_a_value_the_engine_cannot_honour_is_a_400_naming_it(http, path, body, field):
    assert_400(http.post(path, json={"model": "tiny", **body}), field)
    healthy_and_serving(http)


# ------------------------------------------------- item 2: nothing ignored
TOOLS = [{"type": "function", "function": {"name": "multiply", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}]
REFUSED = [
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS}, "tool_choice='auto'"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "auto"}, "tool_choice='auto'"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "needs tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "divide"}}}, "divide"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "exactly one"),
    ("/v1/chat/completions", {"messages": CHAT, "structured_outputs": {"regexp": "a+"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": {"type": "object", "properties": 5}}},
     "structured_outputs.json"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a+", "guided_choice": ["a"]}, "one constraint"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize("path, body, field", REFUSED)
def test_a_feature_microvllm_lacks_is_refused_by_name(http, path, body, field):
    assert_400(http.post(path, json=body), field)
    healthy_and_serving(http)


def test_off_values_of_refused_fields_are_accepted(http):
    body = {"messages": CHAT, "max_tokens": 2, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def completion(http, **body):
    response = http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_logit_bias_allowed_token_ids_bad_words_are_honoured(http, reference):
    def tokens(body):
        return completion(http, logprobs=0, **body)["choices"][0]["logprobs"]["tokens"]

    tokenizer = reference.get_tokenizer()
    five = tokenizer.decode([5])
    assert tokens({"logit_bias": {"5": 100}}) == [five] * 8
    allowed = {tokenizer.decode([t]) for t in (7, 9, 11)}
    assert set(tokens({"allowed_token_ids": [7, 9, 11]})) <= allowed
    plain = completion(http)["choices"][0]["text"]
    expected = reference.generate("hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                bad_words=[plain[:3]]), use_tqdm=False)
    assert completion(http, bad_words=[plain[:3]])["choices"][0]["text"] == expected[0].outputs[0].text


def test_prompt_logprobs_and_truncate_prompt_tokens_are_honoured(http, reference):
    body = completion(http, prompt_logprobs=2, truncate_prompt_tokens=2)
    assert body["usage"]["prompt_tokens"] == 2
    rows = body["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == 2 and 2 <= len(rows[1]) <= 3


def test_echo_with_max_tokens_0_scores_the_prompt(http, reference):
    """What lm-eval's loglikelihood requests send: the prompt's own logprobs, nothing new."""
    prompt = "the cat sat on the mat"
    body = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                              "logprobs": 1, "temperature": 0}).json()
    choice = body["choices"][0]
    ids = reference.get_tokenizer().encode(prompt)
    want = reference.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    logprobs = choice["logprobs"]
    assert choice["text"] == prompt and body["usage"]["completion_tokens"] == 0
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    for position in range(1, len(ids)):
        assert logprobs["token_logprobs"][position] == pytest.approx(
            want.prompt_logprobs[position][ids[position]].logprob, abs=1e-5)
    # text_offset: where each token starts in the choice's text.
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(ids))]


def test_echo_with_generation_offsets_cover_prompt_and_completion(http):
    choice = completion(http, echo=True, logprobs=0)["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == len(logprobs["token_logprobs"])
    assert logprobs["token_logprobs"][0] is None and all(v is not None for v in logprobs["token_logprobs"][1:])
    assert choice["text"].startswith("hello there")


# ------------------------------------------------ item 3: agent histories
TOOL_HISTORY = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What is 6 times 7?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": "{\"a\": 6, \"b\": 7}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
]


def test_a_langchain_style_tool_history_is_rendered(http):
    response = http.post("/v1/chat/completions", json={"messages": TOOL_HISTORY, "max_tokens": 4})
    assert response.status_code == 200, response.text
    tokens = http.post("/tokenize", json={"messages": TOOL_HISTORY}).json()
    assert tokens["count"] == response.json()["usage"]["prompt_tokens"]
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "42" in text and "What is 6 times 7?" in text


@pytest.mark.parametrize("messages, words", [
    ([{"role": "user", "content": None}], ["messages[0].content", "null"]),
    ([{"role": "user", "content": [{"type": "text"}]}], ["messages[0].content[0]", "text"]),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ["image_url"]),
    ([{"role": "wizard", "content": "hi"}], ["messages[0].role"]),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     ["arguments", "JSON"]),
    ([], ["at least one message"]),
])
def test_a_malformed_history_is_a_400_saying_what_to_change(http, messages, words):
    assert_400(http.post("/v1/chat/completions", json={"messages": messages}), None, *words)
    healthy_and_serving(http)


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m.content ", ["chat_template", "Jinja"]),
    ("{{ messages[5].content }}", ["messages"]),
    ("{{ raise_exception('no') }}", ["messages"]),
])
def test_a_broken_chat_template_is_a_400(http, trusting, template, words):
    assert_400(trusting.post("/v1/chat/completions", json={"messages": CHAT, "chat_template": template}),
               None, *words)
    healthy_and_serving(http)


# -------------------------------------------------- item 4: limits, sizes
def test_a_huge_prompt_is_refused_by_its_length_before_tokenizing(http):
    response = http.post("/v1/completions", json={"prompt": "word " * 800_000, "max_tokens": 2})   # 4 MB
    assert_400(response, None, "characters", "max_model_len")
    healthy_and_serving(http)


# ----------------------------------------- defence in depth: a step fault
def test_a_fault_in_one_requests_step_fails_only_it(http, server, reference):
    prompts = ["the engine", "a block table", "hello world and the scheduler"]
    greedy = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    results = {}

    def send(name, body):
        with httpx.Client(base_url=server.url, timeout=60) as client:
            results[name] = client.post("/v1/completions", json=body)

    threads = [threading.Thread(target=send, args=(p, {"prompt": p, **greedy})) for p in prompts]
    threads.append(threading.Thread(target=send, args=("bad", {"prompt": "boom", "max_tokens": 10,
                                                               "temperature": MARK})))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    bad = results["bad"]
    assert bad.status_code == 500 and "injected fault in sampling" in bad.json()["error"]["message"]
    for p in prompts:
        want = reference.generate(p, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].text
        assert results[p].status_code == 200 and results[p].json()["choices"][0]["text"] == want
    healthy_and_serving(http)


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True, "temperature": LATE_MARK,
                                                      "max_tokens": 10, "ignore_eos": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert len(events) >= 3 and "choices" in json.loads(events[0])   # tokens came first
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "midway" in error["message"]
    healthy_and_serving(http)


def test_a_500_does_not_break_the_next_requests_on_the_same_connection(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(4):
            assert client.post("/v1/completions", json={"prompt": "x", "temperature": MARK}).status_code == 500
            for _ in range(2):
                assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------ item 6: the surface
def test_errors_are_openai_shaped_everywhere(http):
    for response, status in [(http.get("/v1/completions"), 405), (http.get("/no/such/route"), 404),
                             (http.post("/v1/completions", content=b"{nope",
                                        headers={"content-type": "application/json"}), 400),
                             (http.get("/v1/models/other"), 404)]:
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status


def test_the_small_routes(http):
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    assert http.get("/version").json()["version"]
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    tokens = http.post("/tokenize", json={"prompt": "hello there"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "hello there"
    assert_400(http.post("/detokenize", json={"tokens": [VOCAB]}), "tokens")


def test_api_key_is_required_on_v1_routes(keyed):
    with httpx.Client(base_url=keyed.url, timeout=60) as client:
        body = {"prompt": "hi", "max_tokens": 2}
        denied = client.post("/v1/completions", json=body)
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "AuthenticationError"
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.post("/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert client.get("/health").status_code == 200   # not a /v1 route


# --------------------------------------------------------------- the fuzz
SCHEMA_FIELDS = {
    "model": ["tiny"], "prompt": ["hi", ["a", "b"], [1, 2, 3], [[1], [2]]], "messages": [CHAT],
    "max_tokens": [1, 4], "temperature": [0, 0.7], "top_p": [0.9], "n": [1, 2], "stop": ["\n", ["a"]],
    "seed": [1], "presence_penalty": [0.5], "frequency_penalty": [0.5], "logprobs": [1, True],
    "top_logprobs": [1], "echo": [True], "stream": [False], "top_k": [5], "min_p": [0.1],
    "min_tokens": [1], "ignore_eos": [True], "repetition_penalty": [1.1], "stop_token_ids": [[3]],
    "logit_bias": [{"3": 1}], "allowed_token_ids": [[1, 2]], "bad_words": [["a"]],
    "prompt_logprobs": [1], "truncate_prompt_tokens": [2], "stream_options": [{"include_usage": True}],
    "chat_template_kwargs": [{}], "add_generation_prompt": [True],
    "structured_outputs": [{"regex": "[a-c]{1,3}"}, {"choice": ["x", "y"]}, {"json": {"type": "boolean"}}],
    "response_format": [{"type": "json_object"}, {"type": "text"}], "guided_choice": [["a", "b"]],
    "tool_choice": ["required", "none", {"type": "function", "function": {"name": "multiply"}}],
    "tools": [TOOLS],
}
NASTY = [None, -1, 0, 10**12, -10**12, 1e308, float("nan"), "", "x" * 50, [], {}, [None], {"a": None},
         True, False, [[[]]], ["\u0000"], 3.5, -0.0]


def random_body(rng: random.Random, chat: bool) -> dict:
    body = {"messages": CHAT} if chat else {"prompt": "hi"}
    body["max_tokens"] = 3
    for name in rng.sample(sorted(SCHEMA_FIELDS), rng.randint(1, 5)):
        body[name] = rng.choice(SCHEMA_FIELDS[name] if rng.random() < 0.7 else NASTY)
    if rng.random() < 0.3:
        body[f"unknown_{rng.randint(0, 9)}"] = rng.choice(NASTY)
    if rng.random() < 0.2:
        body = {k: None for k in body}
    return body


def test_fuzz_random_bodies_never_get_a_5xx(http):
    rng = random.Random(1234)
    statuses = {}
    for i in range(160):
        chat = i % 2 == 1
        body = random_body(rng, chat)
        payload = json.dumps(body, allow_nan=True)
        response = http.post("/v1/chat/completions" if chat else "/v1/completions", content=payload,
                             headers={"content-type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (payload, response.text)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]"), (payload, response.text[-300:])
        elif response.status_code >= 400:
            assert "error" in response.json(), (payload, response.text)
        else:
            assert "choices" in response.json(), (payload, response.text)
        if i % 20 == 0:
            healthy_and_serving(http)
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10, statuses
    healthy_and_serving(http)


# ---------------------------------------------------- a fatal engine error
def test_a_fatal_error_marks_the_engine_dead_and_calls_for_exit(folder):
    llm = AsyncLLM(folder, **SETTINGS)
    died = threading.Event()
    srv = ThreadServer(build_app(llm, "tiny", on_engine_dead=died.set))
    try:
        def dead_worker(plan):
            raise WorkerError("worker 1 died")

        llm.engine.executor.execute_model = dead_worker
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert response.status_code == 503 and response.json()["error"]["type"] == "ServiceUnavailableError"
            assert died.wait(10)
            health = client.get("/health")
            assert health.status_code == 503 and "worker 1 died" in health.text
    finally:
        srv.stop()


def test_an_unexpected_exception_is_a_json_500_and_the_connection_lives_on(engine, server, monkeypatch):
    """A bug on the server's side (here: the tokenizer step raising KeyError for one
    prompt) must answer 500 with OpenAI's shape, and the keep-alive connection must serve
    the next requests (Starlette's own handler re-raises, and uvicorn then drops it)."""
    real = engine.process_prompt

    async def exploding(prompt, params=None):
        if prompt == "explode":
            raise KeyError("a bug")
        return await real(prompt, params)

    monkeypatch.setattr(engine, "process_prompt", exploding)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(3):
            response = client.post("/v1/completions", json={"prompt": "explode", "max_tokens": 2})
            assert response.status_code == 500
            assert response.json()["error"]["type"] == "InternalServerError"
            assert client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2}).status_code == 200
