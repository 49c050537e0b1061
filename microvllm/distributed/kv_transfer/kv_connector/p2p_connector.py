"""``P2PConnector``: prefill/decode disaggregation between two engines (vLLM: the NIXL
connector, the ``kv_connector/v1/nixl/`` package, and its request protocol, which
``vllm-router --vllm-pd-disaggregation --kv-connector nixl`` speaks)::

    client ──> router ── 1. {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}
                 │          ──> prefill instance (kv_role kv_producer)
                 │              prefills; request_finished keeps its blocks (delayed free) and
                 │      <── answers "kv_transfer_params": {"do_remote_prefill": true,
                 │              "remote_engine_id", "remote_block_ids", "remote_host",
                 │              "remote_port", "remote_request_id", ...}
                 └──── 2. the client's request + those kv_transfer_params
                          ──> decode instance (kv_role kv_consumer)
                              get_num_new_matched_tokens: the prompt's full blocks past its
                              local hit; WAITING_FOR_REMOTE_KVS while a thread reads them
                              from the producer's side channel; then decodes
                              ── "read" (request, block ids) ──> producer side channel
                              <── the blocks' bytes, every layer; ack ──
                              producer: finished_sending -> its blocks are freed

Transport: one plain TCP connection per transfer to a side-channel listener thread in
the producer's worker, pulled by the consumer (as NIXL's decode side reads the remote
blocks). Why: on loopback a socket moves the blocks at memory speed with no extra
dependency; it needs no rendezvous fixed at start (torch.distributed send/recv would bind
both processes into one process group for life, so a restarted producer would break the
consumer); each transfer fails on its own (a refused connection, a timeout, a short read)
and the request falls back to computing its prompt; and the same code runs between two
hosts. Shared memory would save one copy, but its lifetime would have to be managed
across two processes that may die independently.

Who is trusted (``p2p_protocol.py`` draws the messages):

- A decode instance connects only to producers its operator named
  (``allowed_producers``); a request naming any other host or port is refused with a 400
  before anything connects. Without ``allowed_producers`` it loads from nobody.
- What it loads must be what it would have computed: it sends the digest of its own
  prompt's tokens up to the last block it reads; the producer compares it with its digest
  of the tokens *it* prefilled and refuses a mismatch; the consumer compares the
  producer's answer with its own too. Only then do the bytes reach its blocks, and only
  loaded blocks that passed become prefix-cache entries. The producer serves its own
  block ids for the range asked (a client's ``remote_block_ids`` give only a count).
- Every message is length-capped and every exchange has one deadline.

Who frees what, when:

- producer: a finished ``do_remote_decode`` request that stopped on length (max_tokens=1)
  keeps its blocks (``request_finished`` -> delay_free) until the consumer has read them
  and acknowledged, released them (its decode leg was refused), or ``send_timeout_s``
  passed (a decode instance that died, or a request the router never sent on): then
  ``finished_sending`` frees them. At most ``max_held_blocks`` blocks are held for remote
  decodes at once: past that a prefill answers with no blocks (the decode side computes).
  A read that names another engine id (the producer restarted: a new ``engine_id``), an
  unknown or expired request, a range it does not hold or another prompt is refused. A
  read in progress keeps its blocks from expiring under it.
- consumer: the loaded blocks are the request's own (not cached until loaded). A load
  that fails (refused, past its deadline of ``load_timeout_s``, a digest mismatch) is
  reported in ``failed_recving``: the scheduler frees the blocks and the request computes
  its prompt (vLLM's ``kv_load_failure_policy="recompute"``), tokens unchanged. A request
  aborted while its blocks are read keeps them until the read ends (the bytes land in a
  staging buffer and are copied into the cache only inside a step, never by the reading
  thread), then both sides free.

Options (``kv_connector_extra_config``): ``host`` (the side channel's address, default
127.0.0.1), ``port`` (default 0: any free port; give one so that consumers can allow it),
``allowed_producers`` (consumer: ``["host:port", ...]``, the producers' side channels),
``send_timeout_s`` (default 30: how long a producer holds an unread prefill),
``max_held_blocks`` (default half the pool), ``load_timeout_s`` (default 30: one load,
end to end), ``max_side_channel_connections`` (default 16). One worker process only
(tensor_parallel_size 1): the side channel reads the worker's KV cache in the engine
process.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from microvllm.distributed.kv_transfer.kv_connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from microvllm.distributed.kv_transfer.kv_connector.p2p_protocol import (
    parse_producers,
    prompt_digest,
    prompt_digests,
)
from microvllm.distributed.kv_transfer.kv_connector.p2p_side_channel import (
    RemoteLoad,
    SendEntry,
    SideChannel,
)

if TYPE_CHECKING:
    from microvllm.config import EngineConfig
    from microvllm.core.kv_cache_manager import KVCacheBlocks
    from microvllm.core.kv_cache_spec import KVCacheSpec
    from microvllm.core.request import Request
    from microvllm.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

# The side channel's port of each producer engine in this process (engine id -> port),
# written by the worker side when it binds, read by the scheduler side for its answers.
_SIDE_CHANNEL_PORTS: dict[str, int] = {}
_SIDE_CHANNEL_READY = threading.Condition()


@dataclass
class P2PConnectorMetadata(KVConnectorMetadata):
    """One step's orders: loads to start (consumer), loads still wanted (a load whose
    request left is dropped), releases to send (a remote prefill not read after all), sends
    to serve (producer) and sends given up (their blocks freed: stop serving them now)."""

    reqs_to_load: dict[str, RemoteLoad] = field(default_factory=dict)
    loads_wanted: set[str] = field(default_factory=set)
    reqs_to_release: dict[str, RemoteLoad] = field(default_factory=dict)
    reqs_to_send: dict[str, SendEntry] = field(default_factory=dict)
    sends_given_up: set[str] = field(default_factory=set)
    idle: bool = False   # nothing computed this step: wait a little for a transfer


class P2PConnector(KVConnectorBase):
    """Disaggregated prefill (see the module docstring): kv_producer serves its finished
    prompts' blocks, kv_consumer reads them from the producers it allows."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, num_kv_blocks: int,
                 kv_cache_specs: list[KVCacheSpec]) -> None:
        super().__init__(config, role, num_kv_blocks, kv_cache_specs)
        if len(kv_cache_specs) != 1 or type(kv_cache_specs[0]).__name__ != "FullAttentionSpec":
            raise ValueError("P2PConnector needs a model whose layers all use full attention (one cache group), "
                             f"but its cache groups are {kv_cache_specs}: drop kv_transfer_config")
        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("P2PConnector serves the KV cache of one worker: set tensor_parallel_size=1")
        if not config.cache_config.enable_prefix_caching:
            raise ValueError("P2PConnector hands loaded blocks to the scheduler as prefix-cache hits: "
                             "set enable_prefix_caching=True")
        if self.kv_transfer_config.kv_role == "kv_both":
            raise ValueError('P2PConnector: kv_role is "kv_producer" (prefill) or "kv_consumer" (decode)')
        get = self.kv_transfer_config.get_from_extra_config
        self.host = str(get("host", "127.0.0.1"))
        self.port = int(get("port", 0))
        self.send_timeout_s = float(get("send_timeout_s", 30.0))
        self.load_timeout_s = float(get("load_timeout_s", 30.0))
        self.max_held_blocks = int(get("max_held_blocks", max(1, (num_kv_blocks - 1) // 2)))
        self.max_connections = int(get("max_side_channel_connections", 16))
        self.allowed_producers = parse_producers(get("allowed_producers", None))
        self.engine_id = str(self.kv_transfer_config.engine_id)
        if role == KVConnectorRole.SCHEDULER:
            self._matched: dict[str, tuple[int, int]] = {}     # request -> (first block, count)
            self._tried: set[str] = set()                      # asked once: never loaded twice
            self._loads: dict[str, RemoteLoad] = {}            # not yet handed to the worker
            self._loads_in_flight: dict[str, Request] = {}     # handed over, not reported
            self._aborted_loads: set[str] = set()              # finished while in flight
            self._releases: dict[str, RemoteLoad] = {}
            self._sends: dict[str, SendEntry] = {}
            self._held: dict[str, int] = {}                    # producer: blocks held per request
            self._given_up: set[str] = set()
        else:
            self.side_channel = SideChannel(self.engine_id, self.block_size, self.load_timeout_s,
                                            self.max_connections)

    # ========================================================= scheduler side
    def check_request(self, kv_transfer_params: dict | None, prompt_token_ids: list[int]) -> None:
        """A decode leg (``do_remote_prefill``) must name a producer this instance allows:
        else ``ValueError`` (a 400) naming the setting. Called before the request is queued."""
        params = kv_transfer_params
        if not self.kv_transfer_config.is_kv_consumer or not params or not params.get("do_remote_prefill"):
            return
        self._producer(params)

    def _producer(self, params: dict) -> tuple[str, int]:
        host, port = str(params.get("remote_host") or "").strip("[]").lower(), params.get("remote_port")
        if (host, port) in self.allowed_producers:
            return host, int(port)   # type: ignore[arg-type]
        allowed = sorted(f"{h}:{p}" for h, p in self.allowed_producers)
        raise ValueError(f"kv_transfer_params names the producer {host}:{port}, which this decode instance "
                         f"does not load from: its operator lists producers in kv_transfer_config's "
                         f"kv_connector_extra_config allowed_producers (now {allowed})")

    def request_refused(self, kv_transfer_params: dict | None, prompt_token_ids: list[int] | None) -> None:
        """A decode leg was refused after all (a 400 for another field): tell an allowed
        producer to free the prompt's blocks now rather than at its timeout."""
        params = kv_transfer_params
        if (not self.kv_transfer_config.is_kv_consumer or not params or not params.get("do_remote_prefill")
                or not prompt_token_ids):
            return
        try:
            load = self._remote_load(params, prompt_token_ids, (), 0, len(params.get("remote_block_ids") or ()))
        except (ValueError, TypeError):
            return   # not an allowed producer, malformed, or nothing it could hold: nothing to release
        SideChannel.release_in_background(load, self.load_timeout_s)

    def _remote_load(self, params: dict, prompt_token_ids: list[int], block_ids: tuple[int, ...],
                     first: int, count: int) -> RemoteLoad:
        """What the worker needs to read blocks [first, first + count) from the producer;
        ``ValueError`` if there is nothing to read or no allowed producer is named."""
        count = min(count, len(prompt_token_ids) // self.block_size - first)
        if count <= 0:
            raise ValueError("nothing to read")
        host, port = self._producer(params)
        return RemoteLoad(block_ids=block_ids, first=first, count=count, host=host, port=port,
                          engine_id=str(params.get("remote_engine_id")),
                          request_id=str(params.get("remote_request_id")),
                          prompt_digest=prompt_digest(prompt_token_ids, first + count, self.block_size))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """A ``do_remote_prefill`` request: the prompt's full blocks past the local hit that
        the producer holds, never the last token's block. Asked once per request."""
        params = request.kv_transfer_params
        if (not self.kv_transfer_config.is_kv_consumer or not params or not params.get("do_remote_prefill")
                or request.request_id in self._tried):
            return 0, False
        self._tried.add(request.request_id)
        remote = params.get("remote_block_ids") or []
        first = num_computed_tokens // self.block_size
        last = min(len(remote), (request.num_prompt_tokens - 1) // self.block_size)
        if last <= first:
            self.request_refused(params, request.prompt_token_ids)   # nothing to read: free it there now
            return 0, False
        self._matched[request.request_id] = (first, last - first)
        return (last - first) * self.block_size, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        params = request.kv_transfer_params
        if matched is None or params is None:
            return
        if num_external_tokens == 0:   # no room: the request computes its prompt
            self.request_refused(params, request.prompt_token_ids)
            return
        first, count = matched
        block_ids = tuple(blocks.get_block_ids()[0][first:first + count])
        self._loads[request.request_id] = self._remote_load(params, request.prompt_token_ids, block_ids,
                                                            first, count)
        self._loads_in_flight[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2PConnectorMetadata:
        from microvllm.core.request import RequestStatus
        wanted = {rid for rid, r in self._loads_in_flight.items()
                  if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or rid in self._aborted_loads}
        for rid in set(self._loads_in_flight) - wanted:   # put back by a failed step: forgotten
            del self._loads_in_flight[rid]
            self._loads.pop(rid, None)
        metadata = P2PConnectorMetadata(reqs_to_load=self._loads, loads_wanted=wanted,
                                        reqs_to_release=self._releases, reqs_to_send=self._sends,
                                        sends_given_up=self._given_up,
                                        idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._loads, self._releases, self._sends, self._given_up = {}, {}, {}, set()
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A load ended (read or failed): a request aborted meanwhile frees its blocks now.
        A send ended: its blocks no longer count against ``max_held_blocks``."""
        for request_id in connector_output.finished_sending or ():
            self._held.pop(request_id, None)
            self._sends.pop(request_id, None)
            self._given_up.add(request_id)   # freed (read, expired or undone): never served again
        ended = (connector_output.finished_recving or set()) | (connector_output.failed_recving or set())
        for request_id in ended:
            self._loads_in_flight.pop(request_id, None)
            if request_id in self._aborted_loads:
                self._aborted_loads.discard(request_id)
                connector_output.finished_sending = (connector_output.finished_sending or set()) | {request_id}

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        from microvllm.core.request import RequestStatus
        request_id = request.request_id
        self._matched.pop(request_id, None)
        self._tried.discard(request_id)
        load = self._loads.pop(request_id, None)
        if load is not None:            # aborted before its read started: tell the producer
            self._loads_in_flight.pop(request_id, None)
            self._releases[request_id] = load
        if request_id in self._loads_in_flight:   # being read into its blocks: free them after
            self._aborted_loads.add(request_id)
            return True, None
        params = request.kv_transfer_params
        if (not self.kv_transfer_config.is_kv_producer or not params or not params.get("do_remote_decode")
                or request.status != RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None
        num_full = min(request.num_prompt_tokens // self.block_size, len(block_ids[0]))
        held = sum(self._held.values())
        if held + num_full > self.max_held_blocks:
            logger.warning("holding %d blocks for remote decodes already (max_held_blocks %d): request %r's "
                           "decode side computes its prompt", held, self.max_held_blocks, request_id)
            num_full = 0
        digests = prompt_digests(request.prompt_token_ids[:num_full * self.block_size], self.block_size)
        remote_block_ids = tuple(block_ids[0][:num_full])
        answer = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                  "remote_block_ids": list(remote_block_ids), "remote_host": self.host,
                  "remote_port": self._side_channel_port(), "remote_request_id": request_id,
                  "remote_prompt_digest": digests[-1] if digests else None, "tp_size": 1}
        if not remote_block_ids:
            return False, answer
        self._sends[request_id] = SendEntry(remote_block_ids, tuple(digests), time.monotonic() + self.send_timeout_s)
        self._held[request_id] = num_full
        return True, answer

    def _side_channel_port(self) -> int:
        with _SIDE_CHANNEL_READY:
            _SIDE_CHANNEL_READY.wait_for(lambda: self.engine_id in _SIDE_CHANNEL_PORTS, timeout=30)
            return _SIDE_CHANNEL_PORTS[self.engine_id]

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        self.side_channel.kv_caches = kv_caches
        if not self.kv_transfer_config.is_kv_producer:
            return
        port = self.side_channel.listen(self.host, self.port)
        with _SIDE_CHANNEL_READY:
            _SIDE_CHANNEL_PORTS[self.engine_id] = port
            _SIDE_CHANNEL_READY.notify_all()

    def _metadata(self) -> P2PConnectorMetadata:
        metadata = self._get_connector_metadata()
        return metadata if isinstance(metadata, P2PConnectorMetadata) else P2PConnectorMetadata()

    def start_load_kv(self, **kwargs: Any) -> None:
        metadata = self._metadata()
        self.side_channel.serve(metadata.reqs_to_send, metadata.sends_given_up)
        for request_id, load in metadata.reqs_to_load.items():
            self.side_channel.read_in_background(request_id, load)
        for load in metadata.reqs_to_release.values():
            SideChannel.release_in_background(load, self.load_timeout_s)

    def wait_for_save(self) -> None:
        """Nothing to save: the producer's blocks are read in place by the side channel."""

    def get_finished(self, finished_req_ids: frozenset[str] | set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Copy the reads that arrived into the cache (here, inside the step: never from the
        reading thread); expire sends past their deadline. An idle step waits up to 20 ms
        for a transfer instead of spinning."""
        metadata = self._metadata()
        sending, staged = self.side_channel.collect(metadata.loads_wanted | set(metadata.reqs_to_load),
                                                    wait=metadata.idle)
        recving: set[str] = set()
        self._failed: set[str] = set()
        for request_id, (load, tensors) in staged.items():
            if tensors is None:
                self._failed.add(request_id)
                continue
            self.side_channel.copy_into_cache(load.block_ids, tensors)
            recving.add(request_id)
        return sending or None, recving or None

    def get_failed_recving(self) -> set[str] | None:
        failed: set[str] = getattr(self, "_failed", set())
        self._failed = set()
        return failed or None

    def shutdown(self) -> None:
        if getattr(self, "side_channel", None) is not None:
            self.side_channel.shutdown()
