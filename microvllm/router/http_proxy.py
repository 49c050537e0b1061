"""The course router over HTTP: one of this package's policies in front of ``microvllm
serve`` replicas, as vllm-router stands in front of vLLM's.

    client --POST /v1/completions--> proxy: tokenize, block hashes, policy.choose --> replica i
           <------------ the replica's answer, streamed back chunk by chunk ------------'
    replica i --ZMQ PUB (KV events)--> proxy SUB --> policy.apply_event(i, event)  (kv_events only)

    python -m microvllm.router.http_proxy --model FOLDER --policy prefix_aware \\
        --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 \\
        [--kv-events tcp://127.0.0.1:5557 --kv-events tcp://127.0.0.1:5558] --port 9000

One idea: the policy sees the request as ``Router`` shows it in-process (``RoutedRequest``:
the prompt's tokens and the engine's block hashes, so the proxy tokenizes with the
replicas' tokenizer and block size) and each replica's load as the requests the proxy
has in flight there (vllm-router's ``load`` is the same count). Everything else is
forwarding, ``/v1/completions`` and ``/v1/chat/completions``. ``GET /router/stats`` says
how many requests went where and which replicas are in rotation.

A proxy faces hostile clients and dying replicas; each case has one small piece below:

    a body over --max-request-body-bytes     413, as `microvllm serve` says it (RequestGuard)
    malformed JSON, a body that is no object 400 in OpenAI's shape, never a plain-text 500
    a long prompt                            tokenized on a thread, and only its first
                                             --max-routed-chars: the event loop keeps relaying
    a replica that refuses or fails /health  ejected: out of rotation until a /health probe
                                             (every --health-check-interval s) says 200 again
    a plain request whose replica failed     sent again to another replica in rotation
    a stream whose replica died midway       an error event (vLLM's shape), then data: [DONE]
"""

import argparse
import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Sequence

import httpx

from microvllm.router.policies import make_policy
from microvllm.router.policy import ReplicaState, RoutedRequest, RoutingPolicy

logger = logging.getLogger(__name__)

# A prompt and its options: 8 MiB holds any prompt a replica's context could take.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
# The policy looks at the head of a prompt: two prompts that share 64 Ki characters go the
# same way whatever follows, and tokenizing megabytes would cost seconds for nothing.
DEFAULT_MAX_ROUTED_CHARS = 64 * 1024
DEFAULT_HEALTH_CHECK_INTERVAL = 1.0   # seconds between two probes of every replica's /health
DEFAULT_HEALTH_CHECK_TIMEOUT = 5.0    # seconds a /health may take before the replica is ejected

# The errors that mean "this replica is gone" (refused, reset, closed midway), not "this
# request is bad": the replica leaves the rotation and a plain request goes elsewhere.
REPLICA_GONE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
                httpx.RemoteProtocolError)


class HTTPProxy:
    """The routing state: replicas, policy, tokenizer, in-flight counts, who is in rotation."""

    def __init__(self, replicas: Sequence[str], policy: RoutingPolicy, tokenizer, *, block_size: int = 16,
                 num_kv_blocks: int = 1 << 20, max_routed_chars: int = DEFAULT_MAX_ROUTED_CHARS) -> None:
        self.replicas = [url.rstrip("/") for url in replicas]
        self.policy, self.tokenizer, self.block_size = policy, tokenizer, block_size
        self.max_routed_chars = max_routed_chars
        self.policy.reset([num_kv_blocks] * len(self.replicas))
        self.in_flight = [0] * len(self.replicas)
        self.served = [0] * len(self.replicas)
        self.kv_events = [0] * len(self.replicas)   # events received from each replica
        self.healthy = [True] * len(self.replicas)  # in rotation (the first probe corrects this)
        self.ejections = [0] * len(self.replicas)   # times each was taken out of rotation
        self.request_ids = itertools.count(1)
        # One thread tokenizes for routing: a route takes milliseconds (only a prompt's head is
        # read), and a flood of long prompts then costs one core and one thread's memory.
        self.routing_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="proxy-route")

    # ---- what the policy sees (on the routing thread: touches no shared state) ----------

    async def route_off_loop(self, body: dict, chat: bool = False) -> RoutedRequest:
        """``route`` on the routing thread: the event loop goes on relaying meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.routing_thread, self.route, body, chat)

    def route(self, body: dict, chat: bool = False) -> RoutedRequest:
        """The request as the policy sees it: the head of its prompt's tokens and their
        block hashes. CPU work, milliseconds to tens of them: never on the event loop.
        A prompt it cannot read is routed as an empty one: the replica will say what is wrong."""
        try:
            token_ids = self.routing_tokens(body, chat)
        except Exception:  # noqa: BLE001 - any replica can refuse a broken request
            token_ids = []
        return RoutedRequest.from_token_ids(f"proxy-{next(self.request_ids)}", token_ids, self.block_size)

    def routing_tokens(self, body: dict, chat: bool) -> list[int]:
        """The first tokens of the prompt (a batch goes where its first prompt goes); a chat
        is rendered with the model's template, as the replica will render it."""
        if chat:
            messages = [cut_text(message, self.max_routed_chars) for message in body.get("messages")]
            text = self.tokenizer.render_chat_template(messages)
            return self.encode_head(text, add_special_tokens=False)   # the template wrote them
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode_head(prompt, add_special_tokens=True)
        return [int(t) for t in prompt[:self.max_routed_chars]]       # token ids: at least 1 char each

    def encode_head(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokens of the first ``max_routed_chars`` characters. The cut may split a word, so
        the last tokens of a cut text are not the whole text's: its last block is left out."""
        token_ids = self.tokenizer.encode(text[:self.max_routed_chars], add_special_tokens=add_special_tokens)
        if len(text) > self.max_routed_chars:
            del token_ids[-self.block_size:]
        return token_ids

    # ---- the choice and the rotation (on the event loop) -------------------------------

    def choose(self, request: RoutedRequest, exclude: Sequence[int] = ()) -> int | None:
        """The policy's replica for ``request`` among those in rotation and not in ``exclude``
        (the ones this request already failed on); None when there is none left."""
        candidates = [i for i, up in enumerate(self.healthy) if up and i not in exclude]
        if not candidates:
            return None
        states = [ReplicaState(i, num_running=self.in_flight[i]) for i in candidates]
        choice = self.policy.choose(request, states)
        self.policy.on_routed(request, choice)
        return choice.replica

    def eject(self, replica: int, why: str) -> None:
        """Take ``replica`` out of rotation. Its prefix cache is gone or unreachable, so the
        policy forgets what it believed was cached there."""
        if self.healthy[replica]:
            logger.warning("replica %d (%s) out of rotation: %s", replica, self.replicas[replica], why)
            self.healthy[replica] = False
            self.ejections[replica] += 1
            self.policy.forget(replica)

    def admit(self, replica: int) -> None:
        """Put ``replica`` back in rotation (its /health said 200)."""
        if not self.healthy[replica]:
            logger.warning("replica %d (%s) back in rotation", replica, self.replicas[replica])
            self.healthy[replica] = True

    def stats(self) -> dict:
        return {"policy": self.policy.name, "replicas": self.replicas, "healthy": self.healthy,
                "ejections": self.ejections, "served": self.served, "in_flight": self.in_flight,
                "kv_events": self.kv_events}


def cut_text(message: dict, chars: int) -> dict:
    """``message`` with its text (a string, or OpenAI's text parts) cut to ``chars``
    characters: the chat it renders to starts with the same ``chars`` characters, without
    copying megabytes the policy will not look at."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content[:chars]}
    if isinstance(content, list):
        return {**message, "content": [{**part, "text": part["text"][:chars]}
                                       if isinstance(part, dict) and isinstance(part.get("text"), str) else part
                                       for part in content]}
    return message


# ---- health checks --------------------------------------------------------------------

async def probe(client: httpx.AsyncClient, url: str, timeout: float) -> str | None:
    """None if ``url``'s /health answers 200 within ``timeout`` seconds, else what went wrong."""
    try:
        response = await client.get(url + "/health", timeout=timeout)
    except httpx.HTTPError as error:
        return describe(error)
    return None if response.status_code == 200 else f"/health answered {response.status_code}"


async def watch_replicas(proxy: HTTPProxy, client: httpx.AsyncClient, interval: float, timeout: float) -> None:
    """Probe every replica's /health, then again ``interval`` seconds later (forever): a
    failed probe ejects a replica, a 200 re-admits one (a replica restarted on its port)."""
    async def check(replica: int) -> None:
        problem = await probe(client, proxy.replicas[replica], timeout)
        if problem is None:
            proxy.admit(replica)
        else:
            proxy.eject(replica, problem)

    while True:
        # return_exceptions: one check that raised (a malformed URL) must not stop the others
        await asyncio.gather(*(check(i) for i in range(len(proxy.replicas))), return_exceptions=True)
        await asyncio.sleep(interval)


def describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


# ---- request bodies and streams ---------------------------------------------------------

def json_object(raw: bytes) -> dict:
    """The request body as a JSON object, or ``ValueError`` saying what a client should fix."""
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"malformed JSON in the request body: {error}") from None
    if not isinstance(body, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(body), "a number")
        raise ValueError(f"the request body must be a JSON object ({{\"prompt\": ...}}), not {kind}")
    return body


async def whole_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Server-sent events from ``chunks`` cut anywhere, each piece ending at an event's
    blank line: if the replica dies midway, nothing half-sent is in front of the error event."""
    pending = b""
    async for chunk in chunks:
        complete, blank, pending = (pending + chunk).rpartition(b"\n\n")
        if blank:
            yield complete + blank
    if pending:
        yield pending   # a stream that did not end with a blank line: as it came


def stream_failed(status: int, message: str) -> bytes:
    """The last events of a stream that failed midway, as vLLM ends one: an error event
    carrying OpenAI's error body, then ``[DONE]`` (a client waits for it)."""
    from microvllm.entrypoints.openai.api_server import error_response

    return b"data: " + error_response(status, message).body + b"\n\ndata: [DONE]\n\n"


# ---- the app ----------------------------------------------------------------------------

def build_app(proxy: HTTPProxy, kv_event_endpoints: Sequence[str] = (), *, limits=None,
              health_check_interval: float = DEFAULT_HEALTH_CHECK_INTERVAL,
              health_check_timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT):
    """The FastAPI app: ``/v1/completions`` and ``/v1/chat/completions`` (streaming too),
    ``/health``, ``/router/stats``. ``limits``: the ``RequestLimits`` on a request's body
    (default: ``DEFAULT_MAX_REQUEST_BODY_BYTES``). (No ``from __future__ import annotations``
    in this module: FastAPI reads the handlers' annotations, and ``Request`` is imported
    here, not at module level.)"""
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    from microvllm.entrypoints.openai.api_server import CatchAll, error_response
    from microvllm.entrypoints.openai.request_guard import RequestGuard
    from microvllm.entrypoints.openai.request_limits import RequestLimits

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # connect: a replica that does not take a connection in 5 s is as good as gone
        timeout = httpx.Timeout(600.0, connect=5.0)
        app.state.client = client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
        tasks = [asyncio.create_task(follow_kv_events(proxy, i, ep)) for i, ep in enumerate(kv_event_endpoints)]
        tasks.append(asyncio.create_task(watch_replicas(proxy, client, health_check_interval, health_check_timeout)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.aclose()

    app = FastAPI(title="microvllm course router", lifespan=lifespan)
    # As `microvllm serve`: the body is read whole under a size and a time limit, its text
    # checked (request_guard.py), and no exception reaches uvicorn as a plain-text 500.
    app.state.request_limits = limits or RequestLimits(max_request_body_bytes=DEFAULT_MAX_REQUEST_BODY_BYTES)
    app.add_middleware(RequestGuard)
    app.add_middleware(CatchAll)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/router/stats")
    async def stats() -> dict:
        return proxy.stats()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    async def forward(request: Request, path: str) -> Response:
        """Route the request, then try replicas in the policy's order until one answers."""
        raw = await request.body()
        try:
            body = json_object(raw)
        except ValueError as error:
            return error_response(400, str(error), "BadRequestError")
        # tokenizing is CPU work: on a thread, the event loop keeps relaying other streams
        routed = await proxy.route_off_loop(body, chat=path == "/v1/chat/completions")
        del body   # a megabyte prompt need not live while its answer comes: raw is what is sent
        tried: list[int] = []
        while (replica := proxy.choose(routed, exclude=tried)) is not None:
            tried.append(replica)
            answer = await send_to(replica, path, raw)
            if answer is not None:
                return answer
        return error_response(503, f"no replica could take the request (tried {tried or 'none'}; "
                                   f"in rotation: {[i for i, up in enumerate(proxy.healthy) if up]})",
                              "ServiceUnavailableError")

    async def send_to(replica: int, path: str, raw: bytes) -> Response | None:
        """``replica``'s answer, or None when the replica failed (it is ejected, and the
        request may go to another). A stream is handed to ``relay`` once its headers came:
        from then on its client has seen the answer start, so it cannot move."""
        client: httpx.AsyncClient = app.state.client
        url = proxy.replicas[replica]
        proxy.in_flight[replica] += 1
        streaming = False
        try:
            try:
                upstream = await client.send(client.build_request(
                    "POST", url + path, content=raw, headers={"content-type": "application/json"}), stream=True)
            except REPLICA_GONE as error:
                proxy.eject(replica, describe(error))
                return None
            if upstream.status_code >= 500 and (problem := await probe(client, url, health_check_timeout)):
                await upstream.aclose()   # a 5xx from a dying replica (its /health fails too)
                proxy.eject(replica, f"answered {upstream.status_code}, then {problem}")
                return None
            proxy.served[replica] += 1
            media_type = upstream.headers.get("content-type", "application/json")
            if media_type.startswith("text/event-stream"):
                streaming = True          # relay() now owns the connection and the count
                return StreamingResponse(relay(replica, upstream), status_code=upstream.status_code,
                                         media_type=media_type)
            try:
                content = await upstream.aread()
            except REPLICA_GONE as error:
                proxy.eject(replica, describe(error))
                return None
            finally:
                await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type=media_type)
        except httpx.TimeoutException as error:   # slow, not gone: another replica would not be faster
            return error_response(504, f"replica {replica} did not answer in time: {describe(error)}",
                                  "GatewayTimeoutError")
        except httpx.HTTPError as error:          # anything else: the replica's answer was broken
            return error_response(502, f"replica {replica} failed: {describe(error)}", "BadGatewayError")
        finally:
            if not streaming:
                proxy.in_flight[replica] -= 1

    async def relay(replica: int, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """Forward a stream event by event; if the replica dies midway, end the stream
        properly (error event, ``[DONE]``) rather than with a cut-off body."""
        try:
            async for events in whole_events(upstream.aiter_bytes()):
                yield events
        except httpx.HTTPError as error:
            if isinstance(error, REPLICA_GONE):
                proxy.eject(replica, describe(error))
            yield stream_failed(503, f"replica {replica} failed during the stream ({describe(error)}): "
                                     "the output so far is all there is; send the request again")
        finally:
            await upstream.aclose()
            proxy.in_flight[replica] -= 1

    return app


async def follow_kv_events(proxy: HTTPProxy, replica: int, endpoint: str) -> None:
    """Subscribe to one replica's KV events and hand each one to the policy (forever; a
    restarted replica's publisher is found again by ZMQ's reconnect)."""
    import msgspec
    import zmq
    import zmq.asyncio

    from microvllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    try:
        while True:
            *_, payload = await socket.recv_multipart()     # [topic, seq, payload]
            for event in decoder.decode(payload).events:
                proxy.policy.apply_event(replica, event)   # type: ignore[attr-defined]
                proxy.kv_events[replica] += 1
    finally:
        socket.close(linger=0)
        context.term()


def main(argv: list[str] | None = None) -> int:
    from microvllm.entrypoints.openai.request_limits import RequestLimits

    defaults = RequestLimits()
    parser = argparse.ArgumentParser(prog="python -m microvllm.router.http_proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica", action="append", required=True, help="a replica's base URL (repeat)")
    parser.add_argument("--model", required=True, help="the replicas' model folder (for its tokenizer)")
    parser.add_argument("--policy", default="prefix_aware", help="round_robin, least_loaded, prefix_aware, kv_events")
    parser.add_argument("--kv-events", action="append", default=[],
                        help="replica i's KV event endpoint, in --replica order (the kv_events policy)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=1 << 20, help="each replica's KV blocks")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="a larger request body is refused with a 413 (default: %(default)s)")
    parser.add_argument("--request-body-timeout", type=float, default=defaults.request_body_timeout,
                        help="seconds for a request's whole body, else a 408 (default: %(default)s)")
    parser.add_argument("--request-header-timeout", type=float, default=defaults.request_header_timeout,
                        help="seconds for a request's headers, else a 408 and the connection closed "
                             "(default: %(default)s)")
    parser.add_argument("--max-routed-chars", type=int, default=DEFAULT_MAX_ROUTED_CHARS,
                        help="the policy sees this much of a prompt's text at most (or this many token ids; "
                             "default: %(default)s)")
    parser.add_argument("--health-check-interval", type=float, default=DEFAULT_HEALTH_CHECK_INTERVAL,
                        help="seconds between probes of every replica's /health: a failure ejects it, "
                             "a 200 re-admits it (default: %(default)s)")
    parser.add_argument("--health-check-timeout", type=float, default=DEFAULT_HEALTH_CHECK_TIMEOUT,
                        help="seconds a replica's /health may take before the replica is ejected "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.kv_events and len(args.kv_events) != len(args.replica):
        parser.error("give one --kv-events endpoint per --replica, in the same order")
    if args.policy == "kv_events" and not args.kv_events:
        parser.error("the kv_events policy needs each replica's --kv-events endpoint")

    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from microvllm.entrypoints.openai.request_guard import with_header_timeout
    from microvllm.tokenizer import Tokenizer

    limits = RequestLimits.from_cli_args(args)
    proxy = HTTPProxy(args.replica, make_policy(args.policy), Tokenizer.from_pretrained(args.model),
                      block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                      max_routed_chars=args.max_routed_chars)
    app = build_app(proxy, args.kv_events if args.policy == "kv_events" else (), limits=limits,
                    health_check_interval=args.health_check_interval,
                    health_check_timeout=args.health_check_timeout)
    # uvicorn waits for a request's headers without a deadline: the protocol gets one
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                http=with_header_timeout(AutoHTTPProtocol, limits.request_header_timeout))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
