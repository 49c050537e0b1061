"""``kv_transfer_params``: what a client may send, checked before anything reads it.

In disaggregated serving the router (vllm-router, or any client) carries these fields
from the prefill instance's answer to the decode instance's request (vLLM's NIXL
protocol). They arrive in a request body, so they are *untrusted input*: a field of the
wrong type, a list a thousand times too long or a key nobody knows is refused here, at
the API layer, with a 400 that names the field, never deep inside the scheduler::

    {"do_remote_decode":  bool,          prefill leg: keep the prompt's KV for a decode side
     "do_remote_prefill": bool,          decode leg: the KV waits at a producer
     "remote_engine_id":  str | null,    the producer engine (its id changes on restart)
     "remote_block_ids":  [int] | null,  the producer's blocks (only their count is used)
     "remote_host":       str | null,    the producer's side channel: must be one the decode
     "remote_port":       int | null,      side's operator allowed (``allowed_producers``)
     "remote_request_id": str | null,    the request at the producer
     "remote_prompt_digest": str | null, informational (the producer checks its own)
     "tp_size":           int | null,    the producer's tensor-parallel size
     "remote_dp_rank", "remote_dp_size": int | null,  vLLM's data-parallel fields: accepted,
     "remote_bootstrap_addr": str | null}             unused here (one engine per side)

Passing this check makes a request well formed, not trusted: *where* a decode side may
connect is the operator's setting, never the request's (``P2PConnector``'s
``allowed_producers``), and what enters its prefix cache is checked against the
producer's own digest of the tokens it prefilled.
"""

from __future__ import annotations

from typing import Any

MAX_BLOCK_IDS = 1 << 16      # a prompt of a million tokens in blocks of 16
MAX_ID_CHARS = 256           # engine and request ids
MAX_HOST_CHARS = 253         # the longest DNS name

_BOOLS = ("do_remote_decode", "do_remote_prefill")
_STRINGS = {"remote_engine_id": MAX_ID_CHARS, "remote_host": MAX_HOST_CHARS,
            "remote_request_id": MAX_ID_CHARS, "remote_prompt_digest": 64,
            "remote_bootstrap_addr": MAX_HOST_CHARS + 6}
_INTS = {"remote_port": (1, 65535), "tp_size": (1, 1024), "remote_dp_rank": (0, 1023), "remote_dp_size": (1, 1024)}
KNOWN_KEYS = (*_BOOLS, *_STRINGS, *_INTS, "remote_block_ids")


def check_kv_transfer_params(value: Any) -> dict[str, Any]:
    """Return ``value`` as a dict if it is well formed (see the module docstring); else
    raise ``ValueError`` naming the field: ``kv_transfer_params.remote_port must be ...``."""
    if not isinstance(value, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(value).__name__}")
    unknown = sorted(str(key) for key in value if key not in KNOWN_KEYS)
    if unknown:
        raise ValueError(f"kv_transfer_params has unknown key(s) {unknown[:5]}: the keys are {list(KNOWN_KEYS)}")
    for key in _BOOLS:
        if value.get(key) is not None and not isinstance(value[key], bool):
            raise ValueError(f"kv_transfer_params.{key} must be true or false, got {value[key]!r:.40}")
    for key, limit in _STRINGS.items():
        item = value.get(key)
        if item is not None and (not isinstance(item, str) or len(item) > limit):
            raise ValueError(f"kv_transfer_params.{key} must be a string of at most {limit} characters "
                             f"(or null), got {item!r:.40}")
    for key, (low, high) in _INTS.items():
        item = value.get(key)
        if item is not None and (type(item) is not int or not low <= item <= high):
            raise ValueError(f"kv_transfer_params.{key} must be an integer in [{low}, {high}] (or null), "
                             f"got {item!r:.40}")
    block_ids = value.get("remote_block_ids")
    if block_ids is not None:
        if not isinstance(block_ids, list) or len(block_ids) > MAX_BLOCK_IDS:
            raise ValueError(f"kv_transfer_params.remote_block_ids must be a list of at most {MAX_BLOCK_IDS} "
                             f"block ids (or null), got {block_ids!r:.40}")
        if not all(type(b) is int and 0 <= b < 2**31 for b in block_ids):
            raise ValueError("kv_transfer_params.remote_block_ids must hold non-negative integers below 2**31")
    if value.get("do_remote_prefill") and value.get("do_remote_decode"):
        raise ValueError("kv_transfer_params: do_remote_prefill and do_remote_decode cannot both be true")
    return value

