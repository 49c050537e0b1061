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
forwarding. ``GET /router/stats`` says how many requests went where.
"""

import argparse
import asyncio
import contextlib
from collections.abc import Sequence

from microvllm.router.policies import make_policy
from microvllm.router.policy import ReplicaState, RoutedRequest, RoutingPolicy


class HTTPProxy:
    """The routing state: replicas, policy, tokenizer, in-flight counts."""

    def __init__(self, replicas: Sequence[str], policy: RoutingPolicy, tokenizer, *, block_size: int = 16,
                 num_kv_blocks: int = 1 << 20) -> None:
        self.replicas = [url.rstrip("/") for url in replicas]
        self.policy, self.tokenizer, self.block_size = policy, tokenizer, block_size
        self.policy.reset([num_kv_blocks] * len(self.replicas))
        self.in_flight = [0] * len(self.replicas)
        self.served = [0] * len(self.replicas)
        self.kv_events = [0] * len(self.replicas)   # events received from each replica
        self.count = 0

    def choose(self, prompt) -> int:
        """The replica for ``prompt``: a string or a list of token ids (a list of strings,
        a batch, goes where its first prompt goes)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        token_ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(str(prompt))
        self.count += 1
        request = RoutedRequest.from_token_ids(f"proxy-{self.count}", token_ids, self.block_size)
        states = [ReplicaState(i, num_running=n) for i, n in enumerate(self.in_flight)]
        choice = self.policy.choose(request, states)
        self.policy.on_routed(request, choice)
        return choice.replica


async def follow_kv_events(proxy: HTTPProxy, replica: int, endpoint: str) -> None:
    """Subscribe to one replica's KV events and hand each one to the policy (forever)."""
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


def build_app(proxy: HTTPProxy, kv_event_endpoints: Sequence[str] = ()):
    """The FastAPI app: ``/v1/completions`` (streaming too), ``/health``, ``/router/stats``.
    (No ``from __future__ import annotations`` in this module: FastAPI reads the handlers'
    annotations, and ``Request`` is imported here, not at module level.)"""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None))
        tasks = [asyncio.create_task(follow_kv_events(proxy, i, ep)) for i, ep in enumerate(kv_event_endpoints)]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await app.state.client.aclose()

    app = FastAPI(title="microvllm course router", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/router/stats")
    async def stats() -> dict:
        return {"policy": proxy.policy.name, "replicas": proxy.replicas, "served": proxy.served,
                "in_flight": proxy.in_flight, "kv_events": proxy.kv_events}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        replica = proxy.choose(body.get("prompt", ""))
        proxy.in_flight[replica] += 1
        proxy.served[replica] += 1
        client: httpx.AsyncClient = app.state.client
        try:
            upstream = await client.send(client.build_request(
                "POST", proxy.replicas[replica] + "/v1/completions", json=body), stream=True)
        except httpx.HTTPError as error:
            proxy.in_flight[replica] -= 1
            return JSONResponse({"error": {"message": f"replica {replica} failed: {error}"}}, status_code=502)

        if not body.get("stream"):
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                proxy.in_flight[replica] -= 1
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type"))

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                proxy.in_flight[replica] -= 1

        return StreamingResponse(relay(), status_code=upstream.status_code, media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    if args.kv_events and len(args.kv_events) != len(args.replica):
        parser.error("give one --kv-events endpoint per --replica, in the same order")
    if args.policy == "kv_events" and not args.kv_events:
        parser.error("the kv_events policy needs each replica's --kv-events endpoint")

    import uvicorn

    from microvllm.tokenizer import Tokenizer

    proxy = HTTPProxy(args.replica, make_policy(args.policy), Tokenizer.from_pretrained(args.model),
                      block_size=args.block_size, num_kv_blocks=args.num_kv_blocks)
    uvicorn.run(build_app(proxy, args.kv_events if args.policy == "kv_events" else ()),
                host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
