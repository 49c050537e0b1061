"""The agent surfaces under attack (issue 66, items 1, 3 and 7): what a request may ask the
server to render, compile or send to the core, tried on real ``microvllm serve`` processes.

Two servers over one tiny random Llama (tool tokens in its vocabulary, hermes tool calls):
``plain`` as an operator starts one (request templates refused), and ``trusting`` with
``--trust-request-chat-template`` and a 3 s render limit, so that a template's bounds can be
reached quickly. After every attack the server must answer a 4xx saying what to change,
keep its memory (the front end's peak RSS, read from /proc) and go on serving.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from microvllm.bench.hostile import ref_chain
from microvllm.models.tiny import make_tiny_model
from tests.support import SETTINGS, Server, assert_400, healthy_and_serving, wait_for

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "hi"}]
RENDER_TIMEOUT = 3.0
# A template that writes the tools into the prompt as JSON (as Qwen's does).
RENDERS_TOOLS = ("{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
                 "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("agent-attacks") / "llama", "llama", seed=5,
                           added_tokens=("<tool_call>", "</tool_call>"))


@pytest.fixture(scope="module")
def servers(folder, tmp_path_factory):
    """Both servers, started side by side (each loads its model while the other does)."""
    logs = tmp_path_factory.mktemp("agent-attacks-log")
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", RENDERS_TOOLS]
    plain = Server(folder, logs / "plain.log", [*SETTINGS, *tools])
    trusting = Server(folder, logs / "trusting.log", [*SETTINGS, *tools, "--trust-request-chat-template"],
                      env={"VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT": str(RENDER_TIMEOUT)})
    try:
        for server in (plain, trusting):
            wait_for(server.healthy, 180, f"{server.log_path.name}'s /health")
        yield {"plain": plain, "trusting": trusting}
    finally:
        plain.stop()
        trusting.stop()


@pytest.fixture(scope="module")
def plain(servers):
    with httpx.Client(base_url=servers["plain"].url, timeout=120) as client:
        client.server = servers["plain"]
        yield client


@pytest.fixture(scope="module")
def trusting(servers):
    with httpx.Client(base_url=servers["trusting"].url, timeout=120) as client:
        client.server = servers["trusting"]
        yield client


def peak_rss_mb(server) -> float:
    """The front end's peak resident memory so far (VmHWM), in MB."""
    for line in open(f"/proc/{server.process.pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def chat(http, **body):
    return http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "temperature": 0, **body})


# ------------------------------------------------- item 1: the request's template
@pytest.mark.parametrize("where", ["chat_template", "chat_template_kwargs"])
def test_a_request_template_is_refused_unless_the_server_trusts_them(plain, where):
    attack = '{{ "a" * 300000000 }}'   # 27 bytes; rendered and tokenized, it once took the server down
    body = ({"chat_template": attack} if where == "chat_template"
            else {"chat_template_kwargs": {"chat_template": attack}})
    before = peak_rss_mb(plain.server)
    assert_400(chat(plain, **body), "chat_template", "--trust-request-chat-template")
    assert peak_rss_mb(plain.server) - before < 100
    healthy_and_serving(plain)


def test_a_trusted_template_renders_and_is_used(trusting):
    response = chat(trusting, chat_template="{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:",
                    max_tokens=1)
    assert response.status_code == 200, response.text
    tokenized = trusting.post("/tokenize", json={"prompt": "Q: hi\nA:", "add_special_tokens": False}).json()
    assert response.json()["usage"]["prompt_tokens"] == tokenized["count"]


@pytest.mark.parametrize("template", [
    '{{ "a" * 300000000 }}',                  # 300 MB of text: longer than the context can hold
    '{{ "a" * 20000000000 }}',                # 20 GB: past the render's memory limit
    '{{ "a" | center(3000000000) }}',         # a filter, not an operator: the sandbox bounds neither
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",   # 10^10 iterations
])
def test_a_trusted_template_is_bounded_in_memory_and_time(trusting, template):
    """Which bound refuses a template first (its length, its memory, its time) depends on the
    machine's speed; that one does, with a 400 naming it, does not."""
    before = peak_rss_mb(trusting.server)
    started = time.monotonic()
    response = chat(trusting, chat_template=template)
    assert_400(response, "chat_template")
    message = response.json()["error"]["message"]
    assert any(bound in message for bound in ("characters", "MB", "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT")), message
    assert time.monotonic() - started < RENDER_TIMEOUT + 30   # the render's own limit, not the machine's speed
    assert peak_rss_mb(trusting.server) - before < 100        # the child's memory is never the server's
    healthy_and_serving(trusting)


# ------------------------------------------------- item 3: tools at the door
def many_tools(count: int, description_chars: int, parameters: int) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "d" * description_chars,
        "parameters": {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(parameters)}}}}
        for i in range(count)]


@pytest.mark.parametrize("tool_choice, strict", [("auto", False), ("auto", True), ("required", False)])
def test_a_request_with_thousands_of_tools_is_refused_before_anything_renders_or_compiles(plain, tool_choice, strict):
    tools = many_tools(5000, 1500, 20)   # about 10 MB, under the 32 MiB body limit
    for tool in tools:
        tool["function"]["strict"] = strict
    before = peak_rss_mb(plain.server)
    response = chat(plain, tools=tools, tool_choice=tool_choice)
    assert_400(response, None, "tools")
    assert peak_rss_mb(plain.server) - before < 300   # the body itself is parsed: ~10 MB of JSON, as objects
    healthy_and_serving(plain)


def test_a_strict_tool_nested_too_deep_is_refused_before_compiling(plain):
    """Flat as JSON (the door's nesting check passes it), 300 levels deep through $refs: each
    strict tool's schema in the structural tag is measured as a response_format's is."""
    tools = [{"type": "function", "function": {"name": "shallow", "strict": True, "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "deep", "strict": True, "parameters": ref_chain(300)}}]
    assert_400(chat(plain, tools=tools), "structured_outputs.structural_tag", "levels deep")
    healthy_and_serving(plain)


def test_tools_that_fit_still_work(plain):
    tools = many_tools(3, 40, 2)
    response = chat(plain, tools=tools, tool_choice="required", max_tokens=40)
    assert response.status_code == 200, response.text


# ------------------------------------------------- item 7: integers past 64 bits
@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", {"prompt": "hi", "top_k": 10**30}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 10**30}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 10**30]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**30}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "structured_outputs": {"json": {"type": "integer",
                                                                               "maximum": 10**30}}},
     "structured_outputs"),
])
def test_an_integer_past_64_bits_is_a_400_naming_the_field(plain, route, body, field):
    response = plain.post(route, content=json.dumps({"max_tokens": 2, **body}),
                          headers={"content-type": "application/json"})
    assert_400(response, field, "64-bit")
    assert response.json()["error"]["param"] == field
    healthy_and_serving(plain)
