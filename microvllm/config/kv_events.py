"""``KVEventsConfig``: whether and where the engine publishes its KV cache events
(vLLM: ``vllm/config/kv_events.py``, the same fields; two defaults differ, below). Given
as vLLM takes it, a dict or its JSON::

    LLM(kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": "tcp://127.0.0.1:5557",
                          "replay_endpoint": "tcp://127.0.0.1:5558"})
    microvllm serve --kv-events-config '{"enable_kv_cache_events": true}'

    enable_kv_cache_events   the block pool records events (off: it records nothing)
    publisher                "zmq" (default when enabled) or "null" (records, sends nothing)
    endpoint                 the ZMQ PUB socket: bound if its host is a wildcard ("*",
                             "0.0.0.0", "::") or loopback (127.x.x.x, "::1"), or it is
                             ipc:// or inproc://; else connected (vLLM's rule, plus loopback)
    replay_endpoint          a ROUTER socket that resends buffered batches (None: none)
    buffer_steps             how many past batches the replay socket can resend (one
                             request gets at most ``REPLAY_MAX_BATCHES`` of them)
    hwm                      the PUB socket's high-water mark (messages queued per subscriber)
    max_queue_size           batches waiting for the publisher thread before publish() blocks
    topic                    the first frame of every message (subscribers filter on it)

Where we differ from vLLM, and why: vLLM's default endpoint is ``tcp://*:5557`` (every
network interface) and it keeps 10,000 batches for replay. A ``BlockStored`` event carries
the token ids of the prompt that filled the block, so this socket carries every user's
prompt, and the replay socket hands past ones to whoever asks. microvllm's HTTP API binds
127.0.0.1 by default; the events do too (``tcp://127.0.0.1:5557``), and the replay buffer
keeps 1,000 batches. A router on another host needs ``"endpoint": "tcp://*:5557"`` and a
firewall that lets only the router in: binding a wildcard logs a warning that says so.

``microvllm/distributed/kv_events.py`` builds the publisher from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """A resolved ``kv_events_config`` (see the module docstring); frozen."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None       # None: "zmq" when enabled, else "null" (as vLLM)
    endpoint: str = "tcp://127.0.0.1:5557"   # vLLM: "tcp://*:5557" (see the module docstring)
    replay_endpoint: str | None = None
    buffer_steps: int = 1_000                 # vLLM: 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")

    @classmethod
    def from_dict(cls, options: dict | str) -> "KVEventsConfig":
        """Check every key and value; a JSON string is parsed first (the CLI's form)."""
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as error:
                raise ValueError(f"kv_events_config={options!r} is not valid JSON ({error}): give a dict such as "
                                 '\'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}\'') from None
        if isinstance(options, KVEventsConfig):
            return options
        if not isinstance(options, dict):
            raise TypeError(f"kv_events_config={options!r} must be a dict such as "
                            '{"enable_kv_cache_events": True, "publisher": "zmq"}')
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"kv_events_config has unknown key(s) {unknown}: the keys are {known}")
        config = cls(**options)
        config._check()
        return config

    def _check(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise TypeError(f"kv_events_config enable_kv_cache_events={self.enable_kv_cache_events!r} "
                            "must be true or false")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config publisher={self.publisher!r} is not a publisher: choose one "
                             f"of {list(PUBLISHERS)}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"kv_events_config {name}={getattr(self, name)!r} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise TypeError(f"kv_events_config replay_endpoint={self.replay_endpoint!r} must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config {name}={value!r} must be an int of at least 1")
