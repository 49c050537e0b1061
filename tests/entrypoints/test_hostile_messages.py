"""What a hostile or broken client is told (issue 38, item 8), against a real
``microvllm serve`` process on 127.0.0.1 over a tiny random Llama, started with short
limits so that each one can be reached in a second:

    deep nesting, a lone surrogate, bytes that are not UTF-8,
    an unknown structured_outputs key                   -> 400 naming the field
    a body over --max-request-body-bytes                -> 413 (Content-Length or counted)
    headers slower than --request-header-timeout        -> 408, then the connection closes
    a body slower than --request-body-timeout           -> 408, then the connection closes

and after each, the server still answers a normal request at once.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from microvllm.models.tiny import make_tiny_model
from tests.support import Server, wait_for

HEADER_TIMEOUT = BODY_TIMEOUT = 1.0
MAX_BODY = 200_000
SETTINGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--shutdown-timeout", "1", "--request-header-timeout", str(HEADER_TIMEOUT),
            "--request-body-timeout", str(BODY_TIMEOUT), "--max-request-body-bytes", str(MAX_BODY)]
CHAT = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, port) of a ``microvllm serve`` process with the short limits above."""
    root = tmp_path_factory.mktemp("messages")
    srv = Server(make_tiny_model(root / "llama", "llama", seed=7), root / "server.log", SETTINGS)
    try:
        wait_for(srv.healthy, 180, "the server's /health")
        yield srv.url, srv.port
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=30) as client:
        yield client


def serves_at_once(http) -> None:
    start = time.monotonic()
    ok = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert time.monotonic() - start < 10


def error_of(response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["code"] == status
    return error


def nested(depth: int):
    value: object = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


# ------------------------------------------------------------------- the body's text
def test_deep_nesting_is_a_400_naming_the_field(http):
    body = json.dumps({"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": nested(900)})
    error = error_of(http.post("/v1/chat/completions", content=body, headers=JSON), 400)
    assert error["param"] == "chat_template_kwargs" and "levels" in error["message"], error
    too_deep_to_parse = '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"
    error = error_of(http.post("/v1/chat/completions", content=too_deep_to_parse, headers=JSON), 400)
    assert error["param"] == "messages" and "levels" in error["message"], error
    serves_at_once(http)


SURROGATES = [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt", "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "a\\udc00"], "max_tokens": 2}', "prompt", "prompt[1]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
     "messages", "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\ud800"}]}]}',
     "messages", "messages[0].content[0].text"),
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt", "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "a\\udfff"}]}', "messages", "messages[0].content"),
]


@pytest.mark.parametrize("path, body, param, where", SURROGATES)
def test_a_lone_surrogate_is_named_with_its_field(http, path, body, param, where):
    error = error_of(http.post(path, content=body, headers=JSON), 400)
    assert error["param"] == param, error
    assert where in error["message"] and "unpaired surrogate" in error["message"], error
    assert "TextEncodeInput" not in error["message"]


def test_a_surrogate_pair_is_one_character_and_is_served(http):
    body = '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    assert http.post("/v1/completions", content=body, headers=JSON).status_code == 200
    tokens = http.post("/tokenize", content='{"prompt": "\\ud83d\\ude00"}', headers=JSON)
    assert tokens.status_code == 200, tokens.text


@pytest.mark.parametrize("raw, offset", [(b'{"prompt": "a\xffb"}', 13),
                                         (b'{"prompt": "a\xed\xa0\x80b"}', 13)])   # a surrogate, encoded
def test_a_body_that_is_not_utf8_says_where(http, raw, offset):
    error = error_of(http.post("/v1/completions", content=raw, headers=JSON), 400)
    assert "UTF-8" in error["message"] and f"byte {offset}" in error["message"], error
    assert "error parsing the body" not in error["message"]
    serves_at_once(http)


def test_an_unknown_structured_outputs_key_names_it_and_the_valid_ones(http):
    body = {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regexp": "a+"}}
    error = error_of(http.post("/v1/completions", json=body), 400)
    assert error["param"] == "structured_outputs", error
    assert "'regexp'" in error["message"] and "regex" in error["message"].replace("'regexp'", ""), error
    assert "__init__" not in error["message"], error


# ------------------------------------------------------------------- size and time
def test_a_declared_oversized_body_is_a_413_before_it_is_sent(server, http):
    """Content-Length over the limit: answered from the headers alone, then closed."""
    with socket.create_connection(("127.0.0.1", server[1]), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n")
        reply = read_until_closed(sock, 10)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"max-request-body-bytes" in reply and b"100000000" in reply, reply
    serves_at_once(http)


def test_a_chunked_oversized_body_is_a_413_once_it_passes_the_limit(http):
    def chunks():
        for _ in range(50):
            yield b"x" * 10_000     # 500 kB in all, more than MAX_BODY
    error = error_of(http.post("/v1/completions", content=chunks(), headers=JSON), 413)
    assert "max-request-body-bytes" in error["message"], error
    ok = http.post("/v1/completions", json={"prompt": "a" * 50_000, "max_tokens": 2})
    assert ok.status_code != 413, ok.text     # under the limit: read (and refused for its length, if at all)
    serves_at_once(http)


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            return data
        if not chunk:
            return data
        data += chunk


def trickle(port: int, head: bytes, body: bytes, results: list, index: int) -> None:
    """Send ``head`` at once, then ``body`` one byte each 0.1 s; record the reply, when
    the connection closed (seconds after the trickle began), and whether the server
    stopped reading before we finished."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        start = time.monotonic()
        cut_off = False
        for byte in body:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                cut_off = True
                break
            sock.settimeout(0.1)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    cut_off = True
                    break
            except socket.timeout:
                pass
        reply = read_until_closed(sock, 10)
        results[index] = (reply, time.monotonic() - start, cut_off)


SLOW_HEADERS = (b"POST /v1/completions HTTP/1.1\r\n", b"Host: x\r\nX-Padding: " + b"a" * 100)
SLOW_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 200\r\n\r\n", b'{"prompt": "' + b"a" * 180 + b'"}')


@pytest.mark.parametrize("head, body", [SLOW_HEADERS, SLOW_BODY], ids=["headers", "body"])
def test_a_slow_client_is_cut_off_with_a_408_while_others_are_served(server, http, head, body):
    clients = 50      # the shape: 50 connections trickling at once
    results: list = [None] * clients
    threads = [threading.Thread(target=trickle, args=(server[1], head, body, results, i), daemon=True)
               for i in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    serves_at_once(http)      # while every slow client is still trickling
    for thread in threads:
        thread.join(20)
    for reply, seconds, cut_off in results:
        assert cut_off, "the server read every byte of a trickle longer than its timeout"
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"timeout" in reply, reply
        assert seconds < HEADER_TIMEOUT + BODY_TIMEOUT + 3, seconds
    serves_at_once(http)


def test_a_connection_that_sends_nothing_is_closed(server):
    with socket.create_connection(("127.0.0.1", server[1]), timeout=10) as sock:
        start = time.monotonic()
        reply = read_until_closed(sock, 10)
    assert time.monotonic() - start < HEADER_TIMEOUT + 3
    assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_keep_alive_requests_on_one_connection_are_not_cut_off(http):
    for _ in range(2):
        serves_at_once(http)
        time.sleep(HEADER_TIMEOUT + 0.3)   # idle between requests: uvicorn's keep-alive (5 s) applies
