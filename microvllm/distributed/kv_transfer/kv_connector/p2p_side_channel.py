"""The ``P2PConnector``'s worker side: the bytes (``p2p_protocol.py`` draws the messages).

Producer: a listener thread answers reads of the blocks its scheduler side registered
(``serve``). Consumer: one thread per load reads a producer's blocks into a staging
buffer (``read_in_background``); the step copies them into the cache (``collect``,
``copy_into_cache``), never the reading thread::

    producer                                  consumer
    _serving  {request: SendEntry}            read thread ──> _staged {request: tensors | None}
    _reading  {request being read}                             (None: the load failed)
    _done_sending (read + acknowledged,       collect(wanted) inside a step: what arrived
       released, or expired)                  copy_into_cache: staged -> the request's blocks

Why the producer copies each layer under its lock and checks the request is still
served first: once a send is over (read, expired, or given up after a failed step) the
scheduler frees the blocks and the next forward may overwrite them; a reader that is
still streaming must then stop, never send another request's KV.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from microvllm.distributed.kv_transfer.kv_connector.p2p_protocol import (
    Deadline,
    recv_exact,
    recv_msg,
    send_msg,
)

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 5.0          # a connection has this long to say what it wants
REGISTRATION_WAIT_S = 2.0    # a read may arrive a step before its send is registered


@dataclass(frozen=True)
class RemoteLoad:
    """Consumer: read the producer's blocks [first, first + count) into ``block_ids``."""

    block_ids: tuple[int, ...]   # here, to fill (empty for a release)
    first: int
    count: int
    host: str                    # an allowed producer's side channel
    port: int
    engine_id: str
    request_id: str              # the request at the producer
    prompt_digest: str           # of OUR prompt's tokens [0, (first + count) * block_size)


@dataclass(frozen=True)
class SendEntry:
    """Producer: a finished prefill's blocks, the digests of the tokens it computed (one per
    block, chained: ``p2p_protocol.prompt_digests``) and when to stop holding them."""

    block_ids: tuple[int, ...]
    digests: tuple[str, ...]
    deadline: float


class SideChannel:
    def __init__(self, engine_id: str, block_size: int, load_timeout_s: float, max_connections: int) -> None:
        self.engine_id, self.block_size, self.load_timeout_s = engine_id, block_size, load_timeout_s
        self.kv_caches: list[torch.Tensor] = []
        self._lock = threading.Condition()
        self._serving: dict[str, SendEntry] = {}
        self._reading: set[str] = set()
        self._done_sending: set[str] = set()
        self._staged: dict[str, tuple[RemoteLoad, list[torch.Tensor] | None]] = {}
        self._connections = threading.BoundedSemaphore(max_connections)
        self._server: socketserver.ThreadingTCPServer | None = None

    # ------------------------------------------------------------ producer
    def listen(self, host: str, port: int) -> int:
        """Start the listener thread; return its port."""
        side_channel = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                if not side_channel._connections.acquire(blocking=False):
                    return   # too many at once: the connection is closed, the reader recomputes
                try:
                    side_channel._serve_one(self.request)
                finally:
                    side_channel._connections.release()

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="p2p-kv-side-channel", daemon=True).start()
        return self._server.server_address[1]

    def serve(self, sends: dict[str, SendEntry], given_up: set[str]) -> None:
        """A step's start: stop serving what the scheduler freed; serve the new sends."""
        with self._lock:
            for request_id in given_up:
                self._serving.pop(request_id, None)
            self._serving.update(sends)
            self._lock.notify_all()

    def _refusal(self, ask: dict, entry: SendEntry | None, request_id: str) -> str | None:
        first, count = ask.get("first"), ask.get("count")
        if ask.get("engine_id") != self.engine_id:
            return f"engine id {str(ask.get('engine_id'))[:64]!r} is not this engine's: it restarted"
        if entry is None:
            return "the request has no blocks here (unknown, freed or expired)"
        if request_id in self._reading:
            return "the request's blocks are being read already"
        if (type(first) is not int or type(count) is not int or first < 0 or count < 1
                or first + count > len(entry.block_ids)):
            return f"blocks [{first}, {first}+{count}) are not the request's ({len(entry.block_ids)} blocks)"
        if ask.get("prompt_digest") != entry.digests[first + count - 1]:
            return "the prompt is not the one this engine prefilled"
        return None

    def _serve_one(self, sock: socket.socket) -> None:
        """One consumer's read (or release) of one request's blocks, by one deadline."""
        try:
            ask = recv_msg(sock, Deadline(ASK_TIMEOUT_S))
            deadline = Deadline(self.load_timeout_s)
            request_id = str(ask.get("request_id"))[:256]
            with self._lock:   # the step that registers the send may not have run yet
                self._lock.wait_for(lambda: request_id in self._serving, timeout=REGISTRATION_WAIT_S)
                entry = self._serving.get(request_id)
                why = self._refusal(ask, entry, request_id)
                if why is None and ask.get("op") == "release":
                    self._finish_send(request_id)
                    why = "released"
                elif why is None:
                    self._reading.add(request_id)
            if why is not None:
                send_msg(sock, {"ok": why == "released", "error": why})
                return
            assert entry is not None
            try:
                self._send_blocks(sock, request_id, entry, ask["first"], ask["count"], deadline)
                if recv_msg(sock, deadline).get("done"):
                    with self._lock:
                        self._finish_send(request_id)
            finally:
                with self._lock:
                    self._reading.discard(request_id)
        except (OSError, ValueError, KeyError, TypeError):
            return   # the consumer went away or spoke nonsense: the blocks stay until the timeout

    def _send_blocks(self, sock: socket.socket, request_id: str, entry: SendEntry, first: int, count: int,
                     deadline: Deadline) -> None:
        ids = torch.tensor(entry.block_ids[first:first + count], dtype=torch.long)
        send_msg(sock, {"ok": True, "prompt_digest": entry.digests[first + count - 1]})
        for kv_cache in self.kv_caches:
            with self._lock:
                if self._serving.get(request_id) is not entry:
                    raise ConnectionError("the send was given up: its blocks may be reused")
                data = kv_cache[:, ids].contiguous().numpy().tobytes()
            sock.settimeout(deadline.remaining())
            sock.sendall(data)

    def _finish_send(self, request_id: str) -> None:
        """Under the lock: the blocks may be freed."""
        if self._serving.pop(request_id, None) is not None:
            self._done_sending.add(request_id)
            self._lock.notify_all()

    # ------------------------------------------------------------ consumer
    def read_in_background(self, request_id: str, load: RemoteLoad) -> None:
        threading.Thread(target=self._read_remote, args=(request_id, load), daemon=True,
                         name="p2p-kv-read").start()

    def _read_remote(self, request_id: str, load: RemoteLoad) -> None:
        """Read one request's blocks into a staging buffer, by one deadline."""
        staged: list[torch.Tensor] | None = None
        deadline = Deadline(self.load_timeout_s)
        try:
            with socket.create_connection((load.host, load.port), timeout=deadline.remaining()) as sock:
                send_msg(sock, {"op": "read", "engine_id": load.engine_id, "request_id": load.request_id,
                                "first": load.first, "count": load.count, "prompt_digest": load.prompt_digest})
                answer = recv_msg(sock, deadline)
                if not answer.get("ok"):
                    raise ConnectionError(f"the producer refused: {str(answer.get('error'))[:200]}")
                if answer.get("prompt_digest") != load.prompt_digest:
                    raise ConnectionError("the producer's prompt is not this request's")
                staged = []
                for kv_cache in self.kv_caches:
                    out = torch.empty((2, load.count, *kv_cache.shape[2:]), dtype=kv_cache.dtype)
                    recv_exact(sock, out.numel() * out.element_size(), deadline,
                               memoryview(out.numpy()).cast("B"))  # type: ignore[arg-type]
                    staged.append(out)
                send_msg(sock, {"done": True})
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("KV load of %s failed (%s): computing its prompt", request_id, error)
            staged = None
        with self._lock:
            self._staged[request_id] = (load, staged)
            self._lock.notify_all()

    @staticmethod
    def release_in_background(load: RemoteLoad, timeout_s: float) -> None:
        """Tell the producer it may free a prompt's blocks (nobody will read them)."""
        def release() -> None:
            try:
                deadline = Deadline(min(timeout_s, 5.0))
                with socket.create_connection((load.host, load.port), timeout=deadline.remaining()) as sock:
                    send_msg(sock, {"op": "release", "engine_id": load.engine_id, "request_id": load.request_id,
                                    "first": load.first, "count": load.count, "prompt_digest": load.prompt_digest})
                    recv_msg(sock, deadline)
            except (OSError, ValueError):
                pass   # the producer frees them on its timeout
        threading.Thread(target=release, daemon=True, name="p2p-kv-release").start()

    # ------------------------------------------------------------ each step
    def collect(self, wanted: set[str], wait: bool) -> tuple[set[str], dict[str, tuple[RemoteLoad, Any]]]:
        """(sends finished since the last step, loads arrived that a request still wants);
        sends past their deadline expire (unless being read: the read's deadline ends it)."""
        with self._lock:
            if wait and not self._staged and not self._done_sending:
                self._lock.wait(0.02)
            now = time.monotonic()
            for request_id, entry in list(self._serving.items()):
                if now > entry.deadline and request_id not in self._reading:
                    self._finish_send(request_id)
            sending, self._done_sending = self._done_sending, set()
            staged = {rid: item for rid, item in self._staged.items() if rid in wanted}
            self._staged.clear()   # what nobody waits for any more is dropped
        return sending, staged

    def copy_into_cache(self, block_ids: tuple[int, ...], tensors: list[torch.Tensor]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long)
        for kv_cache, tensor in zip(self.kv_caches, tensors):
            kv_cache[:, ids] = tensor.to(device=kv_cache.device)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
