"""``microvllm serve``, for real: one server process per module on 127.0.0.1 (a tiny
random Llama), talked to with the ``openai`` client, httpx and ``bench serve``.

Every wait is a poll against a deadline; the last test stops a second server (longer
requests) with SIGTERM, and the fixtures make sure no process is left either way.
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from microvllm import LLM, SamplingParams
from microvllm.bench.serve import benchmark, random_prompts
from microvllm.models.tiny import make_tiny_model
from tests.support import LLM_SETTINGS, ROOT, SETTINGS, STARTUP_TIMEOUT, Server, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    folder = make_tiny_model(root / "llama", "llama", seed=7)
    srv = Server(folder, root / "server.log")
    try:
        wait_for(srv.healthy, STARTUP_TIMEOUT, "the server's /health")
        yield srv
    finally:
        srv.stop()
        assert srv.process.poll() is not None
        with pytest.raises(ProcessLookupError):
            os.kill(srv.process.pid, 0)   # the pid is gone (reaped), not a zombie


@pytest.fixture(scope="module")
def reference(server):
    return LLM(server.folder, **LLM_SETTINGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


GREEDY = dict(temperature=0.0, max_tokens=12)
EXTRA = {"ignore_eos": True}


def expected_text(reference, prompt, **params):
    sp = SamplingParams(**{**GREEDY, "ignore_eos": True, **params})
    return reference.generate(prompt, sp, use_tqdm=False)[0].outputs[0]


def test_models_lists_the_served_model(client, server):
    assert [m.id for m in client.models.list().data] == [server.folder]


def test_completion_matches_llm_generate(client, server, reference):
    want = expected_text(reference, "the scheduler")
    got = client.completions.create(model=server.folder, prompt="the scheduler", extra_body=EXTRA, **GREEDY)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens > 0


def test_streamed_completion_matches_llm_generate(client, server, reference):
    want = expected_text(reference, "a block table")
    stream = client.completions.create(model=server.folder, prompt="a block table", stream=True,
                                       stream_options={"include_usage": True}, extra_body=EXTRA, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_plain_and_streamed_match_llm_chat(client, server, reference):
    messages = [{"role": "user", "content": "what is a block"}]
    want = reference.chat(messages, SamplingParams(**GREEDY, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    got = client.chat.completions.create(model=server.folder, messages=messages, extra_body=EXTRA, **GREEDY)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=server.folder, messages=messages, stream=True,
                                            extra_body=EXTRA, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_match_llm_generate(client, server, reference):
    want = expected_text(reference, "tokens", logprobs=2)
    got = client.completions.create(model=server.folder, prompt="tokens", logprobs=2, extra_body=EXTRA, **GREEDY)
    logprobs = got.choices[0].logprobs
    expected = [row[t].logprob for row, t in zip(want.logprobs, want.token_ids)]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(model=server.folder, messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=2, extra_body=EXTRA, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 2 for c in content)


def test_vllm_extra_fields_reach_the_sampler(client, server, reference):
    extra = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.3, "min_tokens": 4, "ignore_eos": True}
    want = expected_text(reference, "the engine", temperature=0.8, seed=11, top_k=5, min_p=0.01,
                         repetition_penalty=1.3, min_tokens=4)
    got = client.completions.create(model=server.folder, prompt="the engine", max_tokens=12,
                                    temperature=0.8, seed=11, extra_body=extra)
    assert got.choices[0].text == want.text


def test_sixteen_concurrent_streams_all_finish(server):
    async def one(aclient, i):
        stream = await aclient.completions.create(model=server.folder, prompt=f"request {i} the",
                                                  stream=True, extra_body=EXTRA, **GREEDY)
        reasons, pieces = [], 0
        async for chunk in stream:
            if chunk.choices:
                pieces += 1
                reasons.append(chunk.choices[0].finish_reason)
        return pieces, reasons[-1]

    async def all_of_them():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(16))), 180)
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    assert len(results) == 16 and all(reason == "length" and pieces >= 1 for pieces, reason in results)


def idle(server) -> bool:
    m = server.metrics()
    return m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 and m["kv_cache_usage_perc"] == 0


def test_a_stream_closed_by_the_client_frees_its_request(server):
    wait_for(lambda: idle(server), 60, "an idle server")
    aborted_before = server.metrics().get("request_success_total:abort", 0)
    payload = {"model": server.folder, "prompt": "the engine " * 4, "max_tokens": 900, "temperature": 0,
               "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=payload) as response:
            assert response.status_code == 200
            events = []
            for line in response.iter_lines():   # read a few events, then hang up mid-stream
                if line.startswith("data: "):
                    events.append(line)
                if len(events) >= 3:
                    break
            assert "data: [DONE]" not in events
    wait_for(lambda: idle(server), 60, "running = 0 and kv usage = 0 after the client left")
    assert server.metrics().get("request_success_total:abort", 0) == aborted_before + 1, \
        httpx.get(server.url + "/metrics").text[-3000:]


def test_a_client_that_hangs_up_on_a_plain_request_frees_it(server):
    """Not streamed: the server notices the closed connection and aborts the request."""
    wait_for(lambda: idle(server), 60, "an idle server")
    aborted_before = server.metrics().get("request_success_total:abort", 0)
    payload = {"model": server.folder, "prompt": "a block table " * 3, "max_tokens": 900, "temperature": 0,
               "ignore_eos": True}

    async def hang_up():
        async with httpx.AsyncClient(timeout=60) as http:
            async def running() -> float:
                text = (await http.get(server.url + "/metrics")).text
                return float(re.search(r"num_requests_running\{[^}]*\} (\S+)", text).group(1))

            task = asyncio.create_task(http.post(server.url + "/v1/completions", json=payload))
            deadline = time.monotonic() + 60
            while await running() < 1:
                assert time.monotonic() < deadline and not task.done(), "the request never ran"
                await asyncio.sleep(0.02)
            task.cancel()   # closes the connection mid-request
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(hang_up(), 120))
    wait_for(lambda: idle(server), 60, "running = 0 and kv usage = 0 after the client left")
    assert server.metrics().get("request_success_total:abort", 0) == aborted_before + 1


def test_bad_requests_get_4xx_with_a_message_and_the_server_stays_healthy(client, server):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=server.folder, prompt="hi", max_tokens=-1)
    assert error.value.status_code == 400 and "max_tokens" in str(error.value)
    assert error.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=server.folder, messages=[{"role": "user", "content": "x"}],
                                       temperature=-2)
    assert "temperature" in str(error.value)
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in str(error.value)
    bad_json = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", ',
                          headers={"content-type": "application/json"}, timeout=30)
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    wrong_type = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": "many"}, timeout=30)
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "max_tokens"
    too_long = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 2000, "max_tokens": 2}, timeout=30)
    assert too_long.status_code == 400 and "max_model_len" in too_long.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    ok = client.completions.create(model=server.folder, prompt="hi", max_tokens=2)
    assert ok.choices[0].text is not None


def test_load_above_capacity_loses_no_request_and_frees_every_block(server):
    """64 requests at 200/s (far above what 2 loaded cores serve): all complete."""
    prompts = random_prompts(64, 24, seed=1)
    summary = asyncio.run(asyncio.wait_for(
        benchmark(server.url, server.folder, prompts, output_len=8, request_rate=200.0, seed=1), 240))
    assert summary["completed"] == 64 and summary["failed"] == 0, summary["errors"]
    assert summary["output_lens"] == [8] * 64
    assert summary["mean_ttft_ms"] > 0 and summary["p99_itl_ms"] >= summary["median_itl_ms"]
    wait_for(lambda: idle(server), 60, "every KV block free after the load")


def test_a_taken_port_is_reported_before_the_model_loads(server):
    result = subprocess.run([sys.executable, "-m", "microvllm", "serve", "/no/such/model", "--port",
                             str(server.port)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    # The model path does not exist: had the model been loaded first, that would be the error.
    assert result.returncode != 0 and f"cannot listen on 127.0.0.1:{server.port}" in result.stderr


@pytest.fixture
def long_server(tmp_path):
    """A second server whose requests may run 8192 tokens: long enough that what runs when
    SIGTERM comes cannot finish within the 1 s grace (the module's server allows 1024
    tokens, which a core in its own process decodes for 5 requests in about a second on a
    2-core EPYC: a race)."""
    folder = make_tiny_model(tmp_path / "llama", "llama", seed=7, max_position_embeddings=8192)
    srv = Server(folder, tmp_path / "server.log", flags=["--max-model-len", "8192", *SETTINGS[2:]])
    try:
        wait_for(srv.healthy, STARTUP_TIMEOUT, "the long server's /health")
        yield srv
    finally:
        srv.stop()


def test_sigterm_ends_every_stream_with_done(long_server):
    """SIGTERM with streams and a plain request in flight: after --shutdown-timeout (1 s
    here) what still runs is aborted: each stream's last chunk says finish_reason "abort",
    then [DONE]; the plain request gets a JSON error; exit status 0, and no traceback in
    the log."""
    server = long_server
    payload = {"model": server.folder, "prompt": "the engine", "max_tokens": 8000, "temperature": 0,
               "ignore_eos": True, "stream": True}
    started = [threading.Event() for _ in range(4)]
    streams: list[list[str]] = [[] for _ in range(4)]
    plain: dict = {}

    def stream(index):
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=payload, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        streams[index].append(line[6:])
                        started[index].set()
        except httpx.HTTPError as error:
            streams[index].append(f"transport error: {error!r}")
        started[index].set()

    def post():
        try:
            plain["response"] = httpx.post(server.url + "/v1/completions", json={**payload, "stream": False},
                                           timeout=60)
        except httpx.HTTPError as error:
            plain["error"] = error

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    threads.append(threading.Thread(target=post, daemon=True))
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in started)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0, server.log_path.read_text()[-3000:]
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    reasons = []
    for events in streams:
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        reasons.append(last["choices"][0]["finish_reason"])
    assert set(reasons) == {"abort"}, reasons   # 8000 tokens: none can finish within the grace
    response = plain.get("response")
    assert response is not None, plain
    assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
    log = server.log_path.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
